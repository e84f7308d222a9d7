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
	// Chunks is the number of unexpired grants whose window has opened.
	Chunks int
	// Pending is the tokens of pre-grants (DepositPregrant) whose window
	// has not opened yet: held, but not spendable nor in Available.
	Pending int64
	// Exhausted is how long the pool is still marked exhausted (see
	// MarkExhausted); 0 when not.
	Exhausted time.Duration
	// Local is the tokens this gateway holds in its local chunk, not counted
	// in Available.
	Local int64
}

// Quotas returns the names of the policy's global quotas, sorted: single
// pools and templates (a template's pools are its instances, named by
// policy.InstanceName; every method below takes an instance's name too).
func (e *Engine) Quotas() []string {
	s := e.snap.Load()
	out := make([]string, 0, len(s.quotas))
	for n := range s.quotas {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}

// pool locates the pool named name: a single pool, or an instance of a
// template of the policy in force. It returns the keys of its sorted set
// and its hash, and its rule.
func (e *Engine) pool(name string) (z, h string, sp *spec, err error) {
	s := e.snap.Load()
	if sp = s.quotas[name]; sp != nil {
		if sp.template {
			return "", "", nil, fmt.Errorf("quota %q: a template, not a pool: name one of its instances: %w", name, ErrUnknownQuota)
		}
		return sp.poolZ, sp.poolH, sp, nil
	}
	in, err := policy.ParseInstanceName(name)
	if err != nil {
		return "", "", nil, fmt.Errorf("quota %q: %w: %w", name, ErrUnknownQuota, err)
	}
	sp = s.quotas[in.Template]
	if sp == nil || !sp.template || (!in.Hashed && len(in.Values) != len(sp.rule.TemplateKeys())) {
		return "", "", nil, fmt.Errorf("quota %q: not an instance of a template of policy version %d: %w", name, s.version, ErrUnknownQuota)
	}
	tenant := ""
	if sp.tenantAt >= 0 && !in.Hashed {
		tenant = in.Values[sp.tenantAt]
	}
	z, h = poolKeys(e.cfg.Namespace, instanceTag(sp, name, tenant), name)
	return z, h, sp, nil
}

// PoolKeys returns the regional store's keys of the pool named quota (a
// single pool or a template's instance): its sorted set of grants and its
// hash of counters (see keys.go). The region agent needs them to withdraw
// its grants when it stops, which has no operation here.
func (e *Engine) PoolKeys(quota string) (z, h string, err error) {
	z, h, _, err = e.pool(quota)
	return z, h, err
}

// DepositChunk puts a grant of tokens into quota's regional pool for ttl
// (measured by the store's clock from its arrival: the agent subtracts the
// delay it measured so the chunk never outlives its lease). Depositing the
// same grant id again while it is live adds nothing: an Unsent attempt may be
// retried (one that may have landed must not be: a late copy counts its TTL
// from its arrival). It reports whether the grant was added.
func (e *Engine) DepositChunk(ctx context.Context, quota, grantID string, tokens int64, ttl time.Duration) (bool, error) {
	return e.deposit(ctx, quota, grantID, tokens, 0, ttl)
}

// DepositPregrant puts a pre-grant (tokens of the next window) into quota's
// regional pool: it spends only from start after its arrival (the agent
// measures start from when it received the grant, so the chunk never opens
// before its window does; arriving later only opens it later) until ttl
// after its arrival, and until then counts in PoolStats.Pending, not in
// Available. start must be shorter than ttl.
func (e *Engine) DepositPregrant(ctx context.Context, quota, grantID string, tokens int64, start, ttl time.Duration) (bool, error) {
	if start < time.Millisecond || start >= ttl {
		return false, fmt.Errorf("start: %s is not in [1ms, ttl %s): %w", start, ttl, ErrBadGrant)
	}
	return e.deposit(ctx, quota, grantID, tokens, start, ttl)
}

func (e *Engine) deposit(ctx context.Context, quota, grantID string, tokens int64, start, ttl time.Duration) (bool, error) {
	z, h, _, err := e.pool(quota)
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
	o := &op{code: opDeposit, now: e.storeNow(e.clock.Now()), keys: []string{z, h},
		member: grantID, n1: tokens, n2: ttl.Milliseconds(), n3: start.Milliseconds()}
	if err := e.run(ctx, o); err != nil {
		return false, fmt.Errorf("deposit %s: %w", quota, err)
	}
	return len(o.out) == 2 && o.out[0] == 1, nil
}

// PoolStats reads quota's pool. Expired chunks are pruned (and counted in
// Expired) as a side effect.
func (e *Engine) PoolStats(ctx context.Context, quota string) (PoolStats, error) {
	z, h, sp, err := e.pool(quota)
	if err != nil {
		return PoolStats{}, err
	}
	now := e.clock.Now()
	o := &op{code: opStats, now: e.storeNow(now), keys: []string{z, h}}
	if err := e.run(ctx, o); err != nil {
		return PoolStats{}, fmt.Errorf("pool stats %s: %w", quota, err)
	}
	if len(o.out) != 8 {
		return PoolStats{}, fmt.Errorf("pool stats %s: %w: malformed reply", quota, ErrUnavailable)
	}
	ps := PoolStats{
		Available: o.out[0],
		Consumed:  o.out[1],
		Starved:   o.out[2],
		Deposited: o.out[3],
		Expired:   o.out[4],
		Chunks:    int(o.out[5]),
		Pending:   o.out[7],
		Exhausted: time.Duration(o.out[6]) * time.Millisecond,
	}
	if sp.chunk != nil {
		ps.Local = sp.chunk.available(e.mono(now))
	}
	return ps, nil
}

// MarkExhausted records that quota's global pool has nothing left to grant
// for d (typically until the window ends), so requests the pool cannot serve
// get Retry-After up to d rather than a short hint. A deposit clears it (a
// pre-grant, which is for the next window, does not).
func (e *Engine) MarkExhausted(ctx context.Context, quota string, d time.Duration) error {
	z, h, _, err := e.pool(quota)
	if err != nil {
		return err
	}
	if d < time.Millisecond || d > policy.MaxWindow {
		return fmt.Errorf("exhausted for %s: not in [1ms, %s]: %w", d, policy.MaxWindow, ErrBadGrant)
	}
	o := &op{code: opExhaust, now: e.storeNow(e.clock.Now()), keys: []string{z, h}, n1: d.Milliseconds()}
	if err := e.run(ctx, o); err != nil {
		return fmt.Errorf("mark exhausted %s: %w", quota, err)
	}
	return nil
}
