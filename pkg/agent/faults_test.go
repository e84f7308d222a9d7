package agent_test

import (
	"context"
	"errors"
	"net"
	"sync"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/redis/go-redis/v9"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/allot-dev/allot/internal/redistest"
	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/agent"
	"github.com/allot-dev/allot/pkg/faultproxy"
	"github.com/allot-dev/allot/pkg/policy"
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
			// The request may give up (StarveWait) before a slow machine has
			// the garbage answer in hand: wait for the agent to refuse it.
			waitFor(t, 10*time.Second, "a malformed renewal counted", func() bool {
				return testutil.ToFloat64(counterVec(t, reg, "allot_agent_renewal_failures_total", "malformed")) >= 1
			})
			if ps := poolStats(t, rdb, cfg.Engine.Namespace, doc, "q-a"); ps.Deposited != 0 {
				t.Fatalf("deposited %d tokens from a garbage answer, want 0", ps.Deposited)
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

// TestUnsureDepositIsNotHandedBackTwice: a deposit that times out may still
// land (the store was only slow). The agent must not hand the grant's tokens
// back while they can still be spent in the store: it withdraws the grant
// first (tombstoning it, so a late deposit adds nothing) and returns only
// what is certainly out of the store. Redis is paused for writes right after
// the grant, longer than a deposit attempt waits.
func TestUnsureDepositIsNotHandedBackTwice(t *testing.T) {
	rdb := sharedRedis(t)
	fa := startFakeAllocator(t)
	doc := quotasPolicy(t, "10", "30s", "1h", 0, "closed")
	fa.publish(doc)
	var (
		mu      sync.Mutex
		granted *allotv1.Grant
	)
	fa.setHook(func(ctx context.Context, _ *allotv1.AcquireRequest, commit func() (*allotv1.AcquireResponse, error)) (*allotv1.AcquireResponse, error) {
		mu.Lock()
		defer mu.Unlock()
		if granted != nil { // one grant only, so the pool holds nothing else
			return nil, connect.NewError(connect.CodeUnavailable, errors.New("test: no more grants"))
		}
		resp, err := commit()
		if err != nil || len(resp.Grants) != 1 || resp.Grants[0].Tokens == 0 {
			return resp, err
		}
		if err := rdb.Do(ctx, "CLIENT", "PAUSE", "400", "WRITE").Err(); err != nil {
			t.Errorf("CLIENT PAUSE: %v", err)
		}
		granted = resp.Grants[0]
		return resp, nil
	})
	cfg := testConfig("eu", fa.addr)
	cfg.StarveWait = 200 * time.Millisecond
	cfg.Lease.DepositTimeout = 50 * time.Millisecond // the attempt ends inside the pause
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1)))
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	_, _ = a.Check(ctx, tenant("a")) // starts the demand; its verdict does not matter
	var g *allotv1.Grant
	waitFor(t, 5*time.Second, "the grant", func() bool {
		mu.Lock()
		defer mu.Unlock()
		g = granted
		return g != nil
	})
	released := func() int64 {
		var n int64
		for _, r := range fa.releaseLog() {
			if r.GrantId == g.GrantId {
				n += r.Tokens
			}
		}
		return n
	}
	waitFor(t, 5*time.Second, "the grant's hand-back", func() bool { return released() > 0 })
	time.Sleep(500 * time.Millisecond) // the pause is over: a late deposit has landed by now
	ps := poolStats(t, rdb, cfg.Engine.Namespace, doc, "q-a")
	if got := ps.Available + ps.Consumed + released(); got > g.Tokens {
		t.Fatalf("grant %s of %d tokens: %d spendable in the store + %d spent + %d handed back = %d: handed back tokens that can still be spent",
			g.GrantId, g.Tokens, ps.Available, ps.Consumed, released(), got)
	}
	if got := ps.Available + ps.Consumed + released(); got != g.Tokens {
		t.Fatalf("grant %s of %d tokens: %d spendable + %d spent + %d handed back = %d: tokens lost",
			g.GrantId, g.Tokens, ps.Available, ps.Consumed, released(), got)
	}
}

// TestCallerDeadlineIsAnErrorNotAVerdict: when the caller's deadline passes
// before a slow Redis answers, Check returns the deadline's error (Connect
// and gRPC map it to DEADLINE_EXCEEDED), not the verdict of the rule's fail
// mode, which the caller could no longer use and which would read as the
// store failing; a caller with time to wait gets the store's decision.
func TestCallerDeadlineIsAnErrorNotAVerdict(t *testing.T) {
	redistest.Require(t, shared.err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// The script loaded beforehand, as an earlier test of the package
	// would have: run alone, the first pipeline's dial, handshake, NOSCRIPT
	// and EVAL through the slow proxy outlast the store's pipeline timeout.
	direct, err := admission.NewRedisStore(sharedRedis(t), admission.DefaultRedisConfig())
	if err != nil {
		t.Fatal(err)
	}
	if err := direct.Load(ctx); err != nil {
		t.Fatal(err)
	}
	_ = direct.Close()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	slow := faultproxy.New(ln, func(ctx context.Context) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", shared.redis.Addr())
	}, faultproxy.Config{DelayMin: 150 * time.Millisecond, DelayMax: 150 * time.Millisecond}, 1)
	go func() { _ = slow.Run(ctx) }()
	rdb := redis.NewClient(&redis.Options{Addr: slow.Addr().String(), ReadTimeout: 5 * time.Second})
	defer rdb.Close()
	cfg := testConfig("eu")
	cfg.Engine.StoreTimeout = 3 * time.Second // the store decides whoever waits for it
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(mustParse(t, apiPolicy), 0))).Agent
	in := &agent.Input{Descriptors: []policy.Entry{{Key: "tenant", Value: "atlas"}, {Key: "user", Value: "u1"}}, Cost: 1}

	short, stop := context.WithTimeout(ctx, 50*time.Millisecond)
	v, err := a.Check(short, in)
	stop()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("Check past the caller's deadline: verdict %+v, error %v; want context.DeadlineExceeded", v, err)
	}
	long, stop := context.WithTimeout(ctx, 10*time.Second)
	defer stop()
	v, err = a.Check(long, in)
	if err != nil || !v.Allowed || v.Unavailable {
		t.Fatalf("Check with time to wait: verdict %+v, error %v; want allowed by the store", v, err)
	}
}
