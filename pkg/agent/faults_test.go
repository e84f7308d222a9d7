package agent_test

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/allot-dev/allot/pkg/agent"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// TestGarbageFromTheAllocatorIsNotDeposited: an allocator answering
// nonsense gets nothing deposited, no panic, and requests a bounded 503.
func TestGarbageFromTheAllocatorIsNotDeposited(t *testing.T) {
	tests := []struct {
		name   string
		mangle func(*allotv1.AcquireResponse)
	}{
		{"no grants", func(r *allotv1.AcquireResponse) { r.Grants = nil }},
		{"another quota", func(r *allotv1.AcquireResponse) { r.Grants[0].Quota = "q-b" }},
		{"negative tokens", func(r *allotv1.AcquireResponse) { r.Grants[0].Tokens = -5 }},
		{"more than asked", func(r *allotv1.AcquireResponse) { r.Grants[0].Tokens = 1 << 40 }},
		{"empty grant id", func(r *allotv1.AcquireResponse) { r.Grants[0].GrantId = "" }},
		{"ttl does not match the expiry", func(r *allotv1.AcquireResponse) { r.Grants[0].TtlMs += 60_000 }},
		{"lease longer than the policy's ttl", func(r *allotv1.AcquireResponse) {
			r.Grants[0].TtlMs += 600_000
			r.Grants[0].ExpiresUnixMs += 600_000
		}},
		{"no leader time", func(r *allotv1.AcquireResponse) { r.LeaderNowUnixMs = 0 }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rdb := sharedRedis(t)
			fa := startFakeAllocator(t)
			doc := quotasPolicy(t, "10", "30s", "1h", 0, "closed")
			fa.publish(doc)
			fa.setHook(func(_ context.Context, _ *allotv1.AcquireRequest, commit func() (*allotv1.AcquireResponse, error)) (*allotv1.AcquireResponse, error) {
				resp, err := commit()
				if err == nil {
					tt.mangle(resp)
				}
				return resp, err
			})
			cfg := testConfig("eu", fa.addr)
			cfg.StarveWait = 300 * time.Millisecond
			reg := prometheus.NewRegistry()
			a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1), agent.WithRegisterer(reg)))
			v := mustCheck(t, a.Agent, tenant("a"))
			if v.Allowed || !v.Unavailable {
				t.Fatalf("verdict %+v, want unavailable: the allocator supplied nothing usable", v)
			}
			if ps := poolStats(t, rdb, cfg.Engine.Namespace, doc, "q-a"); ps.Deposited != 0 {
				t.Fatalf("deposited %d tokens from a garbage answer, want 0", ps.Deposited)
			}
			if got := testutil.ToFloat64(counterVec(t, reg, "allot_agent_renewal_failures_total", "malformed")); got < 1 {
				t.Fatalf("malformed renewals counted %v, want >= 1", got)
			}
		})
	}
}

// TestSlowAllocatorWaitIsBounded: an allocator that never answers costs a
// request at most StarveWait, then 503; nothing hangs.
func TestSlowAllocatorWaitIsBounded(t *testing.T) {
	rdb := sharedRedis(t)
	fa := startFakeAllocator(t)
	doc := quotasPolicy(t, "10", "30s", "1h", 0, "closed")
	fa.publish(doc)
	fa.setHook(func(ctx context.Context, _ *allotv1.AcquireRequest, _ func() (*allotv1.AcquireResponse, error)) (*allotv1.AcquireResponse, error) {
		<-ctx.Done()
		return nil, ctx.Err()
	})
	cfg := testConfig("eu", fa.addr)
	cfg.StarveWait = 200 * time.Millisecond
	cfg.Lease.AcquireTimeout = 5 * time.Second // the agent's own wait ends first
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1)))
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	v, err := a.Check(ctx, tenant("a"))
	if err != nil {
		t.Fatalf("Check with a silent allocator: %v, want an answer within StarveWait", err)
	}
	if v.Allowed || !v.Unavailable || v.RetryAfter < 1 {
		t.Fatalf("verdict %+v, want unavailable with a retry hint", v)
	}
}
