package admission_test

import (
	"context"
	"testing"
	"time"
)

// TestStateTTLs checks on Redis how the script keeps string-state keys
// alive: a bucket's key always outlives the time its bucket needs to refill
// to full (an absent key reads as a full bucket, so an early expiry would
// admit more than the rule), and TTLs are set only when they must grow
// (SET ... KEEPTTL otherwise, the cheaper write).
func TestStateTTLs(t *testing.T) {
	for _, b := range backends()[1:] {
		t.Run(b.name, func(t *testing.T) {
			ctx := context.Background()
			t.Run("bucket", func(t *testing.T) {
				h := newHarness(t, b, parse(t, `
name: ttl
rules:
  - {name: read, scope: user, match: [{key: tenant}, {key: user}], kind: token_bucket, capacity: 20, refill_per_second: 2}
`), nil)
				pttl := func() (string, time.Duration) {
					t.Helper()
					keys := h.keys(h.ns)
					if len(keys) != 1 {
						t.Fatalf("keys %v, want one bucket", keys)
					}
					v, err := h.client.Get(ctx, keys[0]).Result()
					if err != nil {
						t.Fatal(err)
					}
					d, err := h.client.PTTL(ctx, keys[0]).Result()
					if err != nil {
						t.Fatal(err)
					}
					return v, d
				}
				const idle = 11 * time.Second // 20 tokens at 2/s, plus 1 s of slack
				var last time.Duration
				for i := 1; i <= 20; i++ {
					d := h.decide("tenant", "t1", "user", "u1")
					if !d.Allowed() {
						t.Fatalf("request %d denied", i)
					}
					v, ttl := pttl()
					if tokens, stamp, expiry := decodeBucket(t, v); tokens != float64(20-i)*1000 || stamp != float64(t0.UnixMilli()) ||
						time.Duration(expiry-stamp)*time.Millisecond < ttl {
						t.Fatalf("request %d: bucket (%v millitokens, stamp %v, expiry %v), want %d tokens at t0 and an expiry past the key's TTL %s",
							i, tokens, stamp, expiry, 20-i, ttl)
					}
					refill := time.Duration(rule(t, d, "read").Reset) * time.Second
					if ttl < refill+time.Second-500*time.Millisecond {
						t.Fatalf("request %d: key TTL %s is shorter than the refill %s + slack", i, ttl, refill)
					}
					if i == 1 && (ttl < 2*idle-time.Second || ttl > 2*idle) {
						t.Fatalf("new bucket TTL %s, want two idle TTLs (%s)", ttl, 2*idle)
					}
					if i > 1 && ttl > last {
						t.Fatalf("request %d: TTL grew from %s to %s though it covered the refill", i, last, ttl)
					}
					last = ttl
				}
				// 15 s later (by the engine's clock) the bucket has 10 tokens
				// back; a debit then needs the key until now + 5.5 s + slack,
				// past the expiry set at first: the TTL is set again.
				h.clock.Advance(15 * time.Second)
				if d := h.decide("tenant", "t1", "user", "u1"); !d.Allowed() {
					t.Fatal("denied after refill")
				}
				if _, ttl := pttl(); ttl < 2*idle-time.Second {
					t.Fatalf("TTL %s not renewed to two idle TTLs", ttl)
				}
			})
			t.Run("window", func(t *testing.T) {
				h := newHarness(t, b, parse(t, `
name: ttl
rules:
  - {name: anon, scope: ip, match: [{key: ip}], kind: fixed_window, limit: 20, window: 10s}
`), nil)
				pttl := func() time.Duration {
					t.Helper()
					keys := h.keys(h.ns)
					if len(keys) != 1 {
						t.Fatalf("keys %v, want one window", keys)
					}
					d, err := h.client.PTTL(ctx, keys[0]).Result()
					if err != nil {
						t.Fatal(err)
					}
					return d
				}
				h.clock.Set(2 * time.Second) // 8 s before the window ends
				h.decide("ip", "10.0.0.1")
				first := pttl()
				if first < 8500*time.Millisecond || first > 9*time.Second {
					t.Fatalf("TTL %s, want the window's end + 1 s of slack (9 s)", first)
				}
				h.clock.Set(7 * time.Second)
				h.decide("ip", "10.0.0.1")
				// The window's expiry has not changed, so the write kept the
				// TTL (KEEPTTL) rather than setting it again from the
				// engine's clock, which moved 5 s while Redis's did not.
				if again := pttl(); again > first || again < first-time.Second {
					t.Fatalf("TTL moved from %s to %s inside one window", first, again)
				}
				h.clock.Set(12 * time.Second) // next window: ends in 8 s
				h.decide("ip", "10.0.0.1")
				if next := pttl(); next < 8500*time.Millisecond || next > 9*time.Second {
					t.Fatalf("next window's TTL %s, want 9 s", next)
				}
			})
		})
	}
}
