package topology

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"golang.org/x/sync/errgroup"

	"github.com/allot-dev/allot/examples"
	"github.com/allot-dev/allot/pkg/allocator"
	"github.com/allot-dev/allot/pkg/lease"
	"github.com/allot-dev/allot/pkg/policy"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// DemoConfig configures the local multi-region run of deploy/multiregion.
type DemoConfig struct {
	// Allocators is the number of allocator nodes.
	Allocators int
	// Regions maps region name to offered requests per second for Quota.
	Regions map[string]float64
	// Quota is the leased quota the regions spend (default p-tenant-atlas).
	Quota string
	// Window rescales Quota's window (TTL becomes a quarter of it) so a run
	// takes seconds; 0 keeps the policy's window.
	Window time.Duration
	// Windows is how many full windows to report before stopping; 0 runs
	// until ctx ends.
	Windows int
	// Keep keeps the topology running after the last window until ctx ends,
	// for trying the API by hand.
	Keep bool
	// Dir holds binaries and data; it is removed at the end unless KeepDir.
	Dir string
	// KeepDir keeps Dir after the run.
	KeepDir bool
	// Root is the module root to build binaries from.
	Root string
	// Policy is the policy document (default: the embedded Northstar example).
	Policy []byte
}

// RunDemo builds the binaries, starts the allocator cluster, publishes the
// policy (with Quota's window rescaled), drives the regions' demand and
// prints a table per window, then cleans up every process and file it made.
func RunDemo(ctx context.Context, cfg DemoConfig, out io.Writer) (err error) {
	if cfg.Quota == "" {
		cfg.Quota = "p-tenant-atlas"
	}
	if len(cfg.Regions) == 0 {
		return errors.New("demo: no regions")
	}
	doc := cfg.Policy
	if doc == nil {
		doc = examples.Northstar
	}
	parsed, err := policy.Parse(doc)
	if err != nil {
		return fmt.Errorf("policy: %w", err)
	}
	rule := parsed.Rule(cfg.Quota)
	if rule == nil || rule.Kind != policy.KindGlobalQuota {
		return fmt.Errorf("policy has no global quota %q", cfg.Quota)
	}
	if cfg.Window > 0 {
		rule.Window = cfg.Window
		rule.Lease.TTL = cfg.Window / 4
	}
	var names []string
	for name := range cfg.Regions {
		names = append(names, name)
	}
	sort.Strings(names)
	parsed.Regions = names
	canonical, err := policy.Canonical(parsed)
	if err != nil {
		return err
	}
	if _, err := policy.Parse(canonical); err != nil {
		return fmt.Errorf("rescaled policy: %w", err)
	}

	if cfg.Dir == "" {
		if cfg.Dir, err = os.MkdirTemp("", "allot-multiregion-"); err != nil {
			return err
		}
	}
	if !cfg.KeepDir {
		defer os.RemoveAll(cfg.Dir)
	}
	fmt.Fprintf(out, "building binaries into %s/bin ...\n", cfg.Dir)
	bins, err := Build(ctx, cfg.Root, cfg.Dir+"/bin", "./cmd/allocator", "./cmd/allotctl")
	if err != nil {
		return err
	}
	logf, err := os.Create(cfg.Dir + "/allocators.log")
	if err != nil {
		return err
	}
	defer logf.Close()
	startCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	allocs, err := StartAllocators(startCtx, AllocatorConfig{Nodes: cfg.Allocators, Bin: bins["./cmd/allocator"], Dir: cfg.Dir + "/data", Output: logf})
	cancel()
	if err != nil {
		return err
	}
	defer func() {
		fmt.Fprintln(out, "stopping allocators ...")
		err = errors.Join(err, allocs.Close(10*time.Second))
	}()
	eps := allocs.Endpoints()
	fmt.Fprintf(out, "allocator cluster up: %s (logs: %s/allocators.log)\n", strings.Join(eps, ", "), cfg.Dir)
	fmt.Fprintf(out, "try: %s -addr %s cluster | bound | window %s\n", bins["./cmd/allotctl"], strings.Join(eps, ","), cfg.Quota)

	client, err := allocator.NewClient(eps)
	if err != nil {
		return err
	}
	op := client.Operator()
	pub, err := op.PublishPolicy(ctx, &allotv1.PublishPolicyRequest{Document: canonical, ExpectedVersion: 1, Author: "multiregion", Reason: "demo with " + cfg.Quota + " window " + rule.Window.String()})
	if err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	bnd, err := op.GetBound(ctx, &allotv1.GetBoundRequest{Quota: cfg.Quota})
	if err != nil {
		return fmt.Errorf("bound: %w", err)
	}
	b := bnd.GetBounds()[0]
	fmt.Fprintf(out, "policy v%d published; %s: G=%d per %s, chunk %d, TTL %s, stated bound +%d (admitted per window <= %d)\n",
		pub.GetPolicy().GetVersion(), cfg.Quota, rule.Limit, rule.Window, rule.Lease.Chunk, rule.Lease.TTL, b.GetOvershoot(), b.GetMaxAdmittedPerWindow())
	fmt.Fprintln(out, "regions are simulated demand spending leased chunks (the region agent arrives with its own issue); Ctrl-C stops")

	windowMs := rule.Window.Milliseconds()
	g, gctx := errgroup.WithContext(ctx)
	runCtx, stopRegions := context.WithCancel(gctx)
	defer stopRegions()
	regions := make([]*SimRegion, len(names))
	for i, name := range names {
		rate := cfg.Regions[name]
		regions[i] = &SimRegion{
			// The margin the allocator states in the bound (its default config).
			Name: name, Quota: cfg.Quota, Rate: rate, WindowMs: windowMs, Client: client, Margin: allocator.DefaultConfig().LeaseMargin,
			// Renew when a third of a lease is left at the current rate.
			Sizing: lease.Sizing{MinChunk: 1, MaxChunk: rule.Lease.Chunk, Lead: rule.Lease.TTL / 3, RTT: 20 * time.Millisecond},
		}
		r := regions[i]
		g.Go(func() error { return r.Run(runCtx) })
	}
	g.Go(func() error {
		defer stopRegions()
		first := lease.WindowIndex(time.Now().UnixMilli(), windowMs) + 1
		for w, n := first, 0; cfg.Windows == 0 || n < cfg.Windows; w, n = w+1, n+1 {
			// Report window w once it has ended (plus a little for stragglers).
			wait := time.Until(time.UnixMilli(lease.WindowEnd(w, windowMs)).Add(200 * time.Millisecond))
			select {
			case <-runCtx.Done():
				return nil
			case <-time.After(wait):
			}
			if err := reportWindow(runCtx, out, op, cfg.Quota, w, b, regions); err != nil {
				return err
			}
		}
		if cfg.Keep {
			fmt.Fprintln(out, "keep mode: the topology stays up until Ctrl-C")
			<-runCtx.Done()
		}
		return nil
	})
	return g.Wait()
}

func reportWindow(ctx context.Context, out io.Writer, op *allocator.OperatorClient, quota string, w int64, b *allotv1.QuotaBound, regions []*SimRegion) error {
	led, err := op.GetWindow(ctx, &allotv1.GetWindowRequest{Quota: quota, WindowIndex: w})
	if err != nil {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("window %d: %w", w, err)
	}
	granted := map[string]int64{}
	for _, r := range led.GetRegions() {
		granted[r.GetRegion()] = r.GetGranted()
	}
	fmt.Fprintf(out, "\nwindow %d [%s, %s)  G=%d  stated bound +%d\n", w,
		time.UnixMilli(led.GetWindowStartUnixMs()).Format("15:04:05"), time.UnixMilli(led.GetWindowEndUnixMs()).Format("15:04:05"),
		led.GetLimit(), b.GetOvershoot())
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "region\tdemand\tgranted\tadmitted\tdenied\tstranded\t")
	var tot RegionWindowStats
	for _, r := range regions {
		s := r.Stats(w)
		fmt.Fprintf(tw, "%s\t%d\t%d\t%d\t%d\t%d\t\n", r.Name, s.Offered, granted[r.Name], s.Admitted, s.Denied, s.Stranded)
		tot.Offered += s.Offered
		tot.Admitted += s.Admitted
		tot.Denied += s.Denied
		tot.Stranded += s.Stranded
	}
	fmt.Fprintf(tw, "total\t%d\t%d\t%d\t%d\t%d\t\n", tot.Offered, led.GetGranted(), tot.Admitted, tot.Denied, tot.Stranded)
	if err := tw.Flush(); err != nil {
		return err
	}
	verdict := "ok"
	if tot.Admitted > b.GetMaxAdmittedPerWindow() {
		verdict = "VIOLATION"
	}
	_, err = fmt.Fprintf(out, "admitted %d <= G + bound = %d: %s\n", tot.Admitted, b.GetMaxAdmittedPerWindow(), verdict)
	return err
}
