package loadgen

import (
	"context"
	"fmt"
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
	var cfg Config
	if err := history.ReadConfig(configPath, &cfg); err != nil {
		return err
	}
	conn, out, err := history.DialControl(ctlPath, cfg.Region+HelloSuffix)
	if err != nil {
		return err
	}
	defer conn.Close()
	defer out.Close()
	client := allotv1connect.NewAdmissionServiceClient(NewHTTPClient(), "http://"+cfg.Agent)
	g, err := New(cfg, history.TrueClock{Offset: cfg.ClockOffset}, client, func(ev history.Event) {
		_ = out.Send(history.Message{Event: &ev})
	})
	if err != nil {
		return err
	}
	return history.ServeCommands(ctx, conn, out, g.Run, func(_ context.Context, c *history.Command) error {
		switch c.Op {
		case history.OpDemand:
			return g.SetDemand(c.Quota, c.Rate)
		case history.OpStorm:
			g.Storm(c.N)
			return nil
		}
		return fmt.Errorf("unknown op %q", c.Op)
	}, func(ctx context.Context) error {
		sctx, scancel := context.WithTimeout(ctx, cfg.RetryFor+cfg.CallTimeout+5*time.Second)
		defer scancel()
		err := g.Stop(sctx)
		if shed, none := g.Counts(); shed > 0 || none > 0 {
			fmt.Fprintf(os.Stderr, "loadgen %s: %d requests shed (too many in flight), %d never answered\n", cfg.Region, shed, none)
		}
		return err
	})
}
