// Command multiregion runs allot's local multi-region topology on one machine:
// an allocator cluster (real processes, Raft over loopback TCP), the Northstar
// policy with P-TENANT for Atlas rescaled to a short window, and regions
// spending leased chunks by demand, with a table per window of demand,
// granted, admitted, denied and stranded tokens against G and the stated
// bound. It stops after -windows windows or on Ctrl-C and removes everything
// it made.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/allot-dev/allot/pkg/topology"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:])
	stop()
	if err != nil {
		fmt.Fprintln(os.Stderr, "multiregion:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string) error {
	cfg := topology.DemoConfig{}
	fs := flag.NewFlagSet("multiregion", flag.ContinueOnError)
	fs.IntVar(&cfg.Allocators, "allocators", 3, "allocator nodes")
	regions := fs.String("regions", "eu=150,us=16.7", "region=offered requests per second, comma-separated (the reference design's EU 900 / US 100 per window of 6s)")
	fs.StringVar(&cfg.Quota, "quota", "p-tenant-atlas", "the leased quota the regions spend")
	fs.DurationVar(&cfg.Window, "window", 6*time.Second, "rescale the quota's window to this (TTL = a quarter); 0 keeps the policy's")
	fs.IntVar(&cfg.Windows, "windows", 5, "windows to report before stopping; 0 runs until Ctrl-C")
	fs.BoolVar(&cfg.Keep, "keep", false, "keep the topology up after the last window until Ctrl-C, to try the API by hand")
	fs.StringVar(&cfg.Dir, "data-dir", "", "directory for binaries, data and logs (default: a temporary one, removed at the end)")
	fs.BoolVar(&cfg.KeepDir, "keep-data", false, "do not remove the data dir at the end")
	policyFile := fs.String("policy", "", "policy file (default: the embedded Northstar example)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	cfg.Regions = map[string]float64{}
	for _, kv := range strings.Split(*regions, ",") {
		name, rate, ok := strings.Cut(kv, "=")
		r, err := strconv.ParseFloat(rate, 64)
		if !ok || err != nil || r < 0 || name == "" {
			return fmt.Errorf("-regions: %q is not region=rate", kv)
		}
		cfg.Regions[name] = r
	}
	if *policyFile != "" {
		b, err := os.ReadFile(*policyFile)
		if err != nil {
			return err
		}
		cfg.Policy = b
	}
	wd, err := os.Getwd()
	if err != nil {
		return err
	}
	if cfg.Root, err = topology.ModuleRoot(wd); err != nil {
		return err
	}
	return topology.RunDemo(ctx, cfg, os.Stdout)
}
