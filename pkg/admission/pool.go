package admission

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/allot-dev/allot/pkg/policy"
)

// Leased pools. The region agent deposits the chunks the allocator granted
// into the regional store with DepositChunk; gateways spend them (a tenant
// quota in the tenant's atomic script, a fleet-wide quota through
// gateway-local chunks); the agent reads PoolStats to measure demand and
// decide when to renew. Every chunk keeps its own expiry: spending takes the
// earliest-expiring chunk first, and an expired chunk never spends.

// PoolStats is the state of one leased pool in the regional store, plus what
// this gateway holds of it in process.
type PoolStats struct {
	// Available is the unexpired, unspent tokens in the store.
	Available int64
	// Consumed counts the tokens ever spent from the pool (by decisions and
	// by gateway-local takes); the agent's demand rate is its derivative.
	Consumed int64
	// Starved counts the requests (or gateway takes) that found the pool
	// short: demand the pool could not serve.
	Starved int64
	// Deposited counts the tokens ever deposited.
	Deposited int64
	// Expired counts the tokens that expired unspent: stranded capacity.
	Expired int64
	// Chunks is the number of unexpired grants.
	Chunks int
	// Exhausted is how long the pool is still marked exhausted (see
	// MarkExhausted); 0 when not.
	Exhausted time.Duration
	// Local is the tokens this gateway holds in its local chunk, not counted
	// in Available.
	Local int64
}

// Quotas returns the names of the policy's global quotas, sorted.
func (e *Engine) Quotas() []string {
	s := e.snap.Load()
	out := make([]string, 0, len(s.quotas))
	for n := range s.quotas {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

func (e *Engine) quota(name string) (*spec, error) {
	sp := e.snap.Load().quotas[name]
	if sp == nil {
		return nil, fmt.Errorf("quota %q: %w", name, ErrUnknownQuota)
	}
	return sp, nil
}

// DepositChunk puts a grant of tokens into quota's regional pool for ttl
// (measured by the store's clock from its arrival: the agent subtracts the
// delay it measured so the chunk never outlives its lease). Depositing the
// same grant id again while it is live adds nothing, so the agent may retry.
// It reports whether the grant was added.
func (e *Engine) DepositChunk(ctx context.Context, quota, grantID string, tokens int64, ttl time.Duration) (bool, error) {
	sp, err := e.quota(quota)
	if err != nil {
		return false, err
	}
	switch {
	case grantID == "" || len(grantID) > MaxRequestIDLen || !printable(grantID):
		return false, fmt.Errorf("grant id %q: 1-%d printable bytes: %w", grantID, MaxRequestIDLen, ErrBadGrant)
	case tokens <= 0 || tokens > policy.MaxAmount:
		return false, fmt.Errorf("tokens: %d is not in [1, %d]: %w", tokens, int64(policy.MaxAmount), ErrBadGrant)
	case ttl < time.Millisecond || ttl > policy.MaxWindow:
		return false, fmt.Errorf("ttl: %s is not in [1ms, %s]: %w", ttl, policy.MaxWindow, ErrBadGrant)
	}
	o := &op{code: opDeposit, now: e.storeNow(e.clock.Now()), keys: []string{sp.poolZ, sp.poolH},
		member: grantID, n1: tokens, n2: ttl.Milliseconds()}
	if err := e.run(ctx, o); err != nil {
		return false, fmt.Errorf("deposit %s: %w", quota, err)
	}
	return len(o.out) == 2 && o.out[0] == 1, nil
}

// PoolStats reads quota's pool. Expired chunks are pruned (and counted in
// Expired) as a side effect.
func (e *Engine) PoolStats(ctx context.Context, quota string) (PoolStats, error) {
	sp, err := e.quota(quota)
	if err != nil {
		return PoolStats{}, err
	}
	now := e.clock.Now()
	o := &op{code: opStats, now: e.storeNow(now), keys: []string{sp.poolZ, sp.poolH}}
	if err := e.run(ctx, o); err != nil {
		return PoolStats{}, fmt.Errorf("pool stats %s: %w", quota, err)
	}
	if len(o.out) != 7 {
		return PoolStats{}, fmt.Errorf("pool stats %s: %w: malformed reply", quota, ErrUnavailable)
	}
	ps := PoolStats{
		Available: o.out[0],
		Consumed:  o.out[1],
		Starved:   o.out[2],
		Deposited: o.out[3],
		Expired:   o.out[4],
		Chunks:    int(o.out[5]),
		Exhausted: time.Duration(o.out[6]) * time.Millisecond,
	}
	if sp.chunk != nil {
		ps.Local = sp.chunk.available(e.mono(now))
	}
	return ps, nil
}

// MarkExhausted records that quota's global pool has nothing left to grant
// for d (typically until the window ends), so requests the pool cannot serve
// get Retry-After up to d rather than a short hint. A deposit clears it.
func (e *Engine) MarkExhausted(ctx context.Context, quota string, d time.Duration) error {
	sp, err := e.quota(quota)
	if err != nil {
		return err
	}
	if d < time.Millisecond || d > policy.MaxWindow {
		return fmt.Errorf("exhausted for %s: not in [1ms, %s]: %w", d, policy.MaxWindow, ErrBadGrant)
	}
	o := &op{code: opExhaust, now: e.storeNow(e.clock.Now()), keys: []string{sp.poolZ, sp.poolH}, n1: d.Milliseconds()}
	if err := e.run(ctx, o); err != nil {
		return fmt.Errorf("mark exhausted %s: %w", quota, err)
	}
	return nil
}
