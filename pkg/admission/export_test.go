package admission

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// UseStoreClock makes e pass its own clock to the store instead of letting
// the store read Redis TIME, so that one fake clock drives every backend in
// the conformance suite. Production engines never do this.
func UseStoreClock(e *Engine) { e.storeClock = true }

// NegCacheForBench exposes the negative cache to the benchmarks.
type NegCacheForBench = negCache

// NewNegCacheForBench returns a negative cache of size entries.
func NewNegCacheForBench(size int) *NegCacheForBench { return newNegCache(size) }

// Get and Put are the cache's lookups for the benchmarks.
func (c *negCache) Get(key uint64, now int64) (int64, bool) { return c.get(key, now) }
func (c *negCache) Put(key uint64, until, retryAt int64)    { c.put(key, until, retryAt) }

// LocalChunkForBench exposes a gateway-local chunk to the benchmarks.
type LocalChunkForBench = localChunk

// Fill gives c tokens expiring at expires (monotonic ns).
func (c *localChunk) Fill(tokens, expires int64) {
	s := &chunkState{expires: expires}
	s.tokens.Store(tokens)
	c.cur.Store(s)
}

// SpendRefund spends cost and, when refund is set, gives it back.
func (c *localChunk) SpendRefund(now, cost int64, refund bool) bool {
	s := c.spend(now, cost)
	if s == nil {
		return false
	}
	if refund {
		c.refund(s, now, cost)
	}
	return true
}

// Available returns the chunk's tokens at now.
func (c *localChunk) Available(now int64) int64 { return c.available(now) }

// NegCacheEntries returns the fixed number of entries c holds.
func NegCacheEntries(c *negCache) int { return len(c.entries) }

// MetricsOf returns e's Prometheus collector, which production engines
// register with WithRegisterer.
func MetricsOf(e *Engine) prometheus.Collector { return &collector{e: e} }

// WithResendPause sets the pause before a refused call is sent again (see
// RedisStore.resend), so that a test can change Redis's state meanwhile.
func WithResendPause(d time.Duration) RedisOption { return func(s *RedisStore) { s.pause = d } }

// LateReleases returns how many late-slot releases e has scheduled and not
// yet finished (see Engine.releaseLate).
func LateReleases(e *Engine) int64 { return e.orphans.Load() }

// BreakerOpensByShard returns how often the breaker of each shard of e's
// store has opened, by shard index.
func BreakerOpensByShard(e *Engine) []uint64 {
	out := make([]uint64, len(e.brks))
	for i := range e.brks {
		out[i] = e.brks[i].opens.Load()
	}
	return out
}

// ShardOf returns the index of the shard of s that serves key.
func ShardOf(s Store, key string) int { return s.shard(key) }
