package admission_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/allot-dev/allot/internal/redistest"
	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/policy"
)

// poolFallbackPolicy is a global quota of 2 s windows whose fallback share
// is 10 on one gateway.
const poolFallbackPolicy = `
name: pool-fallback
regions: [eu]
rules:
  - name: p-pool
    scope: global
    match: [{key: route, value: GET /pool}]
    kind: global_quota
    limit: 1000
    window: 2s
    lease: {chunk: 100, ttl: 1s, fallback_per_region: 10}
    fail_mode: fallback
`

// TestPoolFallbackOneShareATrueWindow: while the store is down a gateway
// spends a global quota from its in-process share, one share per window of
// its own wall clock. A gateway clock off by less than the pool fallback
// margin (default 250 ms) must still spend at most one share in each true
// window, which the bound's store_fallback term counts once: the share is
// spendable only the margin inside each window by the gateway's clock.
// Without the margin, a clock 200 ms fast spent the next window's share in
// the last 200 ms of the true window, two shares in one.
func TestPoolFallbackOneShareATrueWindow(t *testing.T) {
	addr, err := redistest.ClosedAddr()
	if err != nil {
		t.Fatal(err)
	}
	const window, share, step = 2 * time.Second, 10, 25 * time.Millisecond
	for _, skew := range []time.Duration{-249 * time.Millisecond, -200 * time.Millisecond, -20 * time.Millisecond, 0,
		20 * time.Millisecond, 200 * time.Millisecond, 249 * time.Millisecond} {
		t.Run(fmt.Sprint("gateway clock ", skew), func(t *testing.T) {
			h, _ := failHarness(t, addr, parse(t, poolFallbackPolicy), func(c *admission.Config) { c.Gateways = 1 })
			admitted := map[int64]int{} // by true window, t0-relative
			// True time from one window before t0's to three after.
			for at := window; at < 4*window; at += step {
				h.clock.Set(at + skew) // the gateway's clock
				for range share + 1 {
					d := h.decide("route", "GET /pool")
					if r := rule(t, d, "p-pool"); r.FailMode != policy.FailFallback {
						t.Fatalf("at %s: decided by %q, want fallback", at, r.FailMode)
					}
					if !d.Allowed() {
						break
					}
					admitted[int64(at/window)]++
				}
			}
			for w, n := range admitted {
				if n > share {
					t.Errorf("true window %d admitted %d in fallback, more than one share of %d", w, n, share)
				}
			}
			if admitted[2] != share {
				t.Errorf("true window 2 admitted %d, want a whole share of %d: %v", admitted[2], share, admitted)
			}
		})
	}
}

// TestPoolFallbackSpan: outside [S + margin, E - margin) of its window, by
// the gateway's clock, a global quota's fallback answers Unavailable (as
// fail closed) with a Retry-After to the next span's start; inside it, the
// share is spent and then denied until the next span; with no margin the
// share is spendable throughout the window. Other rules' fallbacks are
// unaffected.
func TestPoolFallbackSpan(t *testing.T) {
	addr, err := redistest.ClosedAddr()
	if err != nil {
		t.Fatal(err)
	}
	h, _ := failHarness(t, addr, parse(t, poolFallbackPolicy), func(c *admission.Config) {
		c.Gateways = 1
		c.PoolFallbackMargin = 1500 * time.Millisecond // twice that exceeds the 2 s window
	})
	// A window no longer than twice the margin has no span: always 503.
	h.clock.Set(time.Second)
	if d := h.decide("route", "GET /pool"); d.Outcome != admission.Unavailable || d.Rule != "p-pool" || d.RetryAfter < 1 {
		t.Fatalf("2 s window, 1.5 s margin: %+v; want unavailable by p-pool", d)
	}

	h, _ = failHarness(t, addr, parse(t, poolFallbackPolicy), func(c *admission.Config) { c.Gateways = 1 })
	for _, tt := range []struct {
		at      time.Duration // gateway clock, t0-relative (t0 starts a window)
		outcome admission.Outcome
		retry   int64
	}{
		{0, admission.Unavailable, 1},                         // 250 ms to the span
		{249 * time.Millisecond, admission.Unavailable, 1},    // 1 ms to it
		{250 * time.Millisecond, admission.Allow, 0},          // the span opens
		{1749 * time.Millisecond, admission.Allow, 0},         // its last millisecond
		{1750 * time.Millisecond, admission.Unavailable, 1},   // closed: 500 ms to the next
		{3999 * time.Millisecond, admission.Unavailable, 1},   // 251 ms to the next
		{4250*time.Millisecond - 1, admission.Unavailable, 1}, // 1 ns to it: still closed
		{6*time.Second + 300*time.Millisecond, admission.Allow, 0},
	} {
		h.clock.Set(tt.at)
		d := h.decide("route", "GET /pool")
		if d.Outcome != tt.outcome || tt.outcome != admission.Allow && (d.Rule != "p-pool" || d.RetryAfter != tt.retry) {
			t.Errorf("at %s: %s by %q, retry %d; want %s, retry %d", tt.at, d.Outcome, d.Rule, d.RetryAfter, tt.outcome, tt.retry)
		}
	}
	// The share of the window at 6 s: 1 spent above, 9 left, then a 429
	// until the next window's span, 2 s - 300 ms + 250 ms away.
	h.clock.Set(6*time.Second + 300*time.Millisecond)
	for i := 0; i < 9; i++ {
		wantAllowed(t, h.decide("route", "GET /pool"), "share")
	}
	if d := h.decide("route", "GET /pool"); d.Outcome != admission.Deny || d.RetryAfter != 2 {
		t.Errorf("share spent: %s, retry %d; want deny, retry 2", d.Outcome, d.RetryAfter)
	}

	// No margin: the whole window, from its first millisecond.
	h, _ = failHarness(t, addr, parse(t, poolFallbackPolicy), func(c *admission.Config) { c.Gateways = 1; c.PoolFallbackMargin = 0 })
	h.clock.Set(0)
	wantAllowed(t, h.decide("route", "GET /pool"), "no margin, window start")
	h.clock.Set(2*time.Second - time.Millisecond)
	wantAllowed(t, h.decide("route", "GET /pool"), "no margin, window end")
}

// TestPoolFallbackClock: with WithFallbackClock, a global quota's
// in-process share is placed by that clock, not the engine's: mid-window by
// the fallback clock the share is spent although the engine's clock is in
// the window's first 250 ms, and in its first 250 ms by the fallback clock
// the quota answers Unavailable although the engine's clock is mid-window.
// (The region agent passes its estimate of the allocator leader's clock.)
func TestPoolFallbackClock(t *testing.T) {
	store := unreachableStore(t)
	for _, tt := range []struct {
		name             string
		engine, fallback time.Duration // offsets from t0, a window's start
		allowed          bool
	}{
		{"mid-window by the fallback clock", 100 * time.Millisecond, time.Second, true},
		{"window start by the fallback clock", time.Second, 100 * time.Millisecond, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cfg := admission.DefaultConfig()
			cfg.Namespace = namespace()
			cfg.NegativeCacheTTL = 0
			cfg.StoreTimeout = 100 * time.Millisecond
			e, err := admission.New(cfg, store, parse(t, poolFallbackPolicy), 1,
				admission.WithClock(newFakeClock(t0.Add(tt.engine))), admission.WithFallbackClock(newFakeClock(t0.Add(tt.fallback))))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { e.Close() })
			d, err := e.Decide(context.Background(), &admission.Request{Descriptors: []policy.Entry{{Key: "route", Value: "GET /pool"}}})
			if err != nil {
				t.Fatal(err)
			}
			if r := rule(t, d, "p-pool"); r.FailMode != policy.FailFallback || d.Allowed() != tt.allowed || (!tt.allowed && d.Outcome != admission.Unavailable) {
				t.Fatalf("decided %+v (p-pool %+v); want allowed %t by the fallback, Unavailable otherwise", d, r, tt.allowed)
			}
		})
	}
}
