package admission

import (
	"testing"
	"time"
)

// TestBreaker walks the breaker through its states: closed, open after the
// threshold, one probe after the cooldown, closed again on success, open
// again on a failed probe, and a probe freed when its call was abandoned.
func TestBreaker(t *testing.T) {
	b := breaker{threshold: 3, cooldown: 100}
	for i := 0; i < 2; i++ {
		if ok, _ := b.allow(0); !ok {
			t.Fatal("closed breaker refused")
		}
		b.done(0, true)
	}
	if b.isOpen(0) {
		t.Fatal("open before the threshold")
	}
	b.done(10, true)
	if ok, at := b.allow(20); ok || at != 110 || !b.isOpen(20) {
		t.Fatalf("after 3 failures: allow=%v at=%d; want refused until 110", ok, at)
	}
	if ok, _ := b.allow(110); !ok {
		t.Fatal("no probe after the cooldown")
	}
	if ok, _ := b.allow(111); ok {
		t.Fatal("a second probe while one is out")
	}
	b.abort() // the probe's caller gave up
	if ok, _ := b.allow(112); !ok {
		t.Fatal("an abandoned probe kept the breaker shut")
	}
	b.done(113, true) // the probe failed: open again
	if ok, _ := b.allow(150); ok || b.opens.Load() != 2 {
		t.Fatalf("failed probe: allow=%v opens=%d", ok, b.opens.Load())
	}
	if ok, _ := b.allow(213); !ok {
		t.Fatal("no probe after the second cooldown")
	}
	b.done(214, false)
	if ok, _ := b.allow(215); !ok || b.isOpen(215) || b.failures.Load() != 0 {
		t.Fatal("a successful probe did not close the breaker")
	}
}

// TestQuotingRetryTakesNoProbe: a fail-closed rule's 503 quotes when the
// breaker will let a call through. Quoting it once the cooldown had passed
// used to take the probe slot without making a call, and as no call ever
// returned the slot, every later call was refused until the process
// restarted (a probe whose caller gave up, then a fail-closed rule).
func TestQuotingRetryTakesNoProbe(t *testing.T) {
	e := &Engine{cfg: Config{UnavailableRetryAfter: 2 * time.Second}}
	e.brks[0] = breaker{threshold: 1, cooldown: int64(time.Second)}
	e.brks[0].done(0, true) // open until 1 s
	if got := e.unavailableRetry(0, int64(300*time.Millisecond)); got != 1 {
		t.Fatalf("open breaker: Retry-After %d, want 1 (the rest of the cooldown)", got)
	}
	if ok, _ := e.brks[0].allow(int64(time.Second)); !ok {
		t.Fatal("no probe after the cooldown")
	}
	e.brks[0].abort() // the probe's caller gave up
	mono := int64(time.Second + time.Millisecond)
	if got := e.unavailableRetry(0, mono); got != 2 {
		t.Fatalf("probe free: Retry-After %d, want the configured 2", got)
	}
	if ok, _ := e.brks[0].allow(mono); !ok {
		t.Fatal("quoting a Retry-After took the probe: the breaker would stay shut")
	}
	if got := e.unavailableRetry(0, mono); got != 1 {
		t.Fatalf("probe out: Retry-After %d, want 1 (a cooldown)", got)
	}
	e.brks[0].done(mono, false)
	if e.brks[0].isOpen(mono) || e.brks[0].probeAt(mono) != 0 {
		t.Fatal("a successful probe did not close the breaker")
	}
}

// TestFallbackBucketKeepsFractions: a fallback bucket whose share refills
// less than a token per call interval still refills. It used to move its
// stamp to every call's time while adding only whole millitokens, so a key
// called every millisecond on a share under 1,000 millitokens a second (P-READ,
// 2 tokens/s, on five gateways: 400) never earned a token back.
func TestFallbackBucketKeepsFractions(t *testing.T) {
	sp := &spec{kind: kindBucket, fbCap: 4000, fbRefill: 400}
	s := &fbState{tok: 0, ts: 0}
	first := int64(-1)
	for now := int64(1); now <= 5000; now++ {
		if ok, _ := s.check(sp, 1000, now); ok {
			first = now
			break
		}
	}
	if first != 2500 {
		t.Fatalf("called every ms from empty at 400 millitokens/s: first admission at %d ms, want 2500", first)
	}
	// A long idle spell fills the bucket without overflowing.
	s = &fbState{tok: 0, ts: 0}
	if ok, _ := s.check(sp, 4000, 1<<50); !ok || s.tok != sp.fbCap || s.ts != 1<<50 {
		t.Fatalf("after a long idle spell: tok %d ts %d, want full at the call", s.tok, s.ts)
	}
	// No refill for negative time.
	s = &fbState{tok: 1000, ts: 100}
	s.refill(sp, 50)
	if s.tok != 1000 || s.ts != 100 {
		t.Fatalf("clock went back: tok %d ts %d, want 1000 at 100", s.tok, s.ts)
	}
}

// TestFallbackEvictsLeastRecentlyUsed: when the fallback holds FallbackKeys
// counters, a new key takes the room of the least recently used one that is
// idle (unused for a minute, no slot held), in a few steps; with none idle
// it is denied as quickly. It used to scan every counter, under the lock all
// decisions share, for every new key, for as long as the outage lasted.
func TestFallbackEvictsLeastRecentlyUsed(t *testing.T) {
	const keys = 100_000
	bucket, slots, f, decide := fallbackFixture(keys)
	// Key 1 holds a slot (for ten minutes); the others are buckets.
	if !decide(slots, 1, 0) {
		t.Fatal("the first slot was denied")
	}
	for h := uint64(2); h <= keys; h++ {
		if !decide(bucket, h, 0) {
			t.Fatalf("key %d denied below the cap", h)
		}
	}
	// Half a minute on, every counter is in use: new keys are denied, each
	// in a few steps (a scan of the map for each took seconds for these).
	start := time.Now()
	for h := uint64(keys + 1); h <= keys+10_000; h++ {
		if decide(bucket, h, 30_000) {
			t.Fatalf("new key %d admitted with every counter in use", h)
		}
	}
	if el := time.Since(start); el > 2*time.Second {
		t.Fatalf("10,000 new keys against a full fallback took %s", el)
	}
	// A minute on, keys 2-11 are used again; the others are idle. New keys
	// take the room of the least recently used idle ones; the slot held and
	// the keys in use stay.
	for h := uint64(2); h <= 11; h++ {
		decide(bucket, h, 61_000)
	}
	for h := uint64(keys + 1); h <= keys+100; h++ {
		if !decide(bucket, h, 61_000) {
			t.Fatalf("new key %d denied although idle counters could make room", h)
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.m) != keys {
		t.Fatalf("%d counters, want the cap %d", len(f.m), keys)
	}
	for h := uint64(1); h <= 11; h++ {
		if f.m[h] == nil {
			t.Fatalf("key %d was evicted although in use", h)
		}
	}
	if f.m[11+50] != nil {
		t.Fatal("key 61 (idle, among the least recently used) was kept")
	}
}

// TestFallbackEvictionPassesSlotHolders: idle counters that still hold a
// (long) slot sit at the least recent end of the ring, with idle bucket
// counters behind them. New keys must take the room of the idle bucket
// counters, the least recent first, the look moving the slot holders out of
// its way (fbEvictScan of them per new key at most); the slot holders stay.
// They used to stay at the head: with fbEvictScan of them, every new key was
// denied for as long as their slots lived (slot_ttl), with a thousand
// evictable counters behind them.
func TestFallbackEvictionPassesSlotHolders(t *testing.T) {
	for _, holders := range []int{fbEvictScan, 3 * fbEvictScan} {
		const keys = 1_100
		bucket, slots, f, decide := fallbackFixture(keys)
		for h := uint64(1); h <= uint64(holders); h++ { // long exports, each holding a slot
			if !decide(slots, h, 0) {
				t.Fatalf("slot of key %d denied", h)
			}
		}
		for h := uint64(holders + 1); h <= keys; h++ {
			if !decide(bucket, h, 0) {
				t.Fatalf("key %d denied below the cap", h)
			}
		}
		// Two minutes on, every counter is idle and the first ones still
		// hold their slots. A new key passes over fbEvictScan of them at
		// most: with fbEvictScan, the first new key is admitted, with more
		// the first few are denied. Then each idle bucket counter makes room
		// for a new key, and then new keys are denied.
		const now = 120_000
		wantDenied := (holders+fbEvictScan-1)/fbEvictScan - 1
		idle := keys - holders
		h := uint64(keys)
		for denied := 0; ; denied++ {
			h++
			if decide(bucket, h, now) {
				if denied != wantDenied {
					t.Fatalf("%d slot holders at the head: %d new keys denied before one was admitted, want %d", holders, denied, wantDenied)
				}
				break
			}
			if denied == wantDenied {
				t.Fatalf("%d slot holders at the head: new keys denied with %d idle counters to evict", holders, idle)
			}
		}
		if f.m[uint64(holders+1)] != nil {
			t.Fatalf("key %d (idle, the least recently used without a slot) was kept", holders+1)
		}
		for i := 2; i <= idle; i++ {
			h++
			if !decide(bucket, h, now) {
				t.Fatalf("new key %d (%d of %d) denied with idle counters to evict", h, i, idle)
			}
		}
		if h++; decide(bucket, h, now) {
			t.Fatal("new key admitted with every counter in use or holding a slot")
		}
		if len(f.m) != keys {
			t.Fatalf("%d counters, want the cap %d", len(f.m), keys)
		}
		for h := uint64(1); h <= uint64(holders); h++ {
			if s := f.m[h]; s == nil || s.held(now) != 1 {
				t.Fatalf("key %d was evicted or lost its slot although it holds one", h)
			}
		}
		for h := uint64(holders + 1); h <= keys; h++ {
			if f.m[h] != nil {
				t.Fatalf("idle key %d was kept", h)
			}
		}
	}
}

// fallbackFixture is a fallback of keys counters, a bucket rule, a slot rule
// (one slot held for ten minutes) and decide, which reports whether one
// request of rule sp for key hash at now is admitted.
func fallbackFixture(keys int) (bucket, slots *spec, f *fallback, decide func(sp *spec, hash uint64, now int64) bool) {
	bucket = &spec{kind: kindBucket, fbCap: 10_000, fbRefill: 1000} // a token a second
	slots = &spec{kind: kindSlots, fbLimit: 1, b: 10 * 60_000}
	f = newFallback(keys)
	decide = func(sp *spec, hash uint64, now int64) bool {
		deny, _, _, _ := f.decide([]fbItem{{sp: sp, hash: hash, cost: 1000}}, now)
		return deny < 0
	}
	return bucket, slots, f, decide
}

// TestFallbackEvictionWaitsForRest: a counter idle for longer than fbIdle
// is not evicted while it still holds its key's share spent (an hour's
// window whose count it holds, a bucket not yet full again): a new key then
// gets no room, and the key keeps its spent share. It used to be evicted
// after a minute, and its key, coming back within the window, got a fresh
// share: twice the rule's in one window. Once at rest, it makes room.
func TestFallbackEvictionWaitsForRest(t *testing.T) {
	const hour = 3_600_000
	for _, tt := range []struct {
		name string
		sp   *spec
		cost int64
		rest int64 // when key 1's counter is at rest again (wall ms)
	}{
		{"fixed window of an hour", &spec{kind: kindFixed, fbLimit: 2, fbWindow: hour}, 1, hour},
		{"global quota share of an hour", &spec{kind: kindPool, fbLimit: 2, fbWindow: hour, fbMargin: 250}, 1, hour},
		{"bucket of 2 refilling one a 1000 s", &spec{kind: kindBucket, fbCap: 2000, fbRefill: 1}, 1000, 1000 + 2_000_000},
	} {
		t.Run(tt.name, func(t *testing.T) {
			f := newFallback(1)
			decide := func(hash uint64, now int64) bool {
				deny, _, _, _ := f.decide([]fbItem{{sp: tt.sp, hash: hash, cost: tt.cost}}, now)
				return deny < 0
			}
			const t0 = 1000
			for i, want := range []bool{true, true, false} {
				if decide(1, t0) != want {
					t.Fatalf("key 1's request %d: admitted %t, want %t (its share of 2)", i+1, !want, want)
				}
			}
			idle := int64(t0 + 2*fbIdle)
			if decide(2, idle) {
				t.Fatalf("%d ms on, a new key took the room of key 1, whose share is spent until %d", idle-t0, tt.rest)
			}
			if decide(1, idle) {
				t.Fatalf("%d ms on, key 1 got a fresh share before %d", idle-t0, tt.rest)
			}
			if decide(2, tt.rest-300) {
				t.Fatalf("at %d, 300 ms before key 1 is at rest, a new key took its room", tt.rest-300)
			}
			if !decide(2, tt.rest+300) {
				t.Fatalf("at %d, key 1 at rest and idle, a new key was denied", tt.rest+300)
			}
		})
	}
}
