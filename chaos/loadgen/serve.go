package loadgen

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
	"github.com/allot-dev/allot/proto/allot/v1/allotv1connect"
)

// HelloSuffix ends the hello of a load generator on the control socket
// ("eu" + HelloSuffix), which tells it from region eu's other processes.
const HelloSuffix = "/load"

// Serve runs a load generator process: it reads its Config from
// configPath, dials the suite's control socket ctlPath, says hello, streams
// events, and obeys commands (demand, storm, stop) until the suite says
// stop, ctx ends or the suite goes away.
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
	if err := out.Send(history.Message{Hello: cfg.Region + HelloSuffix}); err != nil {
		return err
	}
	client := allotv1connect.NewAdmissionServiceClient(NewHTTPClient(), "http://"+cfg.Agent)
	g, err := New(cfg, history.TrueClock{Offset: cfg.ClockOffset}, client, func(ev history.Event) {
		_ = out.Send(history.Message{Event: &ev})
	})
	if err != nil {
		return err
	}
	runCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	runErr := make(chan error, 1)
	go func() { runErr <- g.Run(runCtx) }()

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
		ack := &history.Ack{Seq: c.Seq}
		var cerr error
		switch c.Op {
		case history.OpDemand:
			cerr = g.SetDemand(c.Quota, c.Rate)
		case history.OpStorm:
			g.Storm(c.N)
		case history.OpStop:
			sctx, scancel := context.WithTimeout(ctx, cfg.RetryFor+cfg.CallTimeout+5*time.Second)
			cerr = g.Stop(sctx)
			scancel()
			cancel()
			err := <-runErr
			if shed, none := g.Counts(); shed > 0 || none > 0 {
				fmt.Fprintf(os.Stderr, "loadgen %s: %d requests shed (too many in flight), %d never answered\n", cfg.Region, shed, none)
			}
			if cerr != nil {
				ack.Err = cerr.Error()
			}
			out.Flush()
			_ = out.Send(history.Message{Ack: ack})
			out.Flush()
			return err
		default:
			cerr = fmt.Errorf("unknown op %q", c.Op)
		}
		if cerr != nil {
			ack.Err = cerr.Error()
		}
		if err := out.Send(history.Message{Ack: ack}); err != nil {
			cancel()
			return errors.Join(<-runErr, err)
		}
	}
}
