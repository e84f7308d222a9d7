package admission

import (
	"math/bits"
	"sync"
)

// negCache remembers recently denied counter keys so that a denial storm
// costs the store one call per key per interval instead of one per request
// (reference chapter 12). It is a fixed array of entries indexed by the key's
// hash: a newer denial overwrites an older one in its slot, so memory never
// grows, and a lost entry only costs one store call. Times are nanoseconds
// on the engine's monotonic clock.
type negCache struct {
	entries []negEntry
	mask    uint64
	locks   [negLocks]paddedMutex
}

const negLocks = 64

type paddedMutex struct {
	sync.Mutex
	_ [56]byte
}

type negEntry struct {
	key     uint64 // 0: empty
	until   int64  // deny locally while now < until
	retryAt int64  // when the store's retry hint ends
}

func newNegCache(size int) *negCache {
	n := uint64(1) << bits.Len64(uint64(size-1))
	return &negCache{entries: make([]negEntry, n), mask: n - 1}
}

// get returns the end of the store's retry hint if key is denied at now.
func (c *negCache) get(key uint64, now int64) (retryAt int64, ok bool) {
	i := key & c.mask
	l := &c.locks[i%negLocks]
	l.Lock()
	e := c.entries[i]
	l.Unlock()
	if e.key != key || now >= e.until {
		return 0, false
	}
	return e.retryAt, true
}

// put denies key locally until until; retryAt is the end of the hint.
func (c *negCache) put(key uint64, until, retryAt int64) {
	i := key & c.mask
	l := &c.locks[i%negLocks]
	l.Lock()
	c.entries[i] = negEntry{key: key, until: until, retryAt: retryAt}
	l.Unlock()
}
