package admission_test

import (
	"testing"
	"time"

	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/policy"
)

// TestNegativeCache: after a denial with retry hint R, the same key is
// denied in process for min(R, ceiling) without a store call; other keys
// still reach the store.
func TestNegativeCache(t *testing.T) {
	for _, b := range backends() {
		t.Run(b.name, func(t *testing.T) {
			h := newHarness(t, b, northstar(t), func(c *admission.Config) { c.NegativeCacheTTL = 250 * time.Millisecond })
			wantAllowed(t, h.decide(export("cedar")...), "export 1")
			wantAllowed(t, h.decide(export("cedar")...), "export 2")
			// Deficit 10 at 2/s: R = 5 s, held locally for 250 ms.
			wantDenied(t, h.decide(export("cedar")...), "export 3", "p-export", policy.ScopeTenant, 5)
			calls := h.e.Stats().StoreCalls

			h.clock.Advance(100 * time.Millisecond)
			d := h.decide(export("cedar")...)
			wantDenied(t, d, "cached", "p-export", policy.ScopeTenant, 5) // 4.9 s left, rounded up
			if d.Source != admission.SourceNegativeCache || h.e.Stats().StoreCalls != calls {
				t.Fatalf("source %s, store calls %d -> %d; want a local denial", d.Source, calls, h.e.Stats().StoreCalls)
			}
			if h.e.Stats().NegativeCacheHits != 1 {
				t.Fatalf("hits %d, want 1", h.e.Stats().NegativeCacheHits)
			}
			// Another tenant is not affected.
			wantAllowed(t, h.decide(export("dune")...), "other tenant")

			// At 250 ms the entry lapses: the store decides again.
			h.clock.Advance(150 * time.Millisecond)
			calls = h.e.Stats().StoreCalls
			d = h.decide(export("cedar")...)
			if d.Source != admission.SourceStore || h.e.Stats().StoreCalls != calls+1 {
				t.Fatalf("after the ceiling: source %s; want the store", d.Source)
			}

			// min(R, ceiling) with R < ceiling: P-ANON 100 ms before the
			// boundary is held only 100 ms.
			h.clock.Set(9900 * time.Millisecond)
			for i := 0; i < 20; i++ {
				wantAllowed(t, h.decide(anon("203.0.113.9")...), "anon")
			}
			wantDenied(t, h.decide(anon("203.0.113.9")...), "21st", "p-anon", policy.ScopeIP, 1)
			h.clock.Advance(100 * time.Millisecond)
			wantAllowed(t, h.decide(anon("203.0.113.9")...), "new window")
		})
	}
}

// TestNegativeCacheBounded: the cache is a fixed array; a flood of distinct
// denied keys does not grow it (only overwrites).
func TestNegativeCacheBounded(t *testing.T) {
	c := admission.NewNegCacheForBench(100) // rounded up to 128 entries
	for k := uint64(1); k < 100_000; k++ {
		c.Put(k|1, 1000, 2000)
	}
	if got := admission.NegCacheEntries(c); got != 128 {
		t.Fatalf("%d entries, want 128", got)
	}
	if _, ok := c.Get(99_999, 500); !ok {
		t.Fatal("the newest entry was lost")
	}
	if _, ok := c.Get(99_999, 1000); ok {
		t.Fatal("an entry outlived its deadline")
	}
}
