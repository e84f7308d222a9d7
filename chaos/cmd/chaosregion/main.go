// Command chaosregion is the chaos suite's region driver process (see
// package chaos/driver). The suite starts it inside the region's network
// namespace:
//
//	ip netns exec allotc-eu chaosregion -config eu.json -ctl /tmp/run/ctl.sock
//
// It connects to the suite's control socket (a path, which no network
// partition can cut), streams its events there as JSON lines, and obeys the
// commands it reads back (demand, skew, storm, stop).
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"github.com/allot-dev/allot/chaos/driver"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:])
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "chaosregion:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("chaosregion", flag.ContinueOnError)
	config := fs.String("config", "", "driver config (JSON of driver.Config)")
	ctl := fs.String("ctl", "", "the suite's control socket (unix path)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *config == "" || *ctl == "" {
		return fmt.Errorf("-config and -ctl are required")
	}
	return driver.Serve(ctx, *config, *ctl)
}
