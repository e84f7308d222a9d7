package agent_test

import (
	"context"
	"fmt"
	"net"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/allot-dev/allot/pkg/agent"
	"github.com/allot-dev/allot/pkg/faultproxy"
	"github.com/allot-dev/allot/pkg/policy"
)

// planPolicy gives every tenant a leased pool of its own (a template), and
// tenant a a fixed pool too.
const planPolicy = `
name: plans
regions: [eu, us]
rules:
  - name: plan
    scope: tenant
    match: [{key: tenant}]
    kind: global_quota
    limit: 1000
    window: 1h
    lease: {chunk: 10, ttl: TTL}
  - name: q-a
    scope: tenant
    match: [{key: tenant, value: a}]
    kind: global_quota
    limit: 1000
    window: 1h
    lease: {chunk: 10, ttl: TTL}
`

func plans(t testing.TB, ttl string) *policy.Document {
	return mustParse(t, strings.ReplaceAll(planPolicy, "TTL", ttl))
}

// TestTemplateInstancesRenewedInOneAcquire: the first requests of many
// tenants make their instances active; one tick asks for all of them in
// ONE Acquire, and each tenant spends from its own pool.
func TestTemplateInstancesRenewedInOneAcquire(t *testing.T) {
	rdb := sharedRedis(t)
	fa := startFakeAllocator(t)
	doc := plans(t, "30s")
	fa.publish(doc)
	cfg := testConfig("eu", fa.addr)
	cfg.StarveWait = 0 // nobody renews in this test but the test itself
	a := newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1))
	var tenants []string
	for i := range 40 {
		tenants = append(tenants, fmt.Sprintf("t%02d", i))
	}
	tenants = append(tenants, "a", "b/c") // a: template and its own pool; b/c: a value with the separator
	for _, ten := range tenants {
		if v := mustCheck(t, a, tenant(ten)); v.Allowed || !v.Unavailable {
			t.Fatalf("tenant %s before any lease: %+v, want unavailable", ten, v)
		}
	}
	a.Renew(context.Background())
	acq := fa.acquireLog()
	if len(acq) != 1 {
		t.Fatalf("Acquire calls = %d, want exactly 1 for every starved instance", len(acq))
	}
	var names []string
	for _, w := range acq[0].GetWants() {
		names = append(names, w.GetQuota())
		// A new instance asks for what its waiting request needs plus
		// MinChunk, not the policy's chunk; q-a, a single pool, for its
		// chunk (nothing measured yet).
		if want := map[bool]int64{true: 2, false: 10}[strings.HasPrefix(w.GetQuota(), "plan/")]; w.GetTokens() != want {
			t.Errorf("want %s: %d tokens, want %d", w.GetQuota(), w.GetTokens(), want)
		}
	}
	for _, ten := range tenants {
		if name := policy.InstanceName("plan", []string{ten}); !slices.Contains(names, name) {
			t.Fatalf("Acquire wants %v lack %s", names, name)
		}
	}
	if !slices.Contains(names, "q-a") {
		t.Fatalf("Acquire wants %v lack q-a (tenant a's own pool, touched with its instance)", names)
	}
	if len(names) != len(tenants)+1 {
		t.Fatalf("%d wants, want %d", len(names), len(tenants)+1)
	}
	for _, ten := range tenants {
		if v := mustCheck(t, a, tenant(ten)); !v.Allowed || v.Remaining != 1 {
			t.Fatalf("tenant %s after the renewal: %+v, want allowed with 1 left", ten, v)
		}
	}
	if w := fa.window("plan/t07"); w.Granted != 2 || w.Limit != 1000 {
		t.Fatalf("the allocator's window of plan/t07: %+v", w)
	}
	st := a.Leases()
	inst := 0
	for _, s := range st {
		if s.Template == "plan" {
			inst++
		}
	}
	if inst != len(tenants) {
		t.Fatalf("%d active instances of plan in %v, want %d", inst, st, len(tenants))
	}
}

// TestIdleInstancesAreForgotten: an instance nobody uses any more, with
// nothing held, is dropped from the agent's state; a later request makes it
// active again.
func TestIdleInstancesAreForgotten(t *testing.T) {
	rdb := sharedRedis(t)
	fa := startFakeAllocator(t)
	doc := plans(t, "300ms")
	fa.publish(doc)
	cfg := testConfig("eu", fa.addr)
	cfg.Lease.IdlePoll = 100 * time.Millisecond
	cfg.Lease.Margin = 20 * time.Millisecond
	cfg.Lease.DepositTimeout = 50 * time.Millisecond // the default: a 300 ms lease has no room for more
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1)))
	if v := mustCheck(t, a.Agent, tenant("birch")); !v.Allowed {
		t.Fatalf("birch: %+v", v)
	}
	active := func(name string) bool {
		for _, s := range a.Leases() {
			if s.Quota == name {
				return true
			}
		}
		return false
	}
	if !active("plan/birch") {
		t.Fatal("plan/birch not active after a request")
	}
	// The grant's lease ends (300 ms), its tokens expire, demand decays.
	waitFor(t, 30*time.Second, "plan/birch forgotten", func() bool { return !active("plan/birch") })
	if v := mustCheck(t, a.Agent, tenant("birch")); !v.Allowed {
		t.Fatalf("birch again: %+v", v)
	}
	if !active("plan/birch") {
		t.Fatal("plan/birch not active again after a new request")
	}
}

// TestShutdownHandsInstanceTokensBack: the unspent tokens of instances are
// withdrawn from their pools (keys from the engine) and released.
func TestShutdownHandsInstanceTokensBack(t *testing.T) {
	rdb := sharedRedis(t)
	fa := startFakeAllocator(t)
	doc := plans(t, "30s")
	fa.publish(doc)
	cfg := testConfig("eu", fa.addr)
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1)))
	for range 3 {
		if v := mustCheck(t, a.Agent, tenant("birch")); !v.Allowed {
			t.Fatalf("birch: %+v", v)
		}
	}
	if err := a.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	w := fa.window("plan/birch")
	ps := poolStats(t, rdb, cfg.Engine.Namespace, doc, "plan/birch")
	if ps.Available != 0 || ps.Consumed != 3 || w.Granted-w.Released != 3 {
		t.Fatalf("after shutdown: store %+v, allocator granted %d released %d; want the 3 spent tokens kept, the rest back",
			ps, w.Granted, w.Released)
	}
}

// TestShutdownWithdrawsSideBySide: with 24 active instances and a Redis
// 120 ms away (a fault proxy), shutdown withdraws every instance's unspent
// tokens within a 1.5 s budget: one withdrawal after another would need
// about 2.9 s.
func TestShutdownWithdrawsSideBySide(t *testing.T) {
	direct := sharedRedis(t)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var d net.Dialer
	px := faultproxy.New(ln, func(ctx context.Context) (net.Conn, error) { return d.DialContext(ctx, "tcp", shared.redis.Addr()) },
		faultproxy.Config{}, 1)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = px.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	rdb := redis.NewClient(&redis.Options{Addr: px.Addr().String()})
	t.Cleanup(func() { rdb.Close() })

	fa := startFakeAllocator(t)
	doc := plans(t, "30s")
	fa.publish(doc)
	cfg := testConfig("eu", fa.addr)
	cfg.ShutdownTimeout = 1500 * time.Millisecond
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1)))
	var tenants []string
	for i := range 24 {
		tenants = append(tenants, fmt.Sprintf("t%02d", i))
	}
	for _, ten := range tenants {
		if v := mustCheck(t, a.Agent, tenant(ten)); !v.Allowed {
			t.Fatalf("tenant %s: %+v", ten, v)
		}
	}
	if err := px.Set(faultproxy.Config{DelayMin: 60 * time.Millisecond, DelayMax: 60 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	if err := a.stop(); err != nil {
		t.Fatalf("Run: %v, want every withdrawal within the budget", err)
	}
	for _, ten := range tenants {
		quota := "plan/" + ten
		if ps := poolStats(t, direct, cfg.Engine.Namespace, doc, quota); ps.Available != 0 {
			t.Errorf("%s: %d tokens left in the store after shutdown, want 0 (withdrawn)", quota, ps.Available)
		}
	}
}
