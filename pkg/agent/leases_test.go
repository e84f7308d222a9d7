package agent_test

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/agent"
	"github.com/allot-dev/allot/pkg/faultproxy"
	"github.com/allot-dev/allot/pkg/policy"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// threeQuotas has three leased tenant quotas; CHUNK, TTL, WINDOW and MODE
// are placeholders.
const threeQuotas = `
name: three
regions: [eu, us]
rules:
  - name: q-a
    scope: tenant
    match: [{key: tenant, value: a}]
    kind: global_quota
    limit: 1000
    window: WINDOW
    lease: {chunk: CHUNK, ttl: TTL, fallback_per_region: FALLBACK}
    fail_mode: MODE
  - name: q-b
    scope: tenant
    match: [{key: tenant, value: b}]
    kind: global_quota
    limit: 1000
    window: WINDOW
    lease: {chunk: CHUNK, ttl: TTL}
  - name: q-c
    scope: tenant
    match: [{key: tenant, value: c}]
    kind: global_quota
    limit: 1000
    window: WINDOW
    lease: {chunk: CHUNK, ttl: TTL}
`

func quotasPolicy(t testing.TB, chunk, ttl, window string, fallback int, mode string) *policy.Document {
	r := strings.NewReplacer("CHUNK", chunk, "TTL", ttl, "WINDOW", window, "FALLBACK", fmt.Sprint(fallback), "MODE", mode)
	return mustParse(t, r.Replace(threeQuotas))
}

// threeQuotasAgent is the common setup of the lease tests: the shared
// Redis, a fake allocator serving the three quotas (chunk 10, TTL 30 s,
// 1 h windows, fail closed) and an agent config for region eu against it.
func threeQuotasAgent(t testing.TB) (*redis.Client, *fakeAllocator, *policy.Document, agent.Config) {
	t.Helper()
	return quotasAgent(t, "10", "30s")
}

// quotasAgent is threeQuotasAgent with the quotas' chunk and TTL.
func quotasAgent(t testing.TB, chunk, ttl string) (*redis.Client, *fakeAllocator, *policy.Document, agent.Config) {
	t.Helper()
	rdb := sharedRedis(t)
	fa := startFakeAllocator(t)
	doc := quotasPolicy(t, chunk, ttl, "1h", 0, "closed")
	fa.publish(doc)
	return rdb, fa, doc, testConfig("eu", fa.addr)
}

func tenant(name string) *agent.Input {
	return &agent.Input{Descriptors: []policy.Entry{{Key: "tenant", Value: name}}}
}

func mustCheck(t testing.TB, a *agent.Agent, in *agent.Input) *agent.Verdict {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	v, err := a.Check(ctx, in)
	if err != nil {
		t.Fatalf("Check: %v", err)
	}
	return v
}

// TestOneBatchedAcquireForEveryStarvedQuota: three pools starve; one tick
// asks for all three in ONE Acquire, and the grants are spendable.
func TestOneBatchedAcquireForEveryStarvedQuota(t *testing.T) {
	rdb, fa, doc, cfg := threeQuotasAgent(t)
	cfg.StarveWait = 0 // nobody renews in this test but the test itself
	a := newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1))
	for _, ten := range []string{"a", "b", "c"} {
		if v := mustCheck(t, a, tenant(ten)); v.Allowed || !v.Unavailable {
			t.Fatalf("tenant %s before any lease: %+v, want unavailable (no tokens held, renewal pending)", ten, v)
		}
	}
	a.Renew(context.Background())
	acq := fa.acquireLog()
	if len(acq) != 1 {
		t.Fatalf("Acquire calls = %d, want exactly 1 for all starved quotas", len(acq))
	}
	var names []string
	for _, w := range acq[0].GetWants() {
		names = append(names, w.GetQuota())
		if w.GetTokens() != 10 {
			t.Errorf("want %s: %d tokens, want the policy chunk 10 (no demand measured yet)", w.GetQuota(), w.GetTokens())
		}
	}
	if strings.Join(names, ",") != "q-a,q-b,q-c" || acq[0].GetRegion() != "eu" {
		t.Fatalf("Acquire = region %s wants %v, want eu and q-a,q-b,q-c", acq[0].GetRegion(), names)
	}
	for _, ten := range []string{"a", "b", "c"} {
		if v := mustCheck(t, a, tenant(ten)); !v.Allowed || v.Remaining != 9 {
			t.Fatalf("tenant %s after the renewal: %+v, want allowed with 9 left", ten, v)
		}
	}
	// Nothing more is due: another tick sends nothing.
	a.Renew(context.Background())
	if n := len(fa.acquireLog()); n != 1 {
		t.Fatalf("Acquire calls after an idle tick = %d, want still 1", n)
	}
}

// TestDepositNeverOutlivesTheLease: the store's expiry of every deposited
// grant is at or before the allocator's expiry minus the margin (same
// machine, so the clocks agree), whatever the delays on the way.
func TestDepositNeverOutlivesTheLease(t *testing.T) {
	rdb, fa, doc, cfg := quotasAgent(t, "10", "2s")
	cfg.Lease.Margin = 300 * time.Millisecond
	cfg.StarveWait = 0
	// Delay every answer: the deadline must count from the send, not the
	// reply. The delay must exceed the deposit's bound, which the TTL
	// leaves unused: a deadline counted from the reply would otherwise
	// still fit (the store delay measured on this machine is ~1 ms, so
	// the bound is DepositTimeout).
	cfg.Lease.DepositTimeout = 200 * time.Millisecond
	const answerDelay = 600 * time.Millisecond
	fa.setHook(func(ctx context.Context, _ *allotv1.AcquireRequest, commit func() (*allotv1.AcquireResponse, error)) (*allotv1.AcquireResponse, error) {
		resp, err := commit()
		time.Sleep(answerDelay)
		return resp, err
	})
	a := newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1))
	for _, ten := range []string{"a", "b", "c"} {
		mustCheck(t, a, tenant(ten))
	}
	a.Renew(context.Background())
	for _, q := range []string{"q-a", "q-b", "q-c"} {
		r := doc.Rule(q)
		z := cfg.Engine.Namespace + ":{t:" + r.Match[0].Value + "}:pool:" + q + ":z"
		zs, err := rdb.ZRangeWithScores(context.Background(), z, 0, -1).Result()
		if err != nil {
			t.Fatal(err)
		}
		if len(zs) != 1 {
			t.Fatalf("%s: %d grants in the store, want 1", q, len(zs))
		}
		g, ok := fa.grant(zs[0].Member.(string))
		if !ok {
			t.Fatalf("%s: grant %v unknown to the allocator", q, zs[0].Member)
		}
		storeExpiry := int64(zs[0].Score)
		limit := g.ExpiresUnixMs - cfg.Lease.Margin.Milliseconds()
		if storeExpiry > limit {
			t.Errorf("%s: the store expires the grant at %d, after the lease's expiry %d minus the margin (%d)", q, storeExpiry, g.ExpiresUnixMs, limit)
		}
	}
}

// TestLostAnswerIsRetriedWithTheSameRequestID: the allocator commits the
// first Acquire but its answer is lost (first Unavailable, then a stall past
// the agent's timeout); every retry carries the same request id, the
// allocator replays, and the tokens are granted and deposited once.
func TestLostAnswerIsRetriedWithTheSameRequestID(t *testing.T) {
	for _, tt := range []struct {
		name string
		lose func(ctx context.Context) error
	}{
		{"unavailable", func(context.Context) error {
			return connect.NewError(connect.CodeUnavailable, errors.New("connection reset"))
		}},
		{"timeout", func(ctx context.Context) error {
			<-ctx.Done() // past the agent's AcquireTimeout
			return ctx.Err()
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			rdb, fa, doc, cfg := threeQuotasAgent(t)
			cfg.StarveWait = 0
			cfg.Lease.AcquireTimeout = 300 * time.Millisecond
			var lost atomic.Int32
			fa.setHook(func(ctx context.Context, _ *allotv1.AcquireRequest, commit func() (*allotv1.AcquireResponse, error)) (*allotv1.AcquireResponse, error) {
				resp, err := commit()
				if lost.Add(1) <= 2 {
					return nil, tt.lose(ctx)
				}
				return resp, err
			})
			a := newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1))
			mustCheck(t, a, tenant("a"))
			for i := 0; i < 5 && a.Leases()[0].Deposits == 0; i++ {
				a.Renew(context.Background())
			}
			acq := fa.acquireLog()
			if len(acq) < 3 {
				t.Fatalf("Acquire calls = %d, want the call and two retries", len(acq))
			}
			for _, r := range acq {
				if r.GetRequestId() != acq[0].GetRequestId() {
					t.Fatalf("retry carried request id %q, the first call %q", r.GetRequestId(), acq[0].GetRequestId())
				}
			}
			if w := fa.window("q-a"); w.Granted != 10 {
				t.Fatalf("allocator granted %d tokens, want 10 (one grant, replayed on retry)", w.Granted)
			}
			ps := poolStats(t, rdb, cfg.Engine.Namespace, doc, "q-a")
			if ps.Deposited != 10 || ps.Available != 10 {
				t.Fatalf("pool: deposited %d available %d, want 10 and 10", ps.Deposited, ps.Available)
			}
		})
	}
}

// TestCutOffSpendsHeldTokensThenAnswersUnavailable: with the allocator
// gone, the region admits exactly what it was granted, then 503 (unavailable),
// not 429: the pool is not exhausted, the limiter is cut off.
func TestCutOffSpendsHeldTokensThenAnswersUnavailable(t *testing.T) {
	rdb, fa, doc, cfg := quotasAgent(t, "5", "30s")
	// The first Acquire is answered; then the allocator is partitioned away.
	var calls atomic.Int32
	fa.setHook(func(_ context.Context, _ *allotv1.AcquireRequest, commit func() (*allotv1.AcquireResponse, error)) (*allotv1.AcquireResponse, error) {
		if calls.Add(1) == 1 {
			return commit()
		}
		return nil, connect.NewError(connect.CodeUnavailable, errors.New("partitioned"))
	})
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1)))
	if v := mustCheck(t, a.Agent, tenant("a")); !v.Allowed {
		t.Fatalf("first check: %+v, want allowed after a renewal", v)
	}
	allowed := 1
	var last *agent.Verdict
	for i := 0; i < 20; i++ {
		last = mustCheck(t, a.Agent, tenant("a"))
		if !last.Allowed {
			break
		}
		allowed++
	}
	// The one grant is what the region holds: the chunk of 5, or less when
	// the agent had measured the pool's demand before its first renewal
	// (demand-driven sizing; a loaded machine delays that renewal).
	if held := fa.window("q-a").Granted; allowed != int(held) || held < 2 {
		t.Fatalf("admitted %d while cut off, want exactly the %d held (at least 2); last %+v", allowed, held, last)
	}
	if !last.Unavailable || last.RetryAfter < 1 || last.Rule != "q-a" {
		t.Fatalf("after the held tokens: %+v, want unavailable (503) by q-a with a retry hint", last)
	}
	if !a.CutOff() {
		t.Fatal("agent does not report being cut off")
	}
	// The allocator comes back: renewals resume.
	fa.setHook(nil)
	waitFor(t, 10*time.Second, "a renewal after the allocator returns", func() bool {
		return mustCheck(t, a.Agent, tenant("a")).Allowed
	})
}

// TestRefusedQuotaIsAnsweredAtOnce: a quota the allocator refused is left
// out of renewals for QuarantineTime; meanwhile its requests are answered
// 503 at once, with a Retry-After covering the rest of the quarantine, not
// after waiting StarveWait for a renewal that cannot come. Once the
// quarantine ends it is renewed again.
func TestRefusedQuotaIsAnsweredAtOnce(t *testing.T) {
	rdb, fa, doc, cfg := threeQuotasAgent(t)
	cfg.StarveWait = 5 * time.Second // a wait, were there one, would be plain
	cfg.Lease.QuarantineTime = 3 * time.Second
	var refuse atomic.Bool
	refuse.Store(true)
	var refusedAt atomic.Int64 // unix ns of the first refusal
	fa.setHook(func(_ context.Context, _ *allotv1.AcquireRequest, commit func() (*allotv1.AcquireResponse, error)) (*allotv1.AcquireResponse, error) {
		if !refuse.Load() {
			return commit()
		}
		refusedAt.CompareAndSwap(0, time.Now().UnixNano())
		return nil, connect.NewError(connect.CodeFailedPrecondition, errors.New("wants[0]: region eu is not declared for this quota"))
	})
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1)))
	for i := range 3 {
		t0 := time.Now()
		v := mustCheck(t, a.Agent, tenant("a"))
		took := time.Since(t0)
		// The first check waits for the round that is refused; none waits
		// the starve wait.
		if took > cfg.StarveWait/2 {
			t.Fatalf("check %d took %s, want an answer well within the starve wait (%s)", i, took, cfg.StarveWait)
		}
		left := time.Until(time.Unix(0, refusedAt.Load()).Add(cfg.Lease.QuarantineTime))
		if v.Allowed || !v.Unavailable || v.Rule != "q-a" || float64(v.RetryAfter) < left.Seconds() ||
			time.Duration(v.RetryAfter)*time.Second > cfg.Lease.QuarantineTime+time.Second {
			t.Fatalf("check %d: %+v, want unavailable by q-a with a retry after the quarantine's %s left", i, v, left)
		}
	}
	if n := len(fa.acquireLog()); n != 1 {
		t.Fatalf("%d Acquire calls during the quarantine, want the one refused", n)
	}
	refuse.Store(false)
	waitFor(t, cfg.Lease.QuarantineTime+10*time.Second, "a renewal after the quarantine", func() bool {
		return mustCheck(t, a.Agent, tenant("a")).Allowed
	})
}

// answerOnceThenDown makes fa answer the first Acquire with nothing granted
// (the agent measures the leader's clock and holds nothing) and every later
// one unavailable: an allocator partitioned away after one answer.
func answerOnceThenDown(fa *fakeAllocator) {
	var answered atomic.Bool
	fa.setHook(func(_ context.Context, _ *allotv1.AcquireRequest, commit func() (*allotv1.AcquireResponse, error)) (*allotv1.AcquireResponse, error) {
		if answered.Swap(true) {
			return nil, connect.NewError(connect.CodeUnavailable, errors.New("test: allocator partitioned away"))
		}
		resp, err := commit()
		if err != nil {
			return nil, err
		}
		for _, g := range resp.Grants {
			g.Tokens = 0
		}
		return resp, nil
	})
}

// cutOffAdmits checks tenant a until the agent is cut off and a request is
// refused (20 checks at most), and returns how many were admitted and the
// last verdict.
func cutOffAdmits(t *testing.T, a *agent.Agent) (int, *agent.Verdict) {
	t.Helper()
	allowed := 0
	var last *agent.Verdict
	for i := 0; i < 20; i++ {
		last = mustCheck(t, a, tenant("a"))
		if !last.Allowed && a.CutOff() {
			break
		}
		if last.Allowed {
			allowed++
		}
	}
	return allowed, last
}

// TestCutOffFallbackAllowance: cut off after an answer, a fallback quota
// admits its fallback_per_region once per window, then answers 503.
func TestCutOffFallbackAllowance(t *testing.T) {
	rdb := sharedRedis(t)
	fa := startFakeAllocator(t)
	doc := quotasPolicy(t, "5", "30s", "1h", 3, "fallback")
	fa.publish(doc)
	answerOnceThenDown(fa)
	cfg := testConfig("eu", fa.addr)
	cfg.Lease.AcquireTimeout = 100 * time.Millisecond
	var mu sync.Mutex
	var fbs []agent.LeaseEvent
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1), agent.WithLeaseObserver(func(e agent.LeaseEvent) {
		if e.Kind == agent.LeaseEventFallback {
			mu.Lock()
			fbs = append(fbs, e)
			mu.Unlock()
		}
	})))
	if allowed, last := cutOffAdmits(t, a.Agent); allowed != 3 || !last.Unavailable {
		t.Fatalf("cut off after an answer: admitted %d then %+v; want the fallback allowance 3, then unavailable", allowed, last)
	}
	// The allowance is journaled: its window by the leader's clock, what it
	// added, and a store lifetime ending by its deadline, before the
	// window's end (one machine: one clock).
	mu.Lock()
	if len(fbs) != 1 {
		t.Fatalf("%d fallback events journaled, want 1: %+v", len(fbs), fbs)
	}
	e := fbs[0]
	mu.Unlock()
	hour := time.Hour.Milliseconds()
	windowEnd := (e.Window + 1) * hour * int64(time.Millisecond)
	if e.Outcome != agent.LeaseOK || e.Tokens != 3 || e.Quota != "q-a" || e.GrantID != fmt.Sprintf("fb-eu-%d", e.Window) ||
		e.LeaderNowMs/hour != e.Window || e.TTLMs <= 0 || e.At+e.TTLMs*int64(time.Millisecond) > e.Deadline || e.Deadline > windowEnd {
		t.Fatalf("fallback event %+v: want ok, 3 tokens of q-a in chunk fb-eu-<window>, the window holding LeaderNowMs, a store lifetime ending by the deadline, before the window's end", e)
	}
	// A closed quota gets nothing while cut off.
	if v := mustCheck(t, a.Agent, tenant("b")); v.Allowed || !v.Unavailable {
		t.Fatalf("closed quota while cut off: %+v, want unavailable", v)
	}
}

// TestCutOffSinceStartDepositsNoAllowance: an agent that has had no answer
// since it started (restarted during a partition) has never measured the
// leader's clock, and its wall clock has no bound against it: it would
// place the allowance in the window its wall clock says, while the region's
// other agents (or its previous process) may hold the previous window's. It
// deposits none: a fallback quota answers 503 at once, counted as withheld.
func TestCutOffSinceStartDepositsNoAllowance(t *testing.T) {
	rdb := sharedRedis(t)
	doc := quotasPolicy(t, "5", "30s", "1h", 3, "fallback")
	cfg := testConfig("eu", "127.0.0.1:1") // no allocator listens there
	cfg.Lease.AcquireTimeout = 100 * time.Millisecond
	reg := prometheus.NewRegistry()
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(doc, 0), agent.WithRegisterer(reg)))
	allowed, last := cutOffAdmits(t, a.Agent)
	if allowed != 0 || !last.Unavailable || last.Waited >= cfg.StarveWait {
		t.Fatalf("cut off from the start: admitted %d then %+v; want none, and unavailable without waiting out the starve wait", allowed, last)
	}
	// The next round counts the allowance it withholds.
	waitFor(t, 5*time.Second, "fallback_withheld_total{reason=unmeasured} to count the withheld allowance", func() bool {
		return metricValue(t, reg, "allot_agent_fallback_withheld_total", "reason", "unmeasured") >= 1
	})
	if n := metricValue(t, reg, "allot_agent_fallback_deposits_total"); n != 0 {
		t.Errorf("fallback_deposits_total = %v, want 0", n)
	}
}

// TestCutOffWindowTailWaitsForTheNextAllowance: while cut off, a fallback
// quota's allowance dies the margin before its window ends. A request in
// that tail waits for the next window's allowance (latency, like a
// connected region's renewal at the turn) instead of a 503 for the rest of
// every window.
func TestCutOffWindowTailWaitsForTheNextAllowance(t *testing.T) {
	rdb := sharedRedis(t)
	fa := startFakeAllocator(t)
	doc := quotasPolicy(t, "5", "1s", "1s", 500, "fallback")
	fa.publish(doc)
	answerOnceThenDown(fa)
	cfg := testConfig("eu", fa.addr)
	cfg.Lease.AcquireTimeout = 100 * time.Millisecond
	cfg.Lease.Margin = 200 * time.Millisecond // a tail wide enough to land in
	// A tail request waits up to ~0.7 s here (the margin and testConfig's
	// deposit bound); a loaded machine must not turn that into a timeout.
	cfg.StarveWait = 3 * time.Second
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1)))
	waitFor(t, 5*time.Second, "the agent to find itself cut off", func() bool {
		mustCheck(t, a.Agent, tenant("a"))
		return a.CutOff()
	})
	// Requests every 10 ms across three window turns (bounded in count).
	var tail, unavailable int
	for i := 0; i < 300; i++ {
		now := time.Now()
		v := mustCheck(t, a.Agent, tenant("a"))
		// In a tail: sent after the margin began, or made to wait there.
		if now.UnixMilli()%1000 >= 1000-cfg.Lease.Margin.Milliseconds() || v.Waited > 0 {
			tail++
		}
		if !v.Allowed {
			unavailable++
			t.Logf("at %s (%d ms into the window): %+v", now.Format("15:04:05.000"), now.UnixMilli()%1000, v)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if tail == 0 {
		t.Fatal("no request landed in a window's tail: the test did not test")
	}
	if unavailable > 0 {
		t.Fatalf("%d of 300 requests answered unavailable (%d sent in windows' tails); want every one served by an allowance", unavailable, tail)
	}
}

// TestExhaustedPoolAnswers429UntilTheWindowEnds: when the global pool is
// used up the answer is 429 with Retry-After to the window's end.
func TestExhaustedPoolAnswers429UntilTheWindowEnds(t *testing.T) {
	rdb := sharedRedis(t)
	fa := startFakeAllocator(t)
	doc := mustParse(t, `
name: small
regions: [eu, us]
rules:
  - name: tiny
    scope: tenant
    match: [{key: tenant, value: a}]
    kind: global_quota
    limit: 6
    window: 1h
    lease: {chunk: 4, ttl: 1h}
`)
	fa.publish(doc)
	cfg := testConfig("eu", fa.addr)
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1)))
	admitted := 0
	var last *agent.Verdict
	var before, after time.Time
	for i := 0; i < 20; i++ {
		before = time.Now()
		last = mustCheck(t, a.Agent, tenant("a"))
		after = time.Now()
		if !last.Allowed {
			break
		}
		admitted++
	}
	if admitted != 6 {
		t.Fatalf("admitted %d, want the whole pool of 6 (chunks of 4 then 2)", admitted)
	}
	if last.Unavailable || last.Rule != "tiny" {
		t.Fatalf("after the pool: %+v, want a 429 by tiny", last)
	}
	end := (before.UnixMilli()/3_600_000 + 1) * 3_600_000
	hi := int64(math.Ceil(float64(end-before.UnixMilli()) / 1000))
	lo := int64(math.Ceil(float64(end-after.UnixMilli())/1000)) - 1
	if end-before.UnixMilli() < 2000 {
		t.Skip("the window ended during the test; the hint is checked in the next one")
	}
	if last.RetryAfter < lo || last.RetryAfter > hi {
		t.Fatalf("retry_after = %d, want the seconds to the window's end, in [%d, %d]", last.RetryAfter, lo, hi)
	}
	if st := a.Leases(); len(st) != 1 || !st[0].Exhausted {
		t.Fatalf("lease status %+v, want exhausted", st)
	}
}

// TestShutdownHandsUnspentTokensBack: on shutdown the agent withdraws its
// unspent tokens from the store (nothing left to spend) and releases them
// to the allocator's pool.
func TestShutdownHandsUnspentTokensBack(t *testing.T) {
	rdb, fa, doc, cfg := threeQuotasAgent(t)
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1)))
	for i := 0; i < 3; i++ {
		if v := mustCheck(t, a.Agent, tenant("a")); !v.Allowed {
			t.Fatalf("check %d: %+v", i, v)
		}
	}
	if v := mustCheck(t, a.Agent, tenant("b")); !v.Allowed {
		t.Fatalf("tenant b: %+v", v)
	}
	if err := a.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	for _, tt := range []struct {
		quota string
		spent int64
	}{{"q-a", 3}, {"q-b", 1}} {
		w := fa.window(tt.quota)
		ps := poolStats(t, rdb, cfg.Engine.Namespace, doc, tt.quota)
		if ps.Available != 0 {
			t.Errorf("%s: %d tokens left in the store after shutdown, want 0", tt.quota, ps.Available)
		}
		if w.Granted-w.Released != ps.Consumed || ps.Consumed != tt.spent {
			t.Errorf("%s: granted %d released %d, spent %d; want exactly the spent tokens kept (%d)", tt.quota, w.Granted, w.Released, ps.Consumed, tt.spent)
		}
	}
	for _, r := range fa.releaseLog() {
		if r.GetRegion() != "eu" || r.GetTokens() <= 0 {
			t.Errorf("release %v: want region eu and a positive amount", r)
		}
	}
}

// TestShutdownWithdrawsBeforeReleasing: with an allocator that does not
// answer, shutdown still withdraws every quota's unspent tokens from the
// store within ShutdownTimeout and returns no error. (It used to release
// each quota's tokens right after withdrawing them, so an unreachable
// allocator used up the time the next quota's withdrawal needed; the chaos
// suite's skew-region restart during a partition found it.)
func TestShutdownWithdrawsBeforeReleasing(t *testing.T) {
	rdb, fa, doc, cfg := threeQuotasAgent(t)
	cfg.ShutdownTimeout = 900 * time.Millisecond // shorter than one release's AcquireTimeout (1 s)
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1)))
	for _, ten := range []string{"a", "b"} {
		if v := mustCheck(t, a.Agent, tenant(ten)); !v.Allowed {
			t.Fatalf("tenant %s: %+v", ten, v)
		}
	}
	fa.stallRelease.Store(true)
	if err := a.stop(); err != nil {
		t.Fatalf("Run: %v, want nil (the withdrawals succeeded; the releases may not)", err)
	}
	for _, quota := range []string{"q-a", "q-b"} {
		if ps := poolStats(t, rdb, cfg.Engine.Namespace, doc, quota); ps.Available != 0 {
			t.Errorf("%s: %d tokens left in the store after shutdown, want 0 (withdrawn)", quota, ps.Available)
		}
	}
}

// TestShutdownReleasesSideBySide: with an allocator that takes 400 ms per
// Release and a 900 ms shutdown budget, all three quotas' tokens still go
// back (one release after another would fit two).
func TestShutdownReleasesSideBySide(t *testing.T) {
	rdb, fa, doc, cfg := threeQuotasAgent(t)
	cfg.ShutdownTimeout = 900 * time.Millisecond
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1)))
	for _, ten := range []string{"a", "b", "c"} {
		if v := mustCheck(t, a.Agent, tenant(ten)); !v.Allowed {
			t.Fatalf("tenant %s: %+v", ten, v)
		}
	}
	fa.releaseDelay.Store(int64(400 * time.Millisecond))
	if err := a.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	for _, quota := range []string{"q-a", "q-b", "q-c"} {
		if w := fa.window(quota); w.Released == 0 {
			t.Errorf("%s: nothing released on shutdown (granted %d)", quota, w.Granted)
		}
	}
}

// TestShutdownCountsOnlyAcknowledgedReleases: with an allocator that does
// not answer, shutdown withdraws the unspent tokens but hands none back,
// and says so: the info log counts 0 tokens handed back (it used to count
// every withdrawn token, acknowledged or not), and a warning counts the
// tokens not handed back, which return to the pool when their leases
// expire.
func TestShutdownCountsOnlyAcknowledgedReleases(t *testing.T) {
	rdb, fa, doc, cfg := threeQuotasAgent(t)
	cfg.ShutdownTimeout = 500 * time.Millisecond
	core, logs := observer.New(zap.InfoLevel)
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1), agent.WithLogger(zap.New(core))))
	for _, ten := range []string{"a", "b"} {
		if v := mustCheck(t, a.Agent, tenant(ten)); !v.Allowed {
			t.Fatalf("tenant %s: %+v", ten, v)
		}
	}
	fa.stallRelease.Store(true)
	if err := a.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	var unspent int64
	for _, quota := range []string{"q-a", "q-b"} {
		if w := fa.window(quota); w.Released != 0 {
			t.Fatalf("%s: %d released with Release stalled", quota, w.Released)
		} else {
			unspent += w.Granted - 1 // one token spent
		}
	}
	done := logs.FilterMessage("unspent tokens handed back").All()
	if len(done) != 1 || done[0].ContextMap()["tokens"] != int64(0) || done[0].ContextMap()["unspent"] != unspent {
		t.Fatalf("shutdown log %v: want 0 tokens handed back of %d unspent", done, unspent)
	}
	lost := logs.FilterMessageSnippet("unspent tokens not handed back").All()
	if len(lost) != 1 || lost[0].Level != zap.WarnLevel || lost[0].ContextMap()["tokens"] != unspent ||
		!strings.Contains(lost[0].Message, "when their leases expire") {
		t.Fatalf("logs %v: want one warning counting the %d tokens not handed back", lost, unspent)
	}
}

// TestShutdownBudgetCountsFromTheStop: a round in progress when the agent
// stops, blocked handing an unusable grant back to an allocator that does
// not answer, does not hold the shutdown past ShutdownTimeout: the budget
// counts from the stop, and the hand-back shares it (and is logged as
// failed). The hand-back used to run to its AcquireTimeout first, and the
// shutdown's own budget started only after it.
func TestShutdownBudgetCountsFromTheStop(t *testing.T) {
	rdb, fa, doc, cfg := threeQuotasAgent(t)
	cfg.Lease.AcquireTimeout = 3 * time.Second
	cfg.ShutdownTimeout = 300 * time.Millisecond
	cfg.StarveWait = 100 * time.Millisecond
	// Grants that end before they could be deposited: each is handed back.
	fa.setHook(func(_ context.Context, _ *allotv1.AcquireRequest, commit func() (*allotv1.AcquireResponse, error)) (*allotv1.AcquireResponse, error) {
		resp, err := commit()
		if err != nil {
			return nil, err
		}
		for _, g := range resp.Grants {
			g.TtlMs, g.ExpiresUnixMs = 1, resp.LeaderNowUnixMs+1
		}
		return resp, nil
	})
	fa.stallRelease.Store(true)
	core, logs := observer.New(zap.WarnLevel)
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1), agent.WithLogger(zap.New(core))))
	checked := make(chan struct{})
	go func() {
		defer close(checked)
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, _ = a.Check(ctx, tenant("a")) // starts the renewal; its verdict does not matter
	}()
	waitFor(t, 10*time.Second, "a hand-back", func() bool { return fa.releaseCalls.Load() > 0 })
	t0 := time.Now()
	if err := a.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if took := time.Since(t0); took > cfg.ShutdownTimeout+700*time.Millisecond {
		t.Fatalf("Run returned %s after the stop, want within ShutdownTimeout (%s) and a little", took, cfg.ShutdownTimeout)
	}
	<-checked
	if es := logs.FilterMessageSnippet("tokens not handed back").All(); len(es) == 0 || es[0].ContextMap()["quota"] != "q-a" {
		t.Fatalf("logs %v: want the failed hand-back of q-a's grant logged", es)
	}
}

// TestFollowsTheAllocatorLeader: on a real 3-node cluster, renewals
// continue through the new leader when the leader stops.
func TestFollowsTheAllocatorLeader(t *testing.T) {
	rdb := sharedRedis(t)
	c := startCluster(t, 3)
	doc := quotasPolicy(t, "5", "30s", "1h", 0, "closed")
	c.publish(doc, 1)
	cfg := testConfig("eu", c.endpoints()...)
	a := runAgent(t, newAgent(t, cfg, rdb))
	followLeader(t, c, a)
}

// TestFollowsTheAllocatorLeaderOverGRPC is the same with the agent's own
// allocator client sending Acquire and Release to the nodes' gRPC
// listeners (AllocatorGRPCEndpoints), through proxies that show the
// traffic took that route.
func TestFollowsTheAllocatorLeaderOverGRPC(t *testing.T) {
	rdb := sharedRedis(t)
	c := startCluster(t, 3)
	doc := quotasPolicy(t, "5", "30s", "1h", 0, "closed")
	c.publish(doc, 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var proxies []*faultproxy.Proxy
	cfg := testConfig("eu", c.endpoints()...)
	for _, addr := range c.grpcEndpoints() {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		p := faultproxy.New(ln, func(ctx context.Context) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "tcp", addr)
		}, faultproxy.Config{}, 1)
		go func() { _ = p.Run(ctx) }()
		proxies = append(proxies, p)
		cfg.AllocatorGRPCEndpoints = append(cfg.AllocatorGRPCEndpoints, p.Addr().String())
	}
	ag, err := agent.New(cfg, rdb, agent.WithLogger(testLogger(t)))
	if err != nil {
		t.Fatal(err)
	}
	a := runAgent(t, ag)
	followLeader(t, c, a)
	var chunks int64
	for _, p := range proxies {
		chunks += p.Stats().Chunks
	}
	if chunks == 0 {
		t.Fatal("no Acquire went through the gRPC listeners")
	}
}

// followLeader checks that a's renewals continue when c's leader stops.
func followLeader(t *testing.T, c *cluster, a *running) {
	t.Helper()
	waitFor(t, 10*time.Second, "policy v1", func() bool { return a.PolicyVersion() == 1 })
	if v := mustCheck(t, a.Agent, tenant("a")); !v.Allowed {
		t.Fatalf("before the failover: %+v", v)
	}
	old := c.leader()
	c.stop(old)
	waitFor(t, 30*time.Second, "a new leader", func() bool { l := c.leader(); return l >= 0 && l != old })
	before := a.Leases()[0].Deposits
	// Spend the held tokens; the next renewal must come from the new leader.
	waitFor(t, 30*time.Second, "a renewal after the failover", func() bool {
		mustCheck(t, a.Agent, tenant("a"))
		return a.Leases()[0].Deposits > before
	})
}

// TestShortLivedGrantsAreSpentBeforeTheyExpire: a pool whose grants are
// spendable for about a second (TTL 1.5 s less the margin and the deposit
// bound) at a steady 50 requests/s. With the default 1 s Lead the region
// would renew at 50 tokens held and ask for 50 more, a stock that outlives
// its grants, so tokens would expire unspent while requests waited; the
// shortened lead (lease.LeadWithin) keeps the stock spendable. Judged after
// a settling period: the first ask, before any demand is measured, is the
// policy's chunk of 100.
func TestShortLivedGrantsAreSpentBeforeTheyExpire(t *testing.T) {
	rdb, fa, doc, cfg := quotasAgent(t, "100", "1500ms")
	cfg.Lease.Lead = time.Second
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1)))

	const rate, settle, measure = 50, 3 * time.Second, 4 * time.Second
	tick := time.NewTicker(time.Second / rate)
	defer tick.Stop()
	start := time.Now()
	var before admission.PoolStats
	var offered, allowed int
	for settled := false; time.Since(start) < settle+measure; <-tick.C {
		if !settled && time.Since(start) >= settle {
			settled = true
			before = poolStats(t, rdb, cfg.Engine.Namespace, doc, "q-a")
		}
		v := mustCheck(t, a.Agent, tenant("a"))
		if settled {
			offered++
			if v.Allowed {
				allowed++
			}
		}
	}
	after := poolStats(t, rdb, cfg.Engine.Namespace, doc, "q-a")
	expired, consumed := after.Expired-before.Expired, after.Consumed-before.Consumed
	t.Logf("after settling: offered %d, allowed %d; consumed %d, expired %d, held %d at the end; %d Acquire calls in all",
		offered, allowed, consumed, expired, after.Available, len(fa.acquireLog()))
	// A tick's worth of demand (the renewal's timing) may expire at a
	// chunk's end; a stock built for a 1 s lead loses most of each chunk.
	if expired > rate/5 {
		t.Errorf("%d tokens expired unspent while %d were consumed: the region holds more than it can spend before its grants expire", expired, consumed)
	}
	if allowed < offered*9/10 {
		t.Errorf("allowed %d of %d: renewals did not keep up", allowed, offered)
	}
}

// TestFallbackDoesNotWaitForARetry: once cut off, a fallback quota's
// allowance is deposited before the round retries the pending Acquire. The
// retry can hang for AcquireTimeout while the allocator is unreachable; the
// allowance used to wait behind it, so requests starved and got 503s.
func TestFallbackDoesNotWaitForARetry(t *testing.T) {
	rdb := sharedRedis(t)
	fa := startFakeAllocator(t)
	doc := quotasPolicy(t, "5", "30s", "1h", 3, "fallback")
	fa.publish(doc)
	cfg := testConfig("eu", fa.addr)
	cfg.Lease.AcquireTimeout = time.Minute // a retry hangs until the test lets it go
	cfg.StarveWait = 3 * time.Second       // ample for the deposit that follows the cut-off
	var (
		calls    atomic.Int32
		ag       atomic.Pointer[agent.Agent]
		once     sync.Once
		retrying = make(chan struct{})
		release  = make(chan struct{})
	)
	defer close(release)
	fa.setHook(func(ctx context.Context, _ *allotv1.AcquireRequest, commit func() (*allotv1.AcquireResponse, error)) (*allotv1.AcquireResponse, error) {
		if calls.Add(1) == 1 {
			return commit()
		}
		// The renewal gets no answer (every attempt of the client), so the
		// agent finds itself cut off and keeps the call to retry; that
		// retry, the first call once cut off, hangs.
		if a := ag.Load(); a != nil && a.CutOff() {
			once.Do(func() { close(retrying) })
			select {
			case <-release:
			case <-ctx.Done():
			}
		}
		return nil, connect.NewError(connect.CodeUnavailable, errors.New("partitioned"))
	})
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1)))
	ag.Store(a.Agent)
	// Spend the grant. The request that finds it gone waits (StarveWait)
	// for the renewal, which fails: the agent is cut off, deposits the
	// fallback allowance and retries the renewal, which hangs. The waiting
	// request and the next two are served by the allowance, the one after
	// them is refused. With the allowance behind the retry, the waiting
	// request got a 503 after the grant.
	allowed := 0
	var last *agent.Verdict
	for i := 0; i < 20; i++ {
		if last = mustCheck(t, a.Agent, tenant("a")); !last.Allowed {
			break
		}
		allowed++
	}
	select {
	case <-retrying:
	case <-time.After(10 * time.Second):
		t.Fatal("the agent never retried its unanswered renewal")
	}
	if held := fa.window("q-a").Granted; int64(allowed) != held+3 || !last.Unavailable {
		t.Fatalf("admitted %d, then %+v; want the %d granted and the fallback allowance of 3 while the retry hangs, then unavailable", allowed, last, held)
	}
	if !a.CutOff() {
		t.Fatal("agent does not report being cut off")
	}
}

// TestShutdownReleasesACutShortAcquire: an Acquire the allocator committed
// but whose answer the agent's shutdown cut short is replayed by shutdown
// with its request id, and its grant released. It used to be dropped, and
// its chunk stayed granted, stranded, until its lease or window ended.
func TestShutdownReleasesACutShortAcquire(t *testing.T) {
	rdb, fa, doc, cfg := quotasAgent(t, "5", "30s")
	cfg.Lease.AcquireTimeout = time.Minute
	var (
		mu        sync.Mutex
		first     string // the cut-short call's request id
		grant     string
		committed = make(chan struct{})
	)
	fa.setHook(func(ctx context.Context, req *allotv1.AcquireRequest, commit func() (*allotv1.AcquireResponse, error)) (*allotv1.AcquireResponse, error) {
		mu.Lock()
		hold := first == ""
		if hold {
			first = req.RequestId
		}
		mu.Unlock()
		resp, err := commit()
		if !hold || err != nil {
			return resp, err // the replay gets the recorded answer
		}
		mu.Lock()
		grant = resp.Grants[0].GrantId
		mu.Unlock()
		close(committed)
		<-ctx.Done() // the answer never leaves before the agent stops
		return nil, ctx.Err()
	})
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1)))
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		_, _ = a.Check(ctx, tenant("a")) // starts the renewal; its verdict does not matter
	}()
	select {
	case <-committed:
	case <-time.After(10 * time.Second):
		t.Fatal("the agent never asked for a chunk")
	}
	if err := a.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	mu.Lock()
	g := grant
	mu.Unlock()
	var released int64
	for _, r := range fa.releaseLog() {
		if r.GrantId == g {
			released += r.Tokens
		}
	}
	if held := fa.window("q-a").Granted; released == 0 || released != held {
		t.Fatalf("released %d of grant %s (%d granted): want the whole cut-short grant handed back on shutdown", released, g, held)
	}
}

// TestShutdownReplaysSideBySide: three Acquires (one quota each) are cut
// short by the stop after the allocator committed them, and the allocator
// takes 400 ms to answer each replay. Shutdown replays them side by side,
// so within its 900 ms budget every grant comes back; one at a time, the
// third replay would start after 800 ms and be cut short, its tokens left
// to expire with the lease.
func TestShutdownReplaysSideBySide(t *testing.T) {
	rdb, fa, doc, cfg := threeQuotasAgent(t)
	cfg.Lease.AcquireTimeout = time.Minute
	cfg.Lease.MaxWantsPerCall = 1 // one Acquire per quota
	cfg.ShutdownTimeout = 900 * time.Millisecond
	var (
		mu        sync.Mutex
		held      = map[string]bool{}   // request ids of the cut-short calls
		grants    = map[string]string{} // quota -> its cut-short grant
		committed = make(chan struct{}, 3)
	)
	fa.setHook(func(ctx context.Context, req *allotv1.AcquireRequest, commit func() (*allotv1.AcquireResponse, error)) (*allotv1.AcquireResponse, error) {
		mu.Lock()
		replay := held[req.RequestId]
		if !replay && len(held) < 3 {
			held[req.RequestId] = true
		} else if !replay {
			mu.Unlock()
			return commit()
		}
		mu.Unlock()
		if replay {
			select {
			case <-time.After(400 * time.Millisecond):
			case <-ctx.Done():
				return nil, ctx.Err()
			}
			return commit() // the recorded answer
		}
		resp, err := commit()
		if err != nil {
			return resp, err
		}
		mu.Lock()
		for _, g := range resp.Grants {
			grants[g.Quota] = g.GrantId
		}
		mu.Unlock()
		committed <- struct{}{}
		<-ctx.Done() // the answer never leaves before the agent stops
		return nil, ctx.Err()
	})
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1)))
	for _, ten := range []string{"a", "b", "c"} {
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_, _ = a.Check(ctx, tenant(ten)) // starts the renewal; its verdict does not matter
		}()
	}
	for range 3 {
		select {
		case <-committed:
		case <-time.After(10 * time.Second):
			t.Fatal("the agent did not ask for all three chunks")
		}
	}
	if err := a.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	released := map[string]int64{}
	for _, r := range fa.releaseLog() {
		released[r.GrantId] += r.Tokens
	}
	mu.Lock()
	defer mu.Unlock()
	for _, quota := range []string{"q-a", "q-b", "q-c"} {
		g := grants[quota]
		if held := fa.window(quota).Granted; g == "" || released[g] == 0 || released[g] != held {
			t.Errorf("%s: released %d of cut-short grant %q (%d granted): want it all handed back on shutdown", quota, released[g], g, held)
		}
	}
}
