// Command multiregion runs allot's local multi-region topology on one machine,
// all real processes: an allocator cluster (Raft over loopback TCP), and per
// region a redis-server of its own (or the agent's embedded store when
// redis-server is not installed) and a region agent leasing from the
// cluster, optionally behind a WAN delay. It publishes the Northstar policy
// with the P-TENANT windows of Atlas and Birch rescaled to seconds, floods
// Atlas and sends Birch's steady traffic through every agent's Check API,
// and prints a table per window: demand, granted, admitted, denied and
// stranded against G and the stated bound, and whether Birch was ever
// denied. It stops after -windows windows or on Ctrl-C and removes every
// process and file it made.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"

	"github.com/allot-dev/allot/pkg/topology"
)

func main() {
	// SIGHUP too: closing the terminal (or losing the SSH session) must stop
	// the topology as Ctrl-C does, not leave its processes behind.
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM, syscall.SIGHUP)
	err := run(ctx, os.Args[1:])
	stop()
	if err != nil && !errors.Is(err, flag.ErrHelp) {
		fmt.Fprintln(os.Stderr, "multiregion:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string) error {
	cfg := topology.DefaultDemoConfig()
	fs := flag.NewFlagSet("multiregion", flag.ContinueOnError)
	fs.IntVar(&cfg.Allocators, "allocators", cfg.Allocators, "allocator nodes")
	regions := fs.String("regions", strings.Join(cfg.Regions, ","), "regions, comma-separated; each gets its own store and agent")
	atlas := fs.String("atlas", "", "Atlas's offered requests/s: region=rate,... or a total spread over the regions\n"+
		"(default: 500/s, 90% to the first region, the reference design's EU 900 / US 100 split, 3x G per 6s window)")
	birch := fs.String("birch", "", "Birch's offered requests/s: region=rate,... or a total spread evenly (default 300)")
	fs.DurationVar(&cfg.Window, "window", cfg.Window, "rescale the Atlas and Birch windows to this (lease TTL = a quarter); 0 keeps the policy's")
	fs.IntVar(&cfg.Windows, "windows", cfg.Windows, "windows to report before stopping; 0 runs until Ctrl-C")
	fs.DurationVar(&cfg.WANLatency, "wan-latency", 0, "one-way delay between each region and the allocators (a proxy per link); 0 for none")
	fs.StringVar(&cfg.Store, "store", "", "regions' store: redis or embedded (default: redis when redis-server is installed)")
	fs.BoolVar(&cfg.Keep, "keep", false, "after the last window, stop the load and keep the topology up until Ctrl-C, to try the API by hand")
	fs.StringVar(&cfg.Dir, "data-dir", "", "directory for binaries, data and logs, kept at the end (default: a temporary one, removed)")
	fs.BoolVar(&cfg.KeepDir, "keep-data", false, "do not remove the temporary data dir at the end")
	policyFile := fs.String("policy", "", "policy file with p-tenant-atlas and p-tenant-birch (default: the embedded Northstar example)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	cfg.Regions = strings.Split(*regions, ",")
	var err error
	if cfg.Atlas, err = parseRates(*atlas, cfg.Regions); err != nil {
		return fmt.Errorf("-atlas: %w", err)
	}
	if cfg.Birch, err = parseRates(*birch, cfg.Regions); err != nil {
		return fmt.Errorf("-birch: %w", err)
	}
	if *policyFile != "" {
		if cfg.Policy, err = os.ReadFile(*policyFile); err != nil {
			return err
		}
	}
	wd, err := os.Getwd()
	if err != nil {
		return err
	}
	if cfg.Root, err = topology.ModuleRoot(wd); err != nil {
		return err
	}
	err = topology.RunDemo(ctx, cfg, os.Stdout)
	if ctx.Err() != nil && errors.Is(err, context.Canceled) {
		return nil // Ctrl-C while starting: everything is cleaned up
	}
	return err
}

// parseRates parses "eu=450,us=50" or a total ("500", spread evenly over
// regions); "" is nil (the demo's default).
func parseRates(s string, regions []string) (map[string]float64, error) {
	if s == "" {
		return nil, nil
	}
	if total, err := strconv.ParseFloat(s, 64); err == nil {
		out := map[string]float64{}
		for _, r := range regions {
			out[r] = total / float64(len(regions))
		}
		return out, nil
	}
	out := map[string]float64{}
	for _, kv := range strings.Split(s, ",") {
		name, rate, ok := strings.Cut(kv, "=")
		v, err := strconv.ParseFloat(rate, 64)
		if !ok || err != nil || name == "" {
			return nil, fmt.Errorf("%q is not region=rate", kv)
		}
		out[name] = v
	}
	return out, nil
}
