package admission

import (
	"math"
	"sync"
	"sync/atomic"
)

// breaker is a circuit breaker around the store (reference chapter 13): after
// `threshold` consecutive failures it opens for `cooldown`, during which no
// store call is made and rules go straight to their fail modes; then one
// probe call is let through, and its success closes the breaker. Times are
// monotonic nanoseconds. The closed path costs two atomic loads.
type breaker struct {
	threshold int64
	cooldown  int64

	failures  atomic.Int64
	openUntil atomic.Int64 // 0 while closed
	opens     atomic.Uint64

	mu      sync.Mutex
	probing bool
}

// allow reports whether a store call may be made at now; when not, it also
// returns when the breaker will let a probe through.
func (b *breaker) allow(now int64) (bool, int64) {
	u := b.openUntil.Load()
	if u == 0 {
		return true, 0
	}
	if now < u {
		return false, u
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.probing {
		return false, now + b.cooldown
	}
	b.probing = true
	return true, 0
}

// probeAt reports, changing nothing, when the breaker will let a call
// through: 0 when it would at now (closed, or open with the probe free),
// else the time to quote in a Retry-After. Unlike allow it never takes the
// probe, so an answer that makes no call cannot keep the breaker shut.
func (b *breaker) probeAt(now int64) int64 {
	u := b.openUntil.Load()
	if u == 0 {
		return 0
	}
	if now < u {
		return u
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.probing {
		return now + b.cooldown
	}
	return 0
}

// done records the outcome of a call allowed at now.
func (b *breaker) done(now int64, failed bool) {
	if !failed {
		if b.failures.Load() != 0 || b.openUntil.Load() != 0 {
			b.mu.Lock()
			b.failures.Store(0)
			b.openUntil.Store(0)
			b.probing = false
			b.mu.Unlock()
		}
		return
	}
	n := b.failures.Add(1)
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.probing || n >= b.threshold && b.openUntil.Load() == 0 {
		b.openUntil.Store(now + b.cooldown)
		b.probing = false
		b.opens.Add(1)
	}
}

// abort records that a call allowed at now ended without telling anything
// about the store (the caller gave up, or our own queue was full): a probe
// slot it held is freed, the counts are unchanged.
func (b *breaker) abort() {
	if b.openUntil.Load() == 0 {
		return
	}
	b.mu.Lock()
	b.probing = false
	b.mu.Unlock()
}

// isOpen reports whether calls are currently refused.
func (b *breaker) isOpen(now int64) bool {
	u := b.openUntil.Load()
	return u != 0 && now < u
}

// fallback holds the in-process buckets that replace a fallback rule while
// the store cannot answer (reference chapter 13): each is the rule divided by
// the number of gateways, so if traffic splits evenly the fleet admits at most
// the rule, and fewer if it does not. It is a reduced guarantee, stated as
// such. A share under one request is raised to one: with more gateways than
// the rule has requests, the fleet may admit one per gateway. Global quotas
// use their lease's fallback_per_region instead, per window of the quota,
// spendable only Config.PoolFallbackMargin inside each window (poolSpan).
// Sliding windows fall back to a fixed window of the same share.
type fallback struct {
	mu  sync.Mutex
	m   map[uint64]*fbState
	max int
	// lru rings the counters by last use, the least recent first
	// (lru.next): a counter goes last whenever a decision reads it, or an
	// eviction look passes over it because it holds a slot. A new key
	// beyond max takes the room of the first idle one (evictLocked), so it
	// costs a few steps, not a scan of the map.
	lru fbState
}

// fbState is one fallback counter. Times are wall milliseconds.
type fbState struct {
	tok, ts    int64    // bucket: millitokens and last refill
	frac       int64    // bucket: thousandths of a millitoken earned by ts
	w, c       int64    // window index and count
	slots      []int64  // concurrency: the deadlines (wall ms) of the slots held
	last       int64    // last use by a decision, for eviction
	rest       int64    // when a bucket is full again or a window's count lapses: from then a fresh counter is the same
	hash       uint64   // its key in fallback.m
	prev, next *fbState // in fallback.lru
}

// fbIdle is how long a fallback counter must go unused (wall ms) before a
// new key may take its room, if it holds no slot and is at rest (its
// bucket full again, its window's count lapsed): evicting a counter that is
// not would give its key a fresh share early, more than the rule's.
const fbIdle = 60_000

// fbEvictScan bounds the idle counters that hold slots or are not at rest
// that a new key passes over (moving them to the most recent end) in its look for one to evict.
const fbEvictScan = 64

// fbItem is one rule of a group decided by the fallback.
type fbItem struct {
	sp   *spec
	hash uint64
	cost int64
}

func newFallback(max int) *fallback {
	f := &fallback{m: make(map[uint64]*fbState), max: max}
	f.lru.prev, f.lru.next = &f.lru, &f.lru
	return f
}

// state returns the counter of hash, creating it; nil when full.
func (f *fallback) state(hash uint64, now int64, sp *spec) *fbState {
	if s := f.m[hash]; s != nil {
		// A use, even one the counter then denies: a key that is being
		// refused is not idle, and evicting it would refill it.
		s.last = max(s.last, now)
		f.useLocked(s)
		return s
	}
	if len(f.m) >= f.max && !f.evictLocked(now) {
		return nil
	}
	s := &fbState{tok: sp.fbCap, ts: now, w: -1, last: now, hash: hash}
	f.m[hash] = s
	f.useLocked(s)
	return s
}

// evictLocked drops the least recently used counter that is idle (unused
// for fbIdle, holding no slot and at rest: see fbState.rest) and reports
// whether it dropped one. The counters after one used within fbIdle are
// more recent: the look stops there. An idle counter that still holds a
// slot, or is not at rest (an hour's window whose count it holds), cannot
// go: a fresh counter would give its key a second share. The look passes
// over it, moving it to the most recent end so that the next look does not
// meet it again (its last use is unchanged), and passes over no more than
// fbEvictScan of them. Without the move, fbEvictScan such counters at the
// least recent end denied every new key for as long as their slots lived,
// with any number of evictable counters behind them; with it, each is passed
// over once per trip round the ring, and a new key costs a few steps
// (amortized). A counter so moved can sit behind more recent ones: when its
// slots end, it is evicted once the look comes round to it again.
func (f *fallback) evictLocked(now int64) bool {
	pass := min(fbEvictScan, len(f.m))
	for passed := 0; ; passed++ {
		s := f.lru.next
		if s == &f.lru || now-s.last <= fbIdle {
			return false
		}
		if s.held(now) == 0 && now >= s.rest {
			f.unlinkLocked(s)
			delete(f.m, s.hash)
			return true
		}
		if passed == pass {
			return false
		}
		f.useLocked(s)
	}
}

// useLocked moves s to the end of the ring: the most recently used.
func (f *fallback) useLocked(s *fbState) {
	if s.next != nil {
		f.unlinkLocked(s)
	}
	s.prev, s.next = f.lru.prev, &f.lru
	f.lru.prev.next = s
	f.lru.prev = s
}

func (f *fallback) unlinkLocked(s *fbState) {
	s.prev.next, s.next.prev = s.next, s.prev
	s.prev, s.next = nil, nil
}

// decide checks items in order and, when all admit, debits them all. It
// returns the index of the first item that denies (-1 when none) with its
// retry hint in milliseconds (-1: none), whether that item is closed (a
// global quota outside its window's span, see poolSpan: the fallback
// cannot decide it, as opposed to a share spent), and the states debited
// (for slot release).
func (f *fallback) decide(items []fbItem, now int64) (int, int64, bool, []*fbState) {
	f.mu.Lock()
	defer f.mu.Unlock()
	states := make([]*fbState, len(items))
	for i, it := range items {
		if it.sp.kind == kindPool {
			if ok, retry := poolSpan(it.sp, now); !ok {
				return i, retry, true, nil
			}
		}
		s := f.state(it.hash, now, it.sp)
		if s == nil {
			return i, scriptEmptyRetry, false, nil
		}
		states[i] = s
		if ok, retry := s.check(it.sp, it.cost, now); !ok {
			return i, retry, false, nil
		}
	}
	for i, it := range items {
		states[i].debit(it.sp, it.cost, now)
	}
	return -1, 0, false, states
}

// poolSpan reports whether a global quota's fallback share may be spent at
// now (wall ms): only within [S + margin, E - margin) of the epoch-aligned
// window [S, E) that holds now, so that a gateway clock within the margin
// of true time spends each window's share inside that window and never two
// shares in one true window. When it may not, it returns the milliseconds
// to the next span's start (-1 when windows are too short to have one).
func poolSpan(sp *spec, now int64) (bool, int64) {
	w, m := sp.fbWindow, sp.fbMargin
	if w <= 0 || m <= 0 {
		return true, 0
	}
	if 2*m >= w {
		return false, -1
	}
	start := now - now%w // now is positive: wall time after the epoch
	switch {
	case now < start+m:
		return false, start + m - now
	case now >= start+w-m:
		return false, start + w + m - now
	}
	return true, 0
}

// release gives back the fallback concurrency slot of s that expires at
// deadline; nothing when it expired already.
func (f *fallback) release(s *fbState, deadline int64) {
	f.mu.Lock()
	s.free(deadline)
	f.mu.Unlock()
}

// held drops the slots whose deadline has passed and returns how many are
// left. Slots are leases, as in the store: one whose holder never releases
// it (a crashed handler, a proxy with no completion call) lapses after the
// rule's slot_ttl instead of holding the fallback for the process's life.
func (s *fbState) held(now int64) int {
	live := s.slots[:0]
	for _, dl := range s.slots {
		if dl > now {
			live = append(live, dl)
		}
	}
	clear(s.slots[len(live):])
	s.slots = live
	return len(live)
}

// free removes one slot expiring at deadline.
func (s *fbState) free(deadline int64) {
	for i, dl := range s.slots {
		if dl == deadline {
			s.slots = append(s.slots[:i], s.slots[i+1:]...)
			return
		}
	}
}

// refill adds what the bucket earned since its stamp, keeping the fraction
// of a millitoken for later: a key called more often than its share earns a
// millitoken still refills at its share.
func (s *fbState) refill(sp *spec, now int64) {
	if s.tok >= sp.fbCap || sp.fbRefill <= 0 {
		s.ts, s.frac = max(s.ts, now), 0
		return
	}
	if now <= s.ts {
		return // never refill for negative time
	}
	delta := now - s.ts
	if delta >= ceilDiv((sp.fbCap-s.tok)*1000, sp.fbRefill) {
		s.tok, s.ts, s.frac = sp.fbCap, now, 0
		return
	}
	earned := delta*sp.fbRefill + s.frac // thousandths of a millitoken
	s.tok += earned / 1000
	s.frac = earned % 1000
	s.ts = now
}

func (s *fbState) window(sp *spec, now int64) {
	if sp.fbWindow <= 0 {
		return
	}
	if idx := now / sp.fbWindow; idx != s.w {
		s.w, s.c = idx, 0
	}
}

// slotDeadline is when a fallback slot taken at now lapses: the rule's
// slot_ttl later, as the store's would.
func slotDeadline(sp *spec, now int64) int64 { return now + sp.b }

func (s *fbState) check(sp *spec, cost, now int64) (bool, int64) {
	switch sp.kind {
	case kindBucket:
		s.refill(sp, now)
		if s.tok >= cost {
			return true, 0
		}
		if sp.fbRefill <= 0 {
			return false, -1
		}
		return false, ceilDiv((cost-s.tok)*1000, sp.fbRefill)
	case kindFixed, kindSliding, kindPool:
		s.window(sp, now)
		if s.c+cost <= sp.fbLimit {
			return true, 0
		}
		// A pool's next share opens a margin into the next window.
		return false, (s.w+1)*sp.fbWindow + sp.fbMargin - now
	case kindSlots:
		if int64(s.held(now)) < sp.fbLimit {
			return true, 0
		}
		return false, scriptEmptyRetry
	}
	return false, scriptEmptyRetry
}

func (s *fbState) debit(sp *spec, cost, now int64) {
	s.last = now
	switch sp.kind {
	case kindBucket:
		s.tok -= cost
		s.rest = math.MaxInt64 // a bucket that never refills never rests
		if sp.fbRefill > 0 {
			s.rest = s.ts + ceilDiv((sp.fbCap-s.tok)*1000-s.frac, sp.fbRefill)
		}
	case kindFixed, kindSliding, kindPool:
		s.c += cost
		s.rest = (s.w + 1) * sp.fbWindow
	case kindSlots:
		s.slots = append(s.slots, slotDeadline(sp, now))
	}
}
