package fsm

import (
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/allot-dev/allot/pkg/lease"
)

// agent is a region agent in a simulation: it renews demand-sized chunks
// when it runs low and spends them on the requests that arrive.
type agent struct {
	region   string
	perMin   int64 // demand in requests per minute
	sizing   lease.Sizing
	chunks   []heldChunk
	arrived  int64
	admitted int64
	denied   int64
	stranded int64 // held tokens whose lease ended unspent
	asks     int
}

type heldChunk struct {
	tokens  int64
	expires int64
}

func (a *agent) rate() float64 { return float64(a.perMin) / 60 }

func (a *agent) held() int64 {
	var n int64
	for _, c := range a.chunks {
		n += c.tokens
	}
	return n
}

// tick is the simulation step.
const tick = 100

// step runs the agent from now to now+tick in the window starting at start.
func (a *agent) step(h *harness, quota string, start, now int64) {
	// Leases that ended are lost.
	kept := a.chunks[:0]
	for _, c := range a.chunks {
		if c.expires <= now {
			a.stranded += c.tokens
			continue
		}
		kept = append(kept, c)
	}
	a.chunks = kept

	// Renew below the low watermark, never asking for more than the rest
	// of the window can use (clamped leases would strand the excess).
	end := start + minute
	if held := a.held(); held < a.sizing.LowWatermark(a.rate()) {
		restOfWindow := int64(math.Ceil(a.rate()*float64(end-now)/1000)) - held
		if ask := min(a.sizing.Chunk(a.rate()), restOfWindow); ask > 0 {
			a.asks++
			r := h.acquire(now, a.region, fmt.Sprintf("%s-%d", a.region, a.asks),
				Want{Quota: quota, Tokens: ask, DemandPerSecond: a.rate()})
			if g := r.Grants[0]; g.Tokens > 0 {
				a.chunks = append(a.chunks, heldChunk{tokens: g.Tokens, expires: g.ExpiresUnixMs})
			}
		}
	}

	// Requests arrive evenly, perMin per minute; those of the coming tick
	// are served with what is held now.
	due := a.perMin * (now + tick - start) / minute
	for ; a.arrived < due; a.arrived++ {
		if len(a.chunks) == 0 {
			a.denied++
			continue
		}
		a.chunks[0].tokens--
		a.admitted++
		if a.chunks[0].tokens == 0 {
			a.chunks = a.chunks[1:]
		}
	}
}

// TestDemandWeightedRenewalServesBoth is chapter 15's depletion case: with
// EU demand 900/min and US 100/min against a 1,000/min pool, a static 50/50
// split denies 400 EU requests while 400 US tokens idle; demand-driven chunk
// renewal serves both fully (1,000 admitted, 0 idle), under both strategies.
func TestDemandWeightedRenewalServesBoth(t *testing.T) {
	for _, strategy := range []Strategy{StrategyDemand, StrategyFairShare} {
		t.Run(string(strategy), func(t *testing.T) {
			h := newHarness(t)
			h.publish(t0-1, atlas(strategy))
			sizing := lease.Sizing{MinChunk: 1, MaxChunk: 100, Lead: 2 * time.Second, RTT: 100 * time.Millisecond}
			eu := &agent{region: "eu", perMin: 900, sizing: sizing}
			us := &agent{region: "us", perMin: 100, sizing: sizing}
			for now := int64(t0); now < t0+minute; now += tick {
				eu.step(h, "atlas", t0, now)
				us.step(h, "atlas", t0, now)
			}
			w, _ := h.f.Window("atlas", t0/minute)
			for _, a := range []*agent{eu, us} {
				if a.admitted != a.perMin || a.denied != 0 || a.stranded != 0 || a.held() != 0 {
					t.Errorf("%s: admitted %d of %d, denied %d, stranded %d, idle %d", a.region, a.admitted, a.perMin, a.denied, a.stranded, a.held())
				}
			}
			if w.Outstanding != 1000 || w.Remaining != 0 {
				t.Errorf("window: outstanding %d remaining %d, want 1000 used, 0 idle", w.Outstanding, w.Remaining)
			}
		})
	}
}

// TestFairShareProtectsSmallRegion: EU bursts early, reporting a huge
// demand and asking for the whole pool. Under demand, US (which reported
// 100/min) is starved for the rest of the window; under fair_share the
// pool keeps US's need for it.
func TestFairShareProtectsSmallRegion(t *testing.T) {
	tests := []struct {
		strategy   Strategy
		wantEU     int64 // EU's burst grant
		wantUSLeft int64 // what US still gets after EU's burst
		wantUS     int64 // US's total in the window
	}{
		{strategy: StrategyDemand, wantEU: 990, wantUSLeft: 0, wantUS: 10},
		// US's need at the burst is floor(100/60 x 59.9 s) = 99 on top of the
		// 10 it holds, so EU gets 1000 - 109; US ends with its full 100/min.
		{strategy: StrategyFairShare, wantEU: 891, wantUSLeft: 90, wantUS: 100},
	}
	for _, tt := range tests {
		t.Run(string(tt.strategy), func(t *testing.T) {
			h := newHarness(t)
			h.publish(t0-1, atlas(tt.strategy))
			usRate := 100.0 / 60
			// US takes a small first chunk, reporting its demand.
			h.acquire(t0, "us", "u0", Want{Quota: "atlas", Tokens: 10, DemandPerSecond: usRate})
			// EU bursts: 5,000/min, asking for everything.
			eu := h.acquire(t0+100, "eu", "e0", Want{Quota: "atlas", Tokens: 1000, DemandPerSecond: 5000.0 / 60})
			if got := eu.Grants[0].Tokens; got != tt.wantEU {
				t.Fatalf("EU burst got %d, want %d", got, tt.wantEU)
			}
			// EU keeps asking; it may take only what US does not need.
			for i := range 5 {
				h.acquire(t0+1_000+int64(i)*1_000, "eu", fmt.Sprint("e", i+1), Want{Quota: "atlas", Tokens: 1000, DemandPerSecond: 5000.0 / 60})
			}
			// US renews over the window as it spends.
			var usGot int64
			for i := range 9 {
				r := h.acquire(t0+6_000+int64(i)*6_000, "us", fmt.Sprint("u", i+1), Want{Quota: "atlas", Tokens: 10, DemandPerSecond: usRate})
				usGot += r.Grants[0].Tokens
			}
			if usGot != tt.wantUSLeft {
				t.Fatalf("US got %d more after EU's burst, want %d", usGot, tt.wantUSLeft)
			}
			w, _ := h.f.Window("atlas", t0/minute)
			if w.Outstanding > w.Limit {
				t.Fatalf("granted %d over the limit %d", w.Outstanding, w.Limit)
			}
			if us := w.Regions[1]; us.Region != "us" || us.Granted != tt.wantUS {
				t.Fatalf("US row %+v, want %d granted in the window", us, tt.wantUS)
			}
		})
	}
}

// TestFairShareUncontendedIsDemand: when the pool covers every region's
// need for the rest of the window, fair_share grants what is asked.
func TestFairShareUncontendedIsDemand(t *testing.T) {
	h := newHarness(t)
	h.publish(t0-1, atlas(StrategyFairShare))
	h.acquire(t0, "us", "u", Want{Quota: "atlas", Tokens: 10, DemandPerSecond: 1})
	// EU's need 5/s x 60 s = 300, US's 60: 360 <= 990.
	r := h.acquire(t0, "eu", "e", Want{Quota: "atlas", Tokens: 700, DemandPerSecond: 5})
	if r.Grants[0].Tokens != 700 {
		t.Fatalf("uncontended fair_share granted %d, want 700", r.Grants[0].Tokens)
	}
}

// TestFairShareStaleDemandIgnored: a region's report older than 2 x TTL no
// longer reserves anything.
func TestFairShareStaleDemandIgnored(t *testing.T) {
	h := newHarness(t)
	h.publish(t0-1, atlas(StrategyFairShare))
	h.acquire(t0, "us", "u", Want{Quota: "atlas", Tokens: 1, DemandPerSecond: 10})
	// 30 s later US's report is stale; only US's outstanding 1 token counts.
	r := h.acquire(t0+30_001, "eu", "e", Want{Quota: "atlas", Tokens: 1000, DemandPerSecond: 100})
	if r.Grants[0].Tokens != 999 {
		t.Fatalf("EU got %d, want the whole pool 999", r.Grants[0].Tokens)
	}
}
