package topology

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/allot-dev/allot/pkg/allocator"
	"github.com/allot-dev/allot/pkg/lease"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// SimRegion stands in for a region's agent and gateways in the local
// topology: it offers a steady demand for one leased quota, spends only
// tokens it holds under unexpired leases (deadlines by the send-time rule),
// and renews chunks sized by demand before it runs dry. The real region agent
// (Redis, admission API) replaces it in the topology when it exists.
type SimRegion struct {
	// Name is the region, e.g. "eu".
	Name string
	// Quota is the leased quota it spends.
	Quota string
	// Rate is the offered requests per second.
	Rate float64
	// Sizing sizes renewals from the demand.
	Sizing lease.Sizing
	// Margin is subtracted from every lease deadline.
	Margin time.Duration
	// WindowMs is the quota's window, for per-window accounting.
	WindowMs int64
	// Client reaches the allocator cluster.
	Client *allocator.Client

	mu     sync.Mutex
	chunks []simChunk
	stats  map[int64]*RegionWindowStats
	seq    int
}

type simChunk struct {
	left     int64
	deadline time.Time
	window   int64
}

// RegionWindowStats is what one region did in one window.
type RegionWindowStats struct {
	// Offered, Admitted and Denied count requests.
	Offered, Admitted, Denied int64
	// Granted is tokens received; Stranded is tokens whose lease ended unspent.
	Granted, Stranded int64
	// Renewals is the number of Acquire calls.
	Renewals int
}

// Stats returns a copy of the region's numbers for window index w.
func (r *SimRegion) Stats(w int64) RegionWindowStats {
	r.mu.Lock()
	defer r.mu.Unlock()
	if s, ok := r.stats[w]; ok {
		return *s
	}
	return RegionWindowStats{}
}

func (r *SimRegion) window(w int64) *RegionWindowStats {
	if r.stats == nil {
		r.stats = map[int64]*RegionWindowStats{}
	}
	s, ok := r.stats[w]
	if !ok {
		s = &RegionWindowStats{}
		r.stats[w] = s
		delete(r.stats, w-5) // bounded memory
	}
	return s
}

// Run offers the demand in ticks until ctx ends.
func (r *SimRegion) Run(ctx context.Context) error {
	const tick = 20 * time.Millisecond
	t := time.NewTicker(tick)
	defer t.Stop()
	var owed float64
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		}
		now := time.Now()
		w := lease.WindowIndex(now.UnixMilli(), r.WindowMs)
		owed += r.Rate * tick.Seconds()
		n := int64(owed)
		owed -= float64(n)
		held := r.spend(now, w, n)
		if held < r.Sizing.LowWatermark(r.Rate) {
			r.renew(ctx, w)
		}
	}
}

// spend admits up to n requests from held chunks, earliest deadline first,
// and returns the tokens still held.
func (r *SimRegion) spend(now time.Time, w, n int64) int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	st := r.window(w)
	st.Offered += n
	live := r.chunks[:0]
	for _, c := range r.chunks {
		if !now.Before(c.deadline) {
			r.window(c.window).Stranded += c.left
			continue
		}
		live = append(live, c)
	}
	r.chunks = live
	for i := range r.chunks {
		take := min(n, r.chunks[i].left)
		r.chunks[i].left -= take
		st.Admitted += take
		n -= take
	}
	st.Denied += n
	var held int64
	for _, c := range r.chunks {
		held += c.left
	}
	return held
}

func (r *SimRegion) renew(ctx context.Context, w int64) {
	r.mu.Lock()
	r.seq++
	id := fmt.Sprintf("%s-%d-%d", r.Name, time.Now().UnixNano(), r.seq)
	r.mu.Unlock()
	req := &allotv1.AcquireRequest{Region: r.Name, RequestId: id, Wants: []*allotv1.Want{
		{Quota: r.Quota, Tokens: r.Sizing.Chunk(r.Rate), DemandPerSecond: r.Rate},
	}}
	sent := time.Now()
	cctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	resp, err := r.Client.Acquire(cctx, req) // the client retries with the same request id
	cancel()
	if err != nil {
		return
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	st := r.window(w)
	st.Renewals++
	for _, g := range resp.GetGrants() {
		if g.GetTokens() == 0 {
			continue
		}
		st.Granted += g.GetTokens()
		r.chunks = append(r.chunks, simChunk{
			left:     g.GetTokens(),
			deadline: lease.Deadline(sent, g.GetExpiresUnixMs(), resp.GetLeaderNowUnixMs(), r.Margin),
			window:   g.GetWindowIndex(),
		})
	}
}
