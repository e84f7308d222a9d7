package agent

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"

	"github.com/allot-dev/allot/internal/redistest"
	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/policy"
)

// TestWithdrawTombstones: a withdrawal with a tombstone TTL leaves every
// named grant recorded with 0 tokens, whether the pool held it or not, so a
// deposit of it that arrives afterwards (a late first attempt or a retry)
// adds nothing. Without a tombstone a withdrawn grant is gone.
func TestWithdrawTombstones(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	srv, err := redistest.StartServer(ctx)
	redistest.Require(t, err)
	t.Cleanup(func() { srv.Close() })
	rdb := srv.Client()
	t.Cleanup(func() { rdb.Close() })
	doc, err := policy.Parse([]byte(`
name: w
regions: [eu]
rules:
  - name: q
    scope: tenant
    match: [{key: tenant, value: a}]
    kind: global_quota
    limit: 1000
    window: 1h
    lease: {chunk: 10, ttl: 30s}
`))
	if err != nil {
		t.Fatal(err)
	}
	st, err := admission.NewRedisStore(rdb, admission.DefaultRedisConfig())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	cfg := admission.DefaultConfig()
	cfg.Namespace = "wd"
	eng, err := admission.New(cfg, st, doc, 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { eng.Close() })
	z, h, err := eng.PoolKeys("q")
	if err != nil {
		t.Fatal(err)
	}
	wd := newWithdrawer(rdb, cfg.Namespace)
	deposit := func(id string) bool {
		t.Helper()
		added, err := eng.DepositChunk(ctx, "q", id, 10, 20*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		return added
	}
	available := func() int64 {
		t.Helper()
		ps, err := eng.PoolStats(ctx, "q")
		if err != nil {
			t.Fatal(err)
		}
		return ps.Available
	}

	deposit("landed")
	got, err := wd.withdraw(ctx, "q", z, h, []string{"landed", "absent"}, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if got[0] != 10 || got[1] != -1 {
		t.Fatalf("withdraw = %v, want [10 -1]: the landed grant's tokens, and absent", got)
	}
	if deposit("landed") || deposit("absent") {
		t.Fatal("a deposit after a tombstoning withdrawal added tokens")
	}
	if n := available(); n != 0 {
		t.Fatalf("%d tokens spendable after the withdrawal, want 0", n)
	}

	deposit("plain")
	if got, err = wd.withdraw(ctx, "q", z, h, []string{"plain", "never"}, 0); err != nil || got[0] != 10 || got[1] != -1 {
		t.Fatalf("withdraw without tombstone = %v, %v; want [10 -1]", got, err)
	}
	if !deposit("never") {
		t.Fatal("a withdrawal without tombstone blocked a later deposit of an absent grant")
	}
	if n := available(); n != 10 {
		t.Fatalf("%d tokens spendable, want the 10 of the new deposit", n)
	}
}

// TestStarvedSeesChangesSinceTheDecision: a deposit that lands between a
// request's decision (denied: the pool was empty) and its wait must wake it
// at once, not at the pool's next change (a lost wakeup that once cost a
// steady tenant a 503 at a window turn).
func TestStarvedSeesChangesSinceTheDecision(t *testing.T) {
	l := newLeases(LeaseConfig{}, "eu", nil, admission.SystemClock{}, zap.NewNop(), newMetrics(), "test", nil, time.Second)
	l.cutOff = false // as if an allocator answered
	l.mu.Lock()
	q := l.newQuota("q", "", time.Now())
	l.mu.Unlock()

	seen := l.Generation()
	l.mu.Lock()
	q.changed() // the deposit lands after the decision read seen
	l.mu.Unlock()
	_, _, ch := l.starved("q", seen)
	select {
	case <-ch:
	default:
		t.Fatal("a change after the decision left the request waiting for the next one")
	}

	_, _, ch = l.starved("q", l.Generation())
	select {
	case <-ch:
		t.Fatal("no change since the decision, yet the wait ended at once")
	default:
	}
	l.mu.Lock()
	q.changed()
	l.mu.Unlock()
	select {
	case <-ch:
	default:
		t.Fatal("the pool's next change did not wake the waiter")
	}
}

// TestStarvedCutOffSeesTheAllowance: cut off from the allocator, a request
// whose decision found the pool empty just before the fallback allowance
// landed must decide again, not get a 503 because the allowance is no longer
// due (TestFallbackDoesNotWaitForARetry failed so on a loaded CI machine).
func TestStarvedCutOffSeesTheAllowance(t *testing.T) {
	l := newLeases(LeaseConfig{}, "eu", nil, admission.SystemClock{}, zap.NewNop(), newMetrics(), "test", nil, time.Second)
	l.mu.Lock()
	q := l.newQuota("q", "", time.Now())
	l.mu.Unlock()
	if !l.cutOff {
		t.Fatal("a manager without an allocator client is not cut off")
	}
	seen := l.Generation()
	l.mu.Lock()
	q.changed() // the allowance lands after the decision read seen
	l.mu.Unlock()
	state, _, ch := l.starved("q", seen)
	if state != poolRenewing {
		t.Fatalf("state %v, want a new decision (poolRenewing)", state)
	}
	select {
	case <-ch:
	default:
		t.Fatal("the request waits although the pool changed after its decision")
	}
	if state, _, _ := l.starved("q", l.Generation()); state != poolCutOff {
		t.Fatalf("no change since the decision and no allowance due: state %v, want poolCutOff", state)
	}
}

// TestSlotTableBound: the fallback slot table holds at most max decisions,
// evicting the oldest keys whole; a key taken and stored again is not
// evicted by its earlier place in the fifo.
func TestSlotTableBound(t *testing.T) {
	s := newSlotTable(3)
	d := func(id string) heldSlots { return heldSlots{d: &admission.Decision{ID: id}} }
	s.put("acme", "a", d("a1"))
	s.take("acme", "a")
	s.put("acme", "a", d("a2")) // a's first place in the fifo is stale
	s.put("acme", "b", d("b1"))
	s.put("acme", "b", d("b2"))
	s.put("acme", "c", d("c1")) // full: the oldest key (a, stored again) goes
	if got := s.take("acme", "a"); got != nil {
		t.Fatalf("a after the table filled: %v, want evicted", got)
	}
	if got := s.take("acme", "b"); len(got) != 2 || got[0].d.ID != "b1" || got[1].d.ID != "b2" {
		t.Fatalf("b: %v, want both of its decisions in order", got)
	}
	if got := s.take("beta", "c"); got != nil {
		t.Fatalf("c taken by another tenant: %v, want nothing", got)
	}
	if got := s.take("acme", "c"); len(got) != 1 {
		t.Fatalf("c: %v, want its decision", got)
	}
	if s.n != 0 || len(s.m) != 0 {
		t.Fatalf("after every take: %d decisions under %d keys, want none", s.n, len(s.m))
	}
}

// TestInstanceLimitIsRefusedNotCutOff: a request for an instance its
// template has no room for (maxInstances active ones) is answered
// unavailable and counted as refused: the allocator is not what failed, so
// it is not counted as cut off (which reads as the allocator unreachable).
func TestInstanceLimitIsRefusedNotCutOff(t *testing.T) {
	ms, err := admission.NewMemoryStore(admission.DefaultMemoryConfig(), nil)
	if err != nil {
		t.Fatal(err)
	}
	doc, err := policy.Parse([]byte(`
name: plans
regions: [eu]
rules:
  - name: plan
    scope: tenant
    match: [{key: tenant}]
    kind: global_quota
    limit: 1000
    window: 1h
    lease: {chunk: 10, ttl: 30s}
`))
	if err != nil {
		t.Fatal(err)
	}
	cfg := DefaultConfig()
	cfg.Region = "eu"
	cfg.StarveWait = 0
	a, err := New(cfg, nil, WithStore(ms), WithPolicy(doc, 1))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = a.release() })
	a.leases.mu.Lock()
	a.leases.maxInstances = 1
	a.leases.mu.Unlock()
	// The pools are empty and no allocator is configured: the first
	// tenant's instance is made active and answered as cut off.
	check := func(tenant string) {
		t.Helper()
		v, err := a.Check(context.Background(), &Input{Descriptors: []policy.Entry{{Key: "tenant", Value: tenant}}, Cost: 1})
		if err != nil {
			t.Fatal(err)
		}
		if !v.Unavailable {
			t.Fatalf("tenant %s: %+v, want unavailable", tenant, v)
		}
	}
	mode := func(m string) float64 { return testutil.ToFloat64(a.m.failMode.WithLabelValues("plan", m)) }
	check("a")
	if got := len(a.Leases()); got != 1 {
		t.Fatalf("%d managed pools after tenant a, want its instance", got)
	}
	cutOff, refused := mode("cut_off"), mode("refused")
	check("b") // no room for its instance
	if got := len(a.Leases()); got != 1 {
		t.Fatalf("%d managed pools after tenant b, want a's instance only", got)
	}
	if d := mode("cut_off") - cutOff; d != 0 {
		t.Errorf("the request for an instance over the limit counted %v as cut_off, want 0", d)
	}
	if d := mode("refused") - refused; d != 1 {
		t.Errorf("the request for an instance over the limit counted %v as refused, want 1", d)
	}
}
