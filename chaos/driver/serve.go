package driver

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"os"
	"time"

	"github.com/allot-dev/allot/chaos/history"
	"github.com/allot-dev/allot/pkg/allocator"
)

// Serve runs a driver process: it reads its Config from configPath, dials
// the suite's control socket ctlPath, says hello, streams events, and obeys
// commands until the suite says stop (or ctx ends, or the suite goes away).
func Serve(ctx context.Context, configPath, ctlPath string) error {
	b, err := os.ReadFile(configPath)
	if err != nil {
		return err
	}
	var cfg Config
	if err := json.Unmarshal(b, &cfg); err != nil {
		return fmt.Errorf("config %s: %w", configPath, err)
	}
	conn, err := net.Dial("unix", ctlPath)
	if err != nil {
		return err
	}
	defer conn.Close()
	out := history.NewWire(conn)
	defer out.Close()
	if err := out.Send(history.Message{Hello: cfg.Region}); err != nil {
		return err
	}
	client, err := allocator.NewClient(cfg.Endpoints, allocator.WithHTTPClient(NewHTTPClient()),
		allocator.WithAttempts(4), allocator.WithBackoff(50*time.Millisecond))
	if err != nil {
		return err
	}
	d, err := New(cfg, history.TrueClock{Offset: cfg.ClockOffset}, client, func(ev history.Event) {
		_ = out.Send(history.Message{Event: &ev})
	})
	if err != nil {
		return err
	}
	// Each command has 30 s; a driver answers far sooner unless the
	// allocators are unreachable.
	const commandTimeout = 30 * time.Second
	return history.ServeCommands(ctx, conn, out, d.Run, func(ctx context.Context, c *history.Command) error {
		cctx, ccancel := context.WithTimeout(ctx, commandTimeout)
		defer ccancel()
		switch c.Op {
		case history.OpDemand:
			return d.SetDemand(cctx, c.Quota, c.Rate)
		case history.OpSkew:
			d.SetSkew(time.Duration(c.Skew))
			return nil
		case history.OpStorm:
			return d.Storm(cctx, c.N)
		}
		return fmt.Errorf("unknown op %q", c.Op)
	}, func(ctx context.Context) error {
		cctx, ccancel := context.WithTimeout(ctx, commandTimeout)
		defer ccancel()
		return d.Stop(cctx)
	})
}
