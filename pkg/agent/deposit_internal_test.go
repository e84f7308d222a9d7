package agent

import (
	"context"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/allot-dev/allot/internal/redistest"
	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/policy"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// poolPolicy leases one pool, q (tenant a), with a fallback allowance.
const poolPolicy = `
name: p
regions: [eu]
rules:
  - name: q
    scope: tenant
    match: [{key: tenant, value: a}]
    kind: global_quota
    limit: 1000
    window: 1h
    lease: {chunk: 10, ttl: 30s, fallback_per_region: 5}
    fail_mode: fallback
`

// poolEngine is an engine deciding poolPolicy on st, in namespace ns.
func poolEngine(t *testing.T, st admission.Store, ns string) (*admission.Engine, *policy.Document) {
	t.Helper()
	doc, err := policy.Parse([]byte(poolPolicy))
	if err != nil {
		t.Fatal(err)
	}
	cfg := admission.DefaultConfig()
	cfg.Namespace = ns
	eng, err := admission.New(cfg, st, doc, 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { eng.Close() })
	return eng, doc
}

// TestUnsureDepositHandsBackOnlyWhatIsOut: a deposit that may have reached
// the store is settled by withdrawing (and tombstoning) its grant, and only
// tokens certainly out of the store for good are handed back. A grant the
// store does not hold may never have landed, or may have landed, been spent
// from, expired and been pruned: its tokens are handed back only when the
// withdrawal ran before any copy that landed could have expired. A pool
// that left the policy, or a failed withdrawal, hands nothing back.
func TestUnsureDepositHandsBackOnlyWhatIsOut(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	srv, err := redistest.StartServer(ctx)
	redistest.Require(t, err)
	t.Cleanup(func() { srv.Close() })
	rdb := srv.Client()
	t.Cleanup(func() { rdb.Close() })
	st, err := admission.NewRedisStore(rdb, admission.DefaultRedisConfig())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	eng, _ := poolEngine(t, st, "ud")
	l := newLeases(DefaultLeaseConfig(), "eu", nil, admission.SystemClock{}, zap.NewNop(), newMetrics(), "test", newWithdrawer(rdb, "ud"), time.Second)
	grant := func(quota, id string) *allotv1.Grant { return &allotv1.Grant{Quota: quota, GrantId: id, Tokens: 10} }
	deposit := func(id string, ttl time.Duration) time.Time {
		t.Helper()
		sent := time.Now()
		if added, err := eng.DepositChunk(ctx, "q", id, 10, ttl); err != nil || !added {
			t.Fatalf("deposit %s: added %v, %v", id, added, err)
		}
		return sent
	}
	// reached is the trace of one attempt sent at sent with ttl that may
	// have reached the store.
	reached := func(sent time.Time, ttl time.Duration) depositTrace {
		var d depositTrace
		d.attempt(sent, time.Now(), ttl, true)
		return d
	}

	tests := []struct {
		name     string
		give     func() (*allotv1.Grant, depositTrace)
		wantBack int64
		wantOut  bool
	}{
		{"no attempt reached the store", func() (*allotv1.Grant, depositTrace) {
			var d depositTrace
			d.attempt(time.Now(), time.Now(), 30*time.Second, false)
			return grant("q", "unsent"), d
		}, 10, true},
		{"landed, unspent", func() (*allotv1.Grant, depositTrace) {
			return grant("q", "landed"), reached(deposit("landed", 30*time.Second), 30*time.Second)
		}, 10, true},
		{"never landed, withdrawn before a copy could expire", func() (*allotv1.Grant, depositTrace) {
			return grant("q", "absent"), reached(time.Now(), 30*time.Second)
		}, 10, true},
		{"landed, spent in part, expired and pruned", func() (*allotv1.Grant, depositTrace) {
			const ttl = 150 * time.Millisecond
			sent := deposit("pruned", ttl)
			d, err := eng.Decide(ctx, &admission.Request{Descriptors: []policy.Entry{{Key: "tenant", Value: "a"}}, Hits: 3})
			if err != nil || d.Outcome != admission.Allow {
				t.Fatalf("spend 3: %+v, %v", d, err)
			}
			time.Sleep(ttl + 100*time.Millisecond)
			ps, err := eng.PoolStats(ctx, "q") // prunes the expired grant
			if err != nil || ps.Expired != 7 {
				t.Fatalf("pool %+v, %v: want the 7 unspent tokens expired", ps, err)
			}
			return grant("q", "pruned"), reached(sent, ttl)
		}, 0, true},
		{"the pool left the policy", func() (*allotv1.Grant, depositTrace) {
			return grant("gone", "gone"), reached(time.Now(), 30*time.Second)
		}, 0, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			g, d := tt.give()
			back, out, _ := l.unsureDeposit(ctx, eng, g, time.Now().Add(30*time.Second), d)
			if back != tt.wantBack || out != tt.wantOut {
				t.Fatalf("unsureDeposit = %d tokens to hand back, out %v; want %d, out %v", back, out, tt.wantBack, tt.wantOut)
			}
		})
	}
	// Every withdrawn grant is tombstoned: a copy landing late adds nothing.
	for _, id := range []string{"landed", "absent", "pruned"} {
		if added, err := eng.DepositChunk(ctx, "q", id, 10, 30*time.Second); err != nil || added {
			t.Errorf("a late copy of %s: added %v, %v; want nothing added", id, added, err)
		}
	}
	if ps, err := eng.PoolStats(ctx, "q"); err != nil || ps.Available != 0 {
		t.Errorf("pool %+v, %v: want nothing spendable", ps, err)
	}
}

// TestFallbackDepositReadsItsBoundUnderTheLock: the fallback deposit reads
// the deposit bound (from the measured store delay, which pool reads update
// concurrently) while holding the lock; the race detector sees it otherwise.
func TestFallbackDepositReadsItsBoundUnderTheLock(t *testing.T) {
	st, err := admission.NewMemoryStore(admission.DefaultMemoryConfig(), admission.SystemClock{})
	if err != nil {
		t.Fatal(err)
	}
	eng, doc := poolEngine(t, st, "fb")
	l := newLeases(DefaultLeaseConfig(), "eu", nil, admission.SystemClock{}, zap.NewNop(), newMetrics(), "test", newWithdrawer(nil, "fb"), time.Second)
	l.setPolicy(doc, eng) // no allocator client: cut off
	l.mu.Lock()
	q := l.quotas["q"]
	l.mu.Unlock()
	if q == nil {
		t.Fatal("pool q not managed")
	}
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { // pool reads measuring the store's delay
		defer wg.Done()
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
				l.observeStoreDelay(time.Duration(i%5) * time.Millisecond)
			}
		}
	}()
	for range 100 {
		l.mu.Lock()
		q.hasFallback = false
		l.mu.Unlock()
		l.depositFallback(context.Background(), eng, q)
	}
	close(stop)
	wg.Wait()
	ps, err := eng.PoolStats(context.Background(), "q")
	if err != nil || ps.Available != 5 {
		t.Fatalf("pool %+v, %v: want the fallback allowance of 5, once", ps, err)
	}
}
