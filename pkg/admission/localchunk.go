package admission

import (
	"sync"
	"sync/atomic"
)

// localChunk is a gateway's in-process share of a leased global quota
// (reference chapter 12): tokens taken from the region's pool in one store
// call and spent here without one, so the store sees one call per chunk
// rather than one per request. A request that a later rule denies gives its
// token back in process; that refund cannot fail. Tokens left when the
// chunk expires (it expires with the earliest grant it was taken from) are
// lost: stranded capacity, never an overshoot.
type localChunk struct {
	cur atomic.Pointer[chunkState]

	mu      sync.Mutex
	refill  *chunkTake // the take running; nil when none runs
	starved int64      // no take before this (monotonic ns): the pool was empty
	retryAt int64      // the pool's retry hint ends (monotonic ns)
}

// chunkTake is a take from the pool that requests wait on instead of
// making their own: done is closed when it ends, and failed (written
// before) says whether the store failed to answer it, in which case the
// waiters take the fail mode as the taker did rather than a take each.
type chunkTake struct {
	done   chan struct{}
	failed bool
}

// chunkState is one chunk taken from the pool.
type chunkState struct {
	tokens  atomic.Int64
	expires int64 // monotonic ns
}

// spend takes cost tokens from the current chunk. It returns the chunk to
// refund to, or nil when the chunk is missing, expired or too small. It
// allocates nothing.
func (c *localChunk) spend(now, cost int64) *chunkState {
	s := c.cur.Load()
	if s == nil || now >= s.expires {
		return nil
	}
	for {
		t := s.tokens.Load()
		if t < cost {
			return nil
		}
		if s.tokens.CompareAndSwap(t, t-cost) {
			return s
		}
	}
}

// refund gives cost tokens back to s, unless s has expired (its tokens are
// gone anyway).
func (c *localChunk) refund(s *chunkState, now, cost int64) {
	if s != nil && now < s.expires {
		s.tokens.Add(cost)
	}
}

// available returns the tokens of the current chunk, 0 when expired.
func (c *localChunk) available(now int64) int64 {
	s := c.cur.Load()
	if s == nil || now >= s.expires {
		return 0
	}
	return s.tokens.Load()
}
