package topology

import (
	"context"
	"fmt"
	"maps"
	"sync"
	"time"

	"connectrpc.com/connect"

	"github.com/allot-dev/allot/pkg/lease"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
	"github.com/allot-dev/allot/proto/allot/v1/allotv1connect"
)

// tally is what one tenant's load did in one region in one window. Requests
// are counted in the window they were due in; answers in the window they
// arrived in (the decision was made before), so a window's counts are final
// when it ends.
type tally struct {
	// Offered counts the requests due in the window, sent or not.
	Offered int64
	// Admitted, Denied (429) and Unavailable (503) count the answers.
	Admitted, Denied, Unavailable int64
	// Straddled counts the admitted answers of requests sent in an earlier
	// window: they were decided in one of the two.
	Straddled int64
	// Failed counts the calls that got no answer (an RPC error).
	Failed int64
	// Unsent counts the requests not sent because MaxInFlight calls were
	// already in flight.
	Unsent int64
	// DeniedBy counts the denials and unavailable answers by rule.
	DeniedBy map[string]int64
	// LastError is the last RPC error, for the report.
	LastError string
}

// stream is one tenant's load in one region, at a fixed rate.
type stream struct {
	tenant, region string
	rate           float64
	users          int
	client         allotv1connect.AdmissionServiceClient
}

type tallyKey struct {
	tenant, region string
	window         int64
}

// loadGen offers streams through the agents' Check API and tallies the
// answers per tenant, region and window.
type loadGen struct {
	windowMs    int64
	maxInFlight int
	callTimeout time.Duration

	mu      sync.Mutex
	tallies map[tallyKey]*tally
	newest  int64
}

// keepWindows is how many windows of tallies the generator keeps.
const keepWindows = 16

func newLoadGen(windowMs int64, maxInFlight int, callTimeout time.Duration) *loadGen {
	return &loadGen{windowMs: windowMs, maxInFlight: maxInFlight, callTimeout: callTimeout, tallies: map[tallyKey]*tally{}}
}

// update runs fn on the tally of k, under the lock.
func (g *loadGen) update(k tallyKey, fn func(*tally)) {
	g.mu.Lock()
	defer g.mu.Unlock()
	t, ok := g.tallies[k]
	if !ok {
		t = &tally{DeniedBy: map[string]int64{}}
		g.tallies[k] = t
		if k.window > g.newest {
			g.newest = k.window
			for old := range g.tallies {
				if old.window <= g.newest-keepWindows {
					delete(g.tallies, old)
				}
			}
		}
	}
	fn(t)
}

// snapshot returns a copy of the tally of tenant in region for window w.
func (g *loadGen) snapshot(tenant, region string, w int64) tally {
	g.mu.Lock()
	defer g.mu.Unlock()
	t, ok := g.tallies[tallyKey{tenant, region, w}]
	if !ok {
		return tally{DeniedBy: map[string]int64{}}
	}
	c := *t
	c.DeniedBy = maps.Clone(t.DeniedBy)
	return c
}

// run offers every stream until offerCtx ends, then waits for the calls in
// flight. Calls run under callCtx, so the end of the offering (the last
// window) lets them finish while the end of callCtx (Ctrl-C) cuts them.
func (g *loadGen) run(offerCtx, callCtx context.Context, streams []stream) {
	var wg sync.WaitGroup
	for _, s := range streams {
		wg.Add(1)
		go func() {
			defer wg.Done()
			g.offer(offerCtx, callCtx, s)
		}()
	}
	wg.Wait()
}

// offer sends s's requests at its rate, on a 10 ms ticker, with at most
// maxInFlight calls in flight, until offerCtx ends; then it waits for its
// calls. A tick that comes late catches up at most 100 ms of requests, so a
// stalled machine does not turn into a burst.
func (g *loadGen) offer(offerCtx, callCtx context.Context, s stream) {
	const tick = 10 * time.Millisecond
	t := time.NewTicker(tick)
	defer t.Stop()
	sem := make(chan struct{}, g.maxInFlight)
	var (
		calls sync.WaitGroup
		owed  float64
		seq   int
		last  = time.Now()
	)
	defer calls.Wait()
	for {
		select {
		case <-offerCtx.Done():
			return
		case <-t.C:
		}
		now := time.Now()
		owed = min(owed+s.rate*now.Sub(last).Seconds(), s.rate*0.1+1)
		last = now
		n := int64(owed)
		owed -= float64(n)
		sent := lease.WindowIndex(now.UnixMilli(), g.windowMs)
		var unsent int64
		for range n {
			select {
			case sem <- struct{}{}:
			default:
				unsent++
				continue
			}
			seq++
			req := &allotv1.CheckRequest{Entries: []*allotv1.DescriptorEntry{
				{Key: "auth", Value: "token"},
				{Key: "tenant", Value: s.tenant},
				{Key: "user", Value: fmt.Sprintf("%s-%d", s.tenant, seq%s.users)},
				{Key: "route", Value: DemoRoute},
			}}
			calls.Add(1)
			go func() {
				defer calls.Done()
				defer func() { <-sem }()
				g.call(callCtx, s, req, sent)
			}()
		}
		g.update(tallyKey{s.tenant, s.region, sent}, func(t *tally) {
			t.Offered += n
			t.Unsent += unsent
		})
	}
}

// call makes one Check and tallies its answer in the window it arrived in.
func (g *loadGen) call(ctx context.Context, s stream, req *allotv1.CheckRequest, sent int64) {
	cctx, cancel := context.WithTimeout(ctx, g.callTimeout)
	resp, err := s.client.Check(cctx, connect.NewRequest(req))
	cancel()
	if err != nil && ctx.Err() != nil {
		return // stopped: not an answer
	}
	w := lease.WindowIndex(time.Now().UnixMilli(), g.windowMs)
	g.update(tallyKey{s.tenant, s.region, w}, func(t *tally) {
		switch {
		case err != nil:
			t.Failed++
			t.LastError = err.Error()
		case resp.Msg.GetAllowed():
			t.Admitted++
			if w != sent {
				t.Straddled++
			}
		case resp.Msg.GetUnavailable():
			t.Unavailable++
			t.DeniedBy[resp.Msg.GetRule()]++
		default:
			t.Denied++
			t.DeniedBy[resp.Msg.GetRule()]++
		}
	})
}
