package driver

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
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
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	runErr := make(chan error, 1)
	go func() { runErr <- d.Run(runCtx) }()

	dec := json.NewDecoder(bufio.NewReader(conn))
	for {
		var m history.Message
		if err := dec.Decode(&m); err != nil {
			cancel() // the suite is gone: stop at once
			return errors.Join(<-runErr, fmt.Errorf("control socket: %w", err))
		}
		if m.Command == nil {
			continue
		}
		c := m.Command
		var cerr error
		cctx, ccancel := context.WithTimeout(ctx, 30*time.Second)
		switch c.Op {
		case history.OpDemand:
			cerr = d.SetDemand(cctx, c.Quota, c.Rate)
		case history.OpSkew:
			d.SetSkew(time.Duration(c.Skew))
		case history.OpStorm:
			cerr = d.Storm(cctx, c.N)
		case history.OpStop:
			cerr = d.Stop(cctx)
		default:
			cerr = fmt.Errorf("unknown op %q", c.Op)
		}
		ccancel()
		ack := &history.Ack{Seq: c.Seq}
		if cerr != nil {
			ack.Err = cerr.Error()
		}
		if c.Op == history.OpStop {
			cancel()
			err := <-runErr
			out.Flush()
			_ = out.Send(history.Message{Ack: ack})
			out.Flush()
			return err
		}
		if err := out.Send(history.Message{Ack: ack}); err != nil {
			return err
		}
	}
}
