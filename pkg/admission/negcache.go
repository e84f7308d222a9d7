package admission

import (
	"encoding/binary"
	"hash/maphash"
	"math/bits"
	"sync"
	"sync/atomic"
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

// admittedIDs is a lossy table of the requests with an id that this engine
// admitted within Config.IdempotencyTTL. A negative-cache hit (or a starved
// gateway-local chunk) for such a request's retry does not deny it: the
// retry goes to the store, which replays the earlier admission. Passing the
// cache for every request with an id would let any client defeat it with
// fresh ids; only an id admitted here passes, and only with the request it
// was admitted with (the table is keyed as the idempotency record is: id,
// descriptors and hits), so spraying one admitted id over other keys still
// meets the cache.
//
// It is a fixed array indexed by a seeded 64-bit hash of the request,
// written and read with atomics and no lock: its memory is fixed, and a race
// or an overwritten entry costs only a false negative (the cached 429, as
// without the table) or a false positive (one more store call, which replays
// or decides correctly). Times are nanoseconds on the engine's monotonic
// clock.
type admittedIDs struct {
	seed    maphash.Seed
	entries [admittedSize]admittedEntry
}

// admittedSize is the number of entries of an admittedIDs (64 KiB).
const admittedSize = 4096

type admittedEntry struct {
	key   atomic.Uint64 // 0: empty
	until atomic.Int64
}

func newAdmittedIDs() *admittedIDs { return &admittedIDs{seed: maphash.MakeSeed()} }

// hash returns req's key in the table (never 0). It allocates nothing.
func (a *admittedIDs) hash(req *Request) uint64 {
	var h maphash.Hash
	h.SetSeed(a.seed)
	writeField(&h, req.RequestID)
	var n [8]byte
	binary.LittleEndian.PutUint64(n[:], uint64(max(req.Hits, 1)))
	_, _ = h.Write(n[:])
	for _, e := range req.Descriptors {
		if e.Value != "" { // an empty value counts as absent
			writeField(&h, e.Key)
			writeField(&h, e.Value)
		}
	}
	return h.Sum64() | 1
}

// writeField writes s to h with its length first.
func writeField(h *maphash.Hash, s string) {
	var n [8]byte
	binary.LittleEndian.PutUint64(n[:], uint64(len(s)))
	_, _ = h.Write(n[:])
	_, _ = h.WriteString(s)
}

// put records key as admitted until until.
func (a *admittedIDs) put(key uint64, until int64) {
	e := &a.entries[key%admittedSize]
	e.until.Store(until)
	e.key.Store(key)
}

// has reports whether key was admitted and its record may still be there
// at now.
func (a *admittedIDs) has(key uint64, now int64) bool {
	e := &a.entries[key%admittedSize]
	return e.key.Load() == key && now < e.until.Load()
}
