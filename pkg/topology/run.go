package topology

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/allot-dev/allot/pkg/lease"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// ErrBoundViolated is returned by Run when Atlas's admissions in a reported
// window exceeded G plus the stated bound.
var ErrBoundViolated = errors.New("admitted more than G + the stated bound")

// Users per tenant the load spreads its requests over.
const (
	atlasUsers = 100
	birchUsers = 20
)

// Run offers the Atlas and Birch load through every region's agent and
// prints one table per finished window until cfg.Windows windows are
// reported or ctx ends (a stop, not an error). With cfg.Keep it then stops
// the load and waits for ctx, after printing how to try the API by hand. It
// returns ErrBoundViolated when a window admitted more than G plus the stated
// bound. Call it once.
func (d *Demo) Run(ctx context.Context) error {
	atlas := d.rules[AtlasQuota]
	windowMs := atlas.Window.Milliseconds()
	first := lease.WindowIndex(time.Now().UnixMilli(), windowMs) + 1

	var (
		offerCtx context.Context
		stopLoad context.CancelFunc
	)
	if d.cfg.Windows > 0 {
		end := time.UnixMilli(lease.WindowEnd(first+int64(d.cfg.Windows)-1, windowMs))
		offerCtx, stopLoad = context.WithDeadline(ctx, end)
	} else {
		offerCtx, stopLoad = context.WithCancel(ctx)
	}
	g := newLoadGen(windowMs, d.cfg.MaxInFlight, d.cfg.CallTimeout)
	var streams []stream
	for _, r := range d.cfg.Regions {
		for _, s := range []stream{
			{tenant: "atlas", region: r, rate: d.cfg.Atlas[r], users: atlasUsers, client: d.clients[r]},
			{tenant: "birch", region: r, rate: d.cfg.Birch[r], users: birchUsers, client: d.clients[r]},
		} {
			if s.rate > 0 {
				streams = append(streams, s)
			}
		}
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		g.run(offerCtx, ctx, streams)
	}()
	stop := func() {
		stopLoad()
		<-done
	}
	defer stop()

	var atlasTotal float64
	for _, v := range d.cfg.Atlas {
		atlasTotal += v
	}
	fmt.Fprintf(d.out, "load on %q: Atlas %s (%.1fx G per window); Birch %s; first full window at %s; Ctrl-C stops\n",
		DemoRoute, ratesString(d.cfg.Regions, d.cfg.Atlas), atlasTotal*atlas.Window.Seconds()/float64(atlas.Limit),
		ratesString(d.cfg.Regions, d.cfg.Birch), time.UnixMilli(lease.WindowStart(first, windowMs)).Format("15:04:05"))
	fmt.Fprintf(d.out, "try: %s -addr %s window %s\n", d.bins["./cmd/allotctl"], strings.Join(d.allocs.Endpoints(), ","), AtlasQuota)

	// The ledger is read a little after the window's end; the load's counts
	// of a window are final when it ends.
	grace := 250*time.Millisecond + 2*d.cfg.WANLatency
	var violated []int64
	reported := 0
	for w := first; d.cfg.Windows == 0 || reported < d.cfg.Windows; w++ {
		select {
		case <-ctx.Done():
			return d.verdict(violated, reported)
		case <-time.After(time.Until(time.UnixMilli(lease.WindowEnd(w, windowMs)).Add(grace))):
		}
		ok, err := d.report(ctx, g, w)
		if err != nil {
			if ctx.Err() != nil {
				return d.verdict(violated, reported)
			}
			return err
		}
		reported++
		if !ok {
			violated = append(violated, w)
		}
	}
	stop()
	err := d.verdict(violated, reported)
	if d.cfg.Keep {
		d.printTry()
		<-ctx.Done()
	}
	return err
}

// verdict prints the run's verdict and returns ErrBoundViolated if any
// window violated the bound.
func (d *Demo) verdict(violated []int64, reported int) error {
	if reported == 0 {
		return nil
	}
	if len(violated) > 0 {
		fmt.Fprintf(d.out, "\n%s: VIOLATION in %d of %d windows: %v\n", AtlasQuota, len(violated), reported, violated)
		return fmt.Errorf("%s: %w in windows %v", AtlasQuota, ErrBoundViolated, violated)
	}
	fmt.Fprintf(d.out, "\n%s: admitted <= G + stated bound in all %d windows\n", AtlasQuota, reported)
	return nil
}

// report prints window w's table and reports whether Atlas's admissions
// kept within G plus the stated bound. The verdict needs only the load's
// counts: when the allocators' ledger cannot be read (no leader for 10 s),
// the ledger's columns show "-".
func (d *Demo) report(ctx context.Context, g *loadGen, w int64) (bool, error) {
	atlas := d.rules[AtlasQuota]
	windowMs := atlas.Window.Milliseconds()
	rctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	led, ledErr := d.op.GetWindow(rctx, &allotv1.GetWindowRequest{Quota: AtlasQuota, WindowIndex: w})
	cancel()
	if ledErr != nil && ctx.Err() != nil {
		return false, ctx.Err()
	}
	ledger := map[string]*allotv1.RegionLedger{}
	for _, r := range led.GetRegions() {
		ledger[r.GetRegion()] = r
	}
	// col prints a ledger figure, or "-" without a ledger.
	col := func(v int64) string {
		if ledErr != nil {
			return "-"
		}
		return strconv.FormatInt(v, 10)
	}
	fmt.Fprintf(d.out, "\nwindow %d [%s, %s)  %s G=%d  stated bound +%d\n", w,
		time.UnixMilli(lease.WindowStart(w, windowMs)).Format("15:04:05"), time.UnixMilli(lease.WindowEnd(w, windowMs)).Format("15:04:05"),
		AtlasQuota, atlas.Limit, d.bound.GetOvershoot())
	tw := tabwriter.NewWriter(d.out, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "region\tdemand\tgranted\treturned\tadmitted\tdenied\tunavail\tstranded\t")
	var tot, birch tally
	var stranded int64
	denials := map[string]int64{}
	var notes []string
	if ledErr != nil {
		notes = append(notes, fmt.Sprintf("note: the ledger of window %d could not be read: %v", w, ledErr))
	}
	for _, r := range d.cfg.Regions {
		a := g.snapshot("atlas", r, w)
		b := g.snapshot("birch", r, w)
		granted, returned := ledger[r].GetGranted(), ledger[r].GetReleased()
		s := max(0, granted-returned-a.Admitted)
		fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%d\t%d\t%d\t%s\t\n", r, a.Offered, col(granted), col(returned), a.Admitted, a.Denied, a.Unavailable, col(s))
		stranded += s
		tot.add(a)
		birch.add(b)
		maps.Copy(denials, a.DeniedBy)
		for tenant, t := range map[string]tally{"atlas": a, "birch": b} {
			if t.Failed > 0 || t.Unsent > 0 {
				notes = append(notes, fmt.Sprintf("note: %s %s: %d calls failed (last: %s), %d not sent (%d calls in flight)",
					tenant, r, t.Failed, t.LastError, t.Unsent, d.cfg.MaxInFlight))
			}
		}
	}
	fmt.Fprintf(tw, "total\t%d\t%s\t%s\t%d\t%d\t%d\t%s\t\n", tot.Offered, col(led.GetGranted()), col(led.GetReleased()),
		tot.Admitted, tot.Denied, tot.Unavailable, col(stranded))
	if err := tw.Flush(); err != nil {
		return false, err
	}
	limit := d.bound.GetMaxAdmittedPerWindow()
	ok := tot.Admitted <= limit
	if ok {
		fmt.Fprintf(d.out, "admitted %d <= G + bound = %d: ok\n", tot.Admitted, limit)
	} else {
		fmt.Fprintf(d.out, "admitted %d > G + bound = %d: VIOLATION (%d of them answered in this window for requests sent in the previous one)\n",
			tot.Admitted, limit, tot.Straddled)
	}
	if others := otherRules(denials, AtlasQuota); others != "" {
		fmt.Fprintf(d.out, "atlas denials by other rules: %s\n", others)
	}
	if birch.Offered > 0 {
		verdict := "ok, never denied"
		switch {
		case birch.Denied > 0:
			verdict = "DENIED (by rule: " + otherRules(birch.DeniedBy, "") + ")"
		case birch.Unavailable > 0:
			verdict = "never denied, but the limiter could not decide in time (503) for some"
		}
		if birch.Straddled > 0 {
			// Demand counts requests by when they were sent, answers by
			// when they were decided.
			verdict += fmt.Sprintf(" (%d admitted here were sent in the previous window)", birch.Straddled)
		}
		fmt.Fprintf(d.out, "birch: demand %d, admitted %d, denied %d, unavail %d: %s\n",
			birch.Offered, birch.Admitted, birch.Denied, birch.Unavailable, verdict)
	}
	slices.Sort(notes)
	for _, n := range notes {
		fmt.Fprintln(d.out, n)
	}
	return ok, nil
}

// add adds o's counts to t.
func (t *tally) add(o tally) {
	t.Offered += o.Offered
	t.Admitted += o.Admitted
	t.Denied += o.Denied
	t.Unavailable += o.Unavailable
	t.Straddled += o.Straddled
	t.Failed += o.Failed
	t.Unsent += o.Unsent
	if t.DeniedBy == nil {
		t.DeniedBy = map[string]int64{}
	}
	for r, n := range o.DeniedBy {
		t.DeniedBy[r] += n
	}
}

// otherRules formats the counts of every rule but except, sorted by rule.
func otherRules(by map[string]int64, except string) string {
	var parts []string
	for _, r := range slices.Sorted(maps.Keys(by)) {
		if r != except {
			parts = append(parts, fmt.Sprintf("%s %d", r, by[r]))
		}
	}
	return strings.Join(parts, ", ")
}

// printTry prints the agents' addresses and commands to try by hand.
func (d *Demo) printTry() {
	fmt.Fprintln(d.out, "\nkeep: the load has stopped; the topology stays up until Ctrl-C. Try:")
	for _, r := range d.regions {
		store := "redis " + r.RedisAddr
		if d.embedded {
			store = "embedded store"
		}
		fmt.Fprintf(d.out, "  region %s: agent http://%s (Connect AdmissionService, /metrics, /readyz), Envoy RLS %s, %s\n",
			r.Name, r.APIAddr, r.EnvoyAddr, store)
	}
	if len(d.regions) > 0 {
		fmt.Fprintf(d.out, "  curl -s -H 'Content-Type: application/json' -d '{\"entries\":[{\"key\":\"auth\",\"value\":\"token\"},"+
			"{\"key\":\"tenant\",\"value\":\"atlas\"},{\"key\":\"user\",\"value\":\"a1\"},{\"key\":\"route\",\"value\":\"%s\"}]}' "+
			"http://%s/allot.v1.AdmissionService/Check\n", DemoRoute, d.regions[0].APIAddr)
	}
	fmt.Fprintf(d.out, "  %s -addr %s window %s    (also: bound, cluster, policy list)\n",
		d.bins["./cmd/allotctl"], strings.Join(d.allocs.Endpoints(), ","), AtlasQuota)
}
