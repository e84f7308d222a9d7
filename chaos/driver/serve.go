package driver

import (
	"context"
	"fmt"
	"time"

	"github.com/allot-dev/allot/chaos/history"
	"github.com/allot-dev/allot/pkg/allocator"
)

// Serve runs a driver process: it reads its Config from configPath, dials
// the suite's control socket ctlPath, says hello, streams events, and obeys
// commands until the suite says stop (or ctx ends, or the suite goes away).
func Serve(ctx context.Context, configPath, ctlPath string) error {
	var cfg Config
	if err := history.ReadConfig(configPath, &cfg); err != nil {
		return err
	}
	conn, out, err := history.DialControl(ctlPath, cfg.Region)
	if err != nil {
		return err
	}
	defer conn.Close()
	defer out.Close()
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
