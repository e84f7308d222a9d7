package admission

import (
	"hash/maphash"
	"strings"
	"sync"
)

// keyCache keeps the counter keys the engine made lately, so that a
// principal seen again costs neither the SHA-256 of its key (~120 ns on a
// 2-core EPYC VM) nor the key's allocation (~48 bytes a rule). Without it
// the key string was the largest part of a decision's garbage: measured with
// allotbench, the 1-rule SDK's garbage fell from 87 to 39 bytes a decision
// and its GC cycles to about a third (docs/admission-bench.md,
// "2026-12-05 21:51-22:31Z").
//
// An entry is found by a seeded 64-bit hash of the key's inputs (every
// field counterOf hashes but the salt, which is the engine's) and used only
// when its stored inputs equal the request's: two inputs of one hash cannot
// share a key. It holds at most max entries in 64 shards; a full shard drops
// a random entry (the first of Go's randomized map iteration) for a new one,
// so its memory is bounded (about 200 bytes an entry with short principals)
// and a workload of keys never seen twice costs one more allocation a rule
// than no cache. Inputs longer than maxCachedInput are not kept.
type keyCache struct {
	seed     maphash.Seed
	perShard int
	shards   [keyShards]keyShard
}

const (
	keyShards = 64
	// maxCachedInput is the longest key input kept; longer principals (rare:
	// ids and routes are short) are hashed each time.
	maxCachedInput = 256
)

type keyShard struct {
	mu sync.Mutex
	m  map[uint64]keyEntry
	_  [48]byte // a shard per cache line: no false sharing of the locks
}

// keyEntry is one cached key: s holds the key and then its inputs, in one
// allocation.
type keyEntry struct {
	s    string
	n    int    // the key's length: s[:n] is the key, s[n:] the inputs
	hash uint64 // the key's 64-bit hash (counterOf's second result)
}

// newKeyCache returns a cache of at most size keys (at least one a shard),
// or nil when size is 0.
func newKeyCache(size int) *keyCache {
	if size <= 0 {
		return nil
	}
	return &keyCache{seed: maphash.MakeSeed(), perShard: max(size/keyShards, 1)}
}

// get returns the key cached for in, whose seeded hash is h.
func (c *keyCache) get(h uint64, in []byte) (key string, hash uint64, ok bool) {
	s := &c.shards[h%keyShards]
	s.mu.Lock()
	e, found := s.m[h]
	s.mu.Unlock()
	if !found || e.s[e.n:] != string(in) {
		return "", 0, false
	}
	return e.s[:e.n], e.hash, true
}

// put caches key (of hash) for in, whose seeded hash is h, and returns the
// key as stored (the cache's copy, so the caller keeps no second one).
func (c *keyCache) put(h uint64, in []byte, key []byte, hash uint64) string {
	var b strings.Builder
	b.Grow(len(key) + len(in))
	b.Write(key)
	b.Write(in)
	s := b.String()
	e := keyEntry{s: s, n: len(key), hash: hash}
	sh := &c.shards[h%keyShards]
	sh.mu.Lock()
	if sh.m == nil {
		sh.m = make(map[uint64]keyEntry, min(c.perShard, 1024))
	}
	if _, replace := sh.m[h]; !replace && len(sh.m) >= c.perShard {
		for k := range sh.m {
			delete(sh.m, k)
			break
		}
	}
	sh.m[h] = e
	sh.mu.Unlock()
	return s[:len(key)]
}

// len returns the number of cached keys, for tests.
func (c *keyCache) len() int {
	n := 0
	for i := range c.shards {
		s := &c.shards[i]
		s.mu.Lock()
		n += len(s.m)
		s.mu.Unlock()
	}
	return n
}
