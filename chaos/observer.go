package chaos

import (
	"context"
	"fmt"
	"sync"
	"time"

	"connectrpc.com/connect"

	"github.com/allot-dev/allot/chaos/check"
	"github.com/allot-dev/allot/chaos/history"
	"github.com/allot-dev/allot/pkg/allocator"
	"github.com/allot-dev/allot/pkg/lease"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// observer reads the allocator's window ledgers from the root namespace,
// which no fault cuts: the current window of every quota every 300 ms (the
// reads join the linearizability history) and every window once more just
// after it ended (the lost-grants check needs a read after its last grant).
// The suite also reads every ledger after each scenario (readAll). On
// every tick it also samples how far the wall clock has moved against the
// true clock (drift), so that a step that came and went during the run is
// seen, not only what is left of it at the end.
type observer struct {
	client *allocator.Client
	clock  history.TrueClock
	record func(...history.Event)
	quotas []check.Quota
	drift  driftSamples
}

// driftSamples keeps the largest wall-clock drift sampled (by magnitude,
// with its sign). It is safe for concurrent use.
type driftSamples struct {
	mu    sync.Mutex
	worst time.Duration
	n     int
}

// add records one sample.
func (d *driftSamples) add(v time.Duration) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.n++
	if v.Abs() > d.worst.Abs() {
		d.worst = v
	}
}

// max returns the sample of the largest magnitude (0 when none) and how
// many were taken.
func (d *driftSamples) max() (time.Duration, int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.worst, d.n
}

// sampleDrift reads how far the wall clock is from the true clock, between
// two true-clock readings at most driftBracket apart (a goroutine
// preempted between the two clocks' readings would otherwise show its
// pause as a step); it tries three times, and says false when no reading
// was tight enough.
func sampleDrift(c history.TrueClock) (time.Duration, bool) {
	for range 3 {
		before := c.Now()
		wall := time.Now().UnixNano()
		after := c.Now()
		if after-before <= int64(driftBracket) {
			return time.Duration(wall - before/2 - after/2), true
		}
	}
	return 0, false
}

// driftBracket bounds the true-clock interval a drift sample is read in.
const driftBracket = time.Millisecond

// Run reads until ctx ends.
func (o *observer) Run(ctx context.Context) {
	t := time.NewTicker(300 * time.Millisecond)
	defer t.Stop()
	past := map[string]int64{}
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if d, ok := sampleDrift(o.clock); ok {
			o.drift.add(d)
		}
		for _, q := range o.quotas {
			_ = o.read(ctx, q.Name, 0)
			now := o.clock.Now()
			cur := lease.WindowIndex(now/1e6, q.WindowMs)
			if past[q.Name] < cur-1 && now-lease.WindowStart(cur, q.WindowMs)*1e6 > int64(300*time.Millisecond) {
				if o.read(ctx, q.Name, cur-1) == nil {
					past[q.Name] = cur - 1
				}
			}
		}
	}
}

// read reads one ledger (window 0: the current one) and records it.
func (o *observer) read(ctx context.Context, quota string, window int64) error {
	call := o.clock.Now()
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	resp, err := o.client.Operator().GetWindow(cctx, &allotv1.GetWindowRequest{Quota: quota, WindowIndex: window})
	cancel()
	at := o.clock.Now()
	if err != nil {
		return err // a failed read has no effect: not recorded
	}
	ev := history.Event{Kind: history.KindGetWindow, Quota: quota, Call: call, At: at, Outcome: history.OK, Window: resp.GetWindowIndex(),
		Remaining: resp.GetRemaining(), Granted: resp.GetGranted(), Released: resp.GetReleased(), Reason: check.ReadCurrent}
	if window != 0 {
		ev.Reason = check.ReadPast
	}
	for _, g := range resp.GetGrants() {
		ev.Grants = append(ev.Grants, history.LedgerGrant{GrantID: g.GetGrantId(), Region: g.GetRegion(), Tokens: g.GetTokens(), Released: g.GetReleased(), GrantedMs: g.GetGrantedUnixMs(), ExpiresMs: g.GetExpiresUnixMs()})
	}
	o.record(ev)
	return nil
}

// readAll reads the current and the previous window of every quota,
// retrying each until it succeeds or ctx ends.
func (o *observer) readAll(ctx context.Context) error {
	for _, q := range o.quotas {
		cur := lease.WindowIndex(o.clock.Now()/1e6, q.WindowMs)
		for _, w := range []int64{cur - 1, 0} {
			for {
				err := o.read(ctx, q.Name, w)
				if err == nil || connect.CodeOf(err) == connect.CodeNotFound {
					break // NotFound: the window is older than the allocator keeps
				}
				select {
				case <-ctx.Done():
					return fmt.Errorf("ledger of %s window %d: %w (last error: %v)", q.Name, w, ctx.Err(), err)
				case <-time.After(100 * time.Millisecond):
				}
			}
		}
	}
	return nil
}
