// Command chaosregion is the chaos suite's region-side process. The suite
// starts it inside the region's network namespace in one of two modes:
//
//	ip netns exec allotc-eu chaosregion -config eu.json -ctl /tmp/run/ctl.sock             # the region driver (package chaos/driver)
//	ip netns exec allotc-eu chaosregion -mode load -config eu-load.json -ctl /tmp/run/ctl.sock  # the load generator of an agent region (package chaos/loadgen)
//
// Either connects to the suite's control socket (a path, which no network
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
	"github.com/allot-dev/allot/chaos/loadgen"
	"github.com/allot-dev/allot/chaos/wan"
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
	mode := fs.String("mode", "driver", "driver (lease and spend on its own), load (offer requests to a region agent) or wan (proxy the region's links to the allocators)")
	config := fs.String("config", "", "config (JSON of driver.Config; of loadgen.Config with -mode load; of wan.Config with -mode wan)")
	ctl := fs.String("ctl", "", "the suite's control socket (unix path)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *config == "" || *ctl == "" {
		return fmt.Errorf("-config and -ctl are required")
	}
	switch *mode {
	case "driver":
		return driver.Serve(ctx, *config, *ctl)
	case "load":
		return loadgen.Serve(ctx, *config, *ctl)
	case "wan":
		return wan.Serve(ctx, *config, *ctl)
	}
	return fmt.Errorf("-mode %q: want driver, load or wan", *mode)
}
