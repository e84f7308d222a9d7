package admission_test

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"

	"github.com/allot-dev/allot/internal/redistest"
	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/policy"
)

// unreachableStore is a Redis store whose address refuses connections (one
// dial attempt, no retries): every call fails at once, so rules go to their
// fail modes.
func unreachableStore(t *testing.T) *admission.RedisStore {
	t.Helper()
	addr, err := redistest.ClosedAddr()
	if err != nil {
		t.Fatal(err)
	}
	client := redis.NewClient(&redis.Options{Addr: addr, DialTimeout: 200 * time.Millisecond, MaxRetries: -1, DialerRetries: 1})
	t.Cleanup(func() { client.Close() })
	store, err := admission.NewRedisStore(client, admission.DefaultRedisConfig())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { store.Close() })
	return store
}

// failHarness is an engine on a Redis store at addr with a fake clock.
func failHarness(t *testing.T, addr string, doc *policy.Document, mutate func(*admission.Config)) (*harness, *admission.RedisStore) {
	t.Helper()
	client := redis.NewClient(&redis.Options{
		Addr:        addr,
		DialTimeout: 200 * time.Millisecond,
		ReadTimeout: 300 * time.Millisecond,
		MaxRetries:  -1,
		// One dial attempt: a refused connection fails at once.
		DialerRetries: 1,
	})
	t.Cleanup(func() { client.Close() })
	store, err := admission.NewRedisStore(client, admission.DefaultRedisConfig())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { store.Close() })
	clock := newFakeClock(t0)
	cfg := admission.DefaultConfig()
	cfg.Namespace = namespace()
	cfg.Gateways = 2
	cfg.NegativeCacheTTL = 0
	cfg.StoreTimeout = 100 * time.Millisecond
	cfg.BreakerFailures = 3
	if mutate != nil {
		mutate(&cfg)
	}
	e, err := admission.New(cfg, store, doc, 1, admission.WithClock(clock), admission.WithLogger(zaptest.NewLogger(t)))
	if err != nil {
		t.Fatal(err)
	}
	admission.UseStoreClock(e)
	t.Cleanup(func() { e.Close() })
	return &harness{t: t, e: e, clock: clock, ns: cfg.Namespace, doc: doc, client: client}, store
}

const openPolicy = `
name: open
rules:
  - name: lenient
    scope: tenant
    match: [{key: tenant}]
    kind: token_bucket
    capacity: 1
    refill_per_second: 1
    fail_mode: open
`

// TestFailModesUnreachable points the engine at a closed port: each rule's
// declared fail mode decides, and the breaker stops the calls.
func TestFailModesUnreachable(t *testing.T) {
	addr, err := redistest.ClosedAddr()
	if err != nil {
		t.Fatal(err)
	}
	h, _ := failHarness(t, addr, northstar(t), nil)
	// Mid-window: P-GLOBAL's fallback share is spendable only the pool
	// fallback margin (250 ms) inside its 1 s windows.
	h.clock.Set(500 * time.Millisecond)

	// P-EXPORT is fail closed: 503 with a Retry-After, never an unmetered export.
	d := h.decide(export("cedar")...)
	if d.Outcome != admission.Unavailable || d.Rule != "p-export" || d.RetryAfter < 1 || d.Source != admission.SourceFailMode {
		t.Fatalf("export: %+v; want unavailable by p-export with a Retry-After", d)
	}
	if r := rule(t, d, "p-export"); r.FailMode != policy.FailClosed {
		t.Fatalf("p-export decided by %q, want closed", r.FailMode)
	}

	// P-READ and P-GLOBAL fall back to local allowances: P-READ's bucket is
	// 20 / 2 gateways = 10 at 1 token/s.
	for i := 0; i < 10; i++ {
		d := h.decide(catalog("cedar", "U-17")...)
		wantAllowed(t, d, "fallback read")
		if r := rule(t, d, "p-read"); r.FailMode != policy.FailFallback {
			t.Fatalf("p-read decided by %q, want fallback", r.FailMode)
		}
		if r := rule(t, d, "p-global"); r.FailMode != policy.FailFallback {
			t.Fatalf("p-global decided by %q, want fallback", r.FailMode)
		}
	}
	wantDenied(t, h.decide(catalog("cedar", "U-17")...), "11th fallback read", "p-read", policy.ScopeUser, 1)
	h.clock.Advance(time.Second)
	wantAllowed(t, h.decide(catalog("cedar", "U-17")...), "refilled fallback read")

	// P-ANON's fallback window: 20 / 2 = 10 per 10 s.
	for i := 0; i < 10; i++ {
		wantAllowed(t, h.decide(anon("203.0.113.7")...), "fallback anon")
	}
	if d := h.decide(anon("203.0.113.7")...); d.Allowed() || d.Rule != "p-anon" {
		t.Fatalf("11th anonymous request: %+v; want denied by p-anon's fallback", d)
	}

	s := h.e.Stats()
	if s.BreakerOpens == 0 || !h.e.BreakerOpen() {
		t.Fatalf("stats %+v: the breaker should have opened", s)
	}
	calls := s.StoreCalls
	for i := 0; i < 100; i++ {
		h.decide(export("cedar")...)
	}
	if got := h.e.Stats().StoreCalls; got != calls {
		t.Fatalf("store calls grew from %d to %d while the breaker was open", calls, got)
	}
	if s.Fallback == 0 || s.FailClosed == 0 {
		t.Fatalf("stats %+v: want fallback and closed counted", s)
	}

	// fail_mode open admits, counted.
	ho, _ := failHarness(t, addr, parse(t, openPolicy), nil)
	for i := 0; i < 5; i++ {
		d := ho.decide("tenant", "cedar")
		wantAllowed(t, d, "fail open")
		if r := rule(t, d, "lenient"); r.FailMode != policy.FailOpen {
			t.Fatalf("decided by %q, want open", r.FailMode)
		}
	}
	if got := ho.e.Stats().FailOpen; got != 5 {
		t.Fatalf("FailOpen = %d, want 5", got)
	}

	// Off the decision path the store's trouble is an error.
	if _, err := h.e.PoolStats(context.Background(), "p-global"); err == nil {
		t.Fatal("PoolStats on an unreachable store succeeded")
	}
}

// TestFallbackShareFloor: with more gateways than a fallback rule has
// requests (P-READ's 20 tokens and P-ANON's 20 a window on 25 gateways),
// each gateway's share is one request, not zero: the outage admits one
// request per key and gateway and then refuses with a Retry-After. Applying
// such a policy logs the rules whose share was raised.
func TestFallbackShareFloor(t *testing.T) {
	store := unreachableStore(t)
	core, logs := observer.New(zap.WarnLevel)
	clock := newFakeClock(t0)
	cfg := admission.DefaultConfig()
	cfg.Namespace = namespace()
	cfg.Gateways = 25
	cfg.NegativeCacheTTL = 0
	e, err := admission.New(cfg, store, northstar(t), 1, admission.WithClock(clock), admission.WithLogger(zap.New(core)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	h := &harness{t: t, e: e, clock: clock, ns: cfg.Namespace}
	clock.Set(500 * time.Millisecond) // inside P-GLOBAL's fallback span

	d := h.decide(catalog("cedar", "U-17")...)
	wantAllowed(t, d, "first read in the outage")
	if r := rule(t, d, "p-read"); r.FailMode != policy.FailFallback {
		t.Fatalf("p-read decided by %q, want fallback", r.FailMode)
	}
	// One token a gateway, refilled at 2/25 tokens/s: 12.5 s for the next.
	wantDenied(t, h.decide(catalog("cedar", "U-17")...), "second read", "p-read", policy.ScopeUser, 13)
	wantAllowed(t, h.decide(anon("203.0.113.7")...), "first anonymous request")
	if d := h.decide(anon("203.0.113.7")...); d.Allowed() || d.Rule != "p-anon" || d.RetryAfter < 1 {
		t.Fatalf("second anonymous request: %+v; want denied by p-anon's fallback with a Retry-After", d)
	}

	var floored []string
	for _, l := range logs.FilterMessageSnippet("raised to one").All() {
		for _, f := range l.Context {
			if f.Key == "rules" {
				floored = append(floored, fmt.Sprint(f.Interface))
			}
		}
	}
	if len(floored) != 1 || !strings.Contains(floored[0], "p-read") || !strings.Contains(floored[0], "p-anon") {
		t.Fatalf("warnings naming the raised rules: %v; want one naming p-read and p-anon", floored)
	}
	// P-GLOBAL's 1 s window less 250 ms at each end: its fallback answers
	// 503 half the time, which applying the policy says.
	var narrow []string
	for _, l := range logs.FilterMessageSnippet("answers 503 for over a quarter of each window").All() {
		for _, f := range l.Context {
			if f.Key == "rules" {
				narrow = append(narrow, fmt.Sprint(f.Interface))
			}
		}
	}
	if len(narrow) != 1 || !strings.Contains(narrow[0], "p-global") || strings.Contains(narrow[0], "p-read") {
		t.Fatalf("warnings naming the global quotas with a narrow fallback span: %v; want one naming p-global only", narrow)
	}
}

// TestFailModesPaused stops a real redis-server with SIGSTOP: connections
// stay open and calls hang. Decisions still return within the store timeout,
// by the fail modes; the breaker then stops calling; after SIGCONT and the
// cooldown a probe closes the breaker again.
func TestFailModesPaused(t *testing.T) {
	srv := redistest.NewServer(t)
	h, _ := failHarness(t, srv.Addr(), northstar(t), nil)
	wantAllowed(t, h.decide(export("cedar")...), "before the pause")

	if err := srv.Pause(); err != nil {
		t.Fatal(err)
	}
	resumed := false
	defer func() {
		if !resumed {
			_ = srv.Resume()
		}
	}()
	// Many concurrent callers: all answered by fail modes, none hang.
	var wg sync.WaitGroup
	for i := 0; i < 32; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			d, err := h.e.Decide(context.Background(), &admission.Request{Descriptors: entries(export("t" + itoa(i))...)})
			if err != nil {
				t.Error(err)
				return
			}
			if d.Outcome != admission.Unavailable {
				t.Errorf("paused store: %s, want unavailable (p-export fails closed)", d.Outcome)
			}
		}(i)
	}
	wg.Wait()
	if !h.e.BreakerOpen() {
		t.Fatalf("breaker closed after %d failed calls", h.e.Stats().StoreErrors)
	}
	calls := h.e.Stats().StoreCalls
	for i := 0; i < 200; i++ {
		if d := h.decide(export("cedar")...); d.Outcome != admission.Unavailable {
			t.Fatalf("breaker open: %s, want unavailable", d.Outcome)
		}
	}
	if got := h.e.Stats().StoreCalls; got != calls {
		t.Fatalf("store calls %d -> %d while the breaker was open: calls pile up", calls, got)
	}

	if err := srv.Resume(); err != nil {
		t.Fatal(err)
	}
	resumed = true
	h.clock.Advance(2 * time.Second) // past the cooldown: the next call probes
	var d *admission.Decision
	for i := 0; i < 50; i++ { // the server may need a moment to drain
		if d = h.decide(export("cedar")...); d.Source == admission.SourceStore {
			break
		}
		h.clock.Advance(2 * time.Second)
		time.Sleep(20 * time.Millisecond)
	}
	if d.Source != admission.SourceStore || h.e.BreakerOpen() {
		t.Fatalf("after resume: %+v, breaker open %v; want the store deciding again", d, h.e.BreakerOpen())
	}
}

// TestChunkWaitersTakeTheFailMode: requests that find the gateway-local
// chunk empty wait on the one take in flight. When the store fails that
// take, they take P-GLOBAL's fail mode (fallback) as the taker does. They
// used to take again one after another, and a request that had waited on
// three failed takes was denied (429, "p-global") with a quota it was never
// told about.
func TestChunkWaitersTakeTheFailMode(t *testing.T) {
	srv := redistest.NewServer(t)
	h, _ := failHarness(t, srv.Addr(), northstar(t), func(c *admission.Config) {
		c.Gateways = 1
		c.BreakerFailures = 100 // every take goes to the store and waits out its timeout
	})
	if err := srv.Pause(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = srv.Resume() }()
	// The goroutines only decide; the test goroutine asserts (rule may
	// call t.Fatalf, which must not run on another goroutine).
	var (
		wg        sync.WaitGroup
		decisions [8]*admission.Decision
		outcomes  = map[string]int{}
	)
	for i := range decisions {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			d, err := h.e.Decide(context.Background(), &admission.Request{Descriptors: entries(catalog("cedar", "U-"+itoa(i))...)})
			if err != nil {
				t.Errorf("request %d: %v", i, err)
				return
			}
			decisions[i] = d
		}(i)
	}
	wg.Wait()
	for _, d := range decisions {
		if d == nil { // its error is reported
			continue
		}
		outcomes[d.Outcome.String()+" "+d.Rule]++
		if d.Outcome == admission.Deny && d.Rule == "p-global" {
			continue
		}
		if r := rule(t, d, "p-global"); r.FailMode != policy.FailFallback {
			t.Errorf("p-global decided by %q (allowed %v), want its fallback", r.FailMode, r.Allowed)
		}
	}
	if n := outcomes["deny p-global"]; n > 0 {
		t.Fatalf("%d of 8 requests denied by p-global while the store was down (outcomes %v); want its fail mode", n, outcomes)
	}
}

// TestCallerLeavingIsNotAStoreError: a caller that leaves (its context
// canceled) while Redis is stuck is counted as canceled, neither as a store
// error nor as a fail mode's engagement, and does not open the breaker; a
// caller whose deadline passes first is a store that did not answer in
// time: the fail mode decides and is counted.
func TestCallerLeavingIsNotAStoreError(t *testing.T) {
	srv := redistest.NewServer(t)
	h, _ := failHarness(t, srv.Addr(), northstar(t), nil)
	wantAllowed(t, h.decide(export("cedar")...), "before the pause")
	if err := srv.Pause(); err != nil {
		t.Fatal(err)
	}
	defer func() { _ = srv.Resume() }()
	req := &admission.Request{Descriptors: entries(export("cedar")...)}
	before := h.e.Stats()

	// Five callers that leave after 20 ms: more than BreakerFailures (3).
	for i := 0; i < 5; i++ {
		ctx, cancel := context.WithCancel(context.Background())
		time.AfterFunc(20*time.Millisecond, cancel)
		d, err := h.e.Decide(ctx, req)
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		if d.Outcome != admission.Unavailable || d.Source != admission.SourceFailMode {
			t.Fatalf("caller left: %s from %s, want unavailable from the fail mode", d.Outcome, d.Source)
		}
	}
	s := h.e.Stats()
	if got := s.StoreCanceled - before.StoreCanceled; got != 5 {
		t.Errorf("StoreCanceled +%d, want +5", got)
	}
	if s.StoreErrors != before.StoreErrors || s.FailClosed != before.FailClosed {
		t.Errorf("callers leaving counted as failures: store errors +%d, fail closed +%d",
			s.StoreErrors-before.StoreErrors, s.FailClosed-before.FailClosed)
	}
	if h.e.BreakerOpen() {
		t.Error("callers leaving opened the breaker")
	}
	wantMetric(t, h.e, `allot_admission_store_calls_total{result="canceled"}`, float64(s.StoreCanceled))

	// A deadline shorter than StoreTimeout: the store did not answer within
	// the caller's budget.
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	d, err := h.e.Decide(ctx, req)
	cancel()
	if err != nil {
		t.Fatal(err)
	}
	if d.Outcome != admission.Unavailable {
		t.Fatalf("deadline passed: %s, want unavailable (p-export fails closed)", d.Outcome)
	}
	after := h.e.Stats()
	if after.StoreErrors != s.StoreErrors+1 || after.FailClosed != s.FailClosed+1 || after.StoreCanceled != s.StoreCanceled {
		t.Errorf("deadline passed: store errors +%d, fail closed +%d, canceled +%d; want +1, +1, +0",
			after.StoreErrors-s.StoreErrors, after.FailClosed-s.FailClosed, after.StoreCanceled-s.StoreCanceled)
	}
}

// wantMetric checks one sample of the engine's Prometheus collector.
func wantMetric(t *testing.T, e *admission.Engine, sample string, want float64) {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	if err := reg.Register(admission.MetricsOf(e)); err != nil {
		t.Fatal(err)
	}
	families, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range families {
		for _, m := range f.GetMetric() {
			name := f.GetName()
			if len(m.GetLabel()) > 0 {
				var labels []string
				for _, l := range m.GetLabel() {
					labels = append(labels, l.GetName()+`="`+l.GetValue()+`"`)
				}
				name += "{" + strings.Join(labels, ",") + "}"
			}
			if name == sample {
				if got := m.GetCounter().GetValue(); got != want {
					t.Errorf("%s = %v, want %v", sample, got, want)
				}
				return
			}
		}
	}
	t.Errorf("no sample %s", sample)
}

// TestNoScriptReload: after SCRIPT FLUSH the next call meets NOSCRIPT,
// reloads the script with EVAL and decides normally.
func TestNoScriptReload(t *testing.T) {
	srv := redistest.NewServer(t)
	h, store := failHarness(t, srv.Addr(), northstar(t), nil)
	ctx := context.Background()
	if err := store.Load(ctx); err != nil {
		t.Fatal(err)
	}
	if ok, _ := h.client.ScriptExists(ctx, admission.ScriptSHA()).Result(); len(ok) != 1 || !ok[0] {
		t.Fatal("Load did not load the script")
	}
	wantAllowed(t, h.decide(export("cedar")...), "loaded")
	if err := h.client.ScriptFlush(ctx).Err(); err != nil {
		t.Fatal(err)
	}
	d := h.decide(export("cedar")...)
	wantAllowed(t, d, "after SCRIPT FLUSH")
	if d.Source != admission.SourceStore || rule(t, d, "p-export").Remaining != 0 {
		t.Fatalf("after reload: %+v", d)
	}
	if ok, _ := h.client.ScriptExists(ctx, admission.ScriptSHA()).Result(); len(ok) != 1 || !ok[0] {
		t.Fatal("the script was not reloaded")
	}
}

// TestRedisErrorIsFailMode: a corrupt bucket and a slot set of the wrong
// type make the script fail (an error reply, WRONGTYPE); the rules' fail
// modes decide, nothing panics.
func TestRedisErrorIsFailMode(t *testing.T) {
	redistest.Require(t, shared.err)
	h, _ := failHarness(t, shared.redis.Addr(), northstar(t), nil)
	calls, err := h.e.ScriptCalls(&admission.Request{Descriptors: entries(export("cedar")...)})
	if err != nil {
		t.Fatal(err)
	}
	// Keys: idempotency, the p-export bucket, the p-export-concurrency set.
	for _, key := range calls[0].Keys[1:] {
		if err := h.client.Set(context.Background(), key, "garbage", time.Minute).Err(); err != nil {
			t.Fatal(err)
		}
		d := h.decide(export("cedar")...)
		if d.Outcome != admission.Unavailable || d.Rule != "p-export" {
			t.Fatalf("garbage at %s: %+v; want unavailable by p-export", key, d)
		}
		if err := h.client.Del(context.Background(), key).Err(); err != nil {
			t.Fatal(err)
		}
	}
	wantAllowed(t, h.decide(export("cedar")...), "after the cleanup")
}

// TestScriptRefusesShortRules: a rules argument that does not hold the
// number of rules the call names is an error reply naming it, and nothing
// is debited (a caller built from another script's layout cannot corrupt
// state).
func TestScriptRefusesShortRules(t *testing.T) {
	redistest.Require(t, shared.err)
	h, _ := failHarness(t, shared.redis.Addr(), northstar(t), nil)
	ctx := context.Background()
	calls, err := h.e.ScriptCalls(&admission.Request{Descriptors: entries(export("cedar")...)})
	if err != nil {
		t.Fatal(err)
	}
	c := calls[0]
	rules, ok := c.Args[len(c.Args)-1].(string)
	if !ok || len(rules)%38 != 0 || len(rules) == 0 {
		t.Fatalf("last argument %T of %d bytes; want the packed rules", c.Args[len(c.Args)-1], len(rules))
	}
	args := append(append([]any(nil), c.Args[:len(c.Args)-1]...), rules[:len(rules)-1])
	err = h.client.Eval(ctx, admission.ScriptSource(), c.Keys, args...).Err()
	if err == nil || !strings.Contains(err.Error(), "rules argument") {
		t.Fatalf("short rules: %v; want an error naming the rules argument", err)
	}
	if n, err := h.client.Exists(ctx, c.Keys[1:]...).Result(); err != nil || n != 0 {
		t.Fatalf("%d of the call's keys exist after the refused call (%v); want none", n, err)
	}
	wantAllowed(t, h.decide(export("cedar")...), "a whole call")
}

// TestMemoryStoreFull: a full embedded store fails calls that would create
// keys; the fail modes decide.
func TestMemoryStoreFull(t *testing.T) {
	store, err := admission.NewMemoryStore(admission.MemoryConfig{MaxKeys: 2}, nil)
	if err != nil {
		t.Fatal(err)
	}
	cfg := admission.DefaultConfig()
	e, err := admission.New(cfg, store, parse(t, openPolicy), 1)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	full := cfg.BreakerFailures + 2 // tenants that find the store full
	for i := 0; i < 2+full; i++ {
		d, err := e.Decide(ctx, &admission.Request{Descriptors: entries("tenant", "t"+itoa(i))})
		if err != nil || !d.Allowed() {
			t.Fatalf("Decide: %v %v", d, err)
		}
	}
	if store.Len() > 2 {
		t.Fatalf("store holds %d keys, cap 2", store.Len())
	}
	if got := e.Stats().FailOpen; got != uint64(full) {
		t.Fatalf("FailOpen %d, want %d (the tenants that found the store full)", got, full)
	}
	// A full store refuses new keys, not the tenants it holds: it must not
	// open the breaker and send every tenant to its fail mode.
	d, err := e.Decide(ctx, &admission.Request{Descriptors: entries("tenant", "t0")})
	if err != nil || d.Source != admission.SourceStore || rule(t, d, "lenient").FailMode != "" {
		t.Fatalf("a tenant the store holds, after %d refusals: %v %v; want decided by the store", full, d, err)
	}
	if n := e.Stats().BreakerOpens; n != 0 {
		t.Fatalf("BreakerOpens %d: a full store opened the breaker", n)
	}
}

const fallbackSlotsPolicy = `
name: fallback-slots
rules:
  - name: workers
    scope: tenant
    match: [{key: tenant}]
    kind: concurrency
    max_in_flight: 4
    slot_ttl: 30s
    fail_mode: fallback
`

// TestFallbackSlotsLapse: a slot the fallback takes while the store is down
// is a lease, as in the store. Released, it frees at once; never released (a
// crashed handler, a proxy with no completion call), it lapses after the
// rule's slot_ttl instead of holding the fallback until the process restarts.
func TestFallbackSlotsLapse(t *testing.T) {
	addr, err := redistest.ClosedAddr()
	if err != nil {
		t.Fatal(err)
	}
	h, _ := failHarness(t, addr, parse(t, fallbackSlotsPolicy), nil)
	ctx := context.Background()

	// 4 slots on 2 gateways: 2 here.
	first := h.decide("tenant", "cedar")
	wantAllowed(t, first, "first slot")
	if r := rule(t, first, "workers"); r.FailMode != policy.FailFallback || !first.HasSlots() {
		t.Fatalf("first slot: %+v; want a fallback slot held", first)
	}
	second := h.decide("tenant", "cedar")
	wantAllowed(t, second, "second slot")
	if d := h.decide("tenant", "cedar"); d.Allowed() || d.Rule != "workers" {
		t.Fatalf("third slot: %+v; want denied by workers' fallback", d)
	}

	// A release frees its slot at once, and only once.
	for i := 0; i < 2; i++ {
		if err := h.e.Release(ctx, first); err != nil {
			t.Fatalf("release %d: %v", i, err)
		}
	}
	wantAllowed(t, h.decide("tenant", "cedar"), "slot after a release")
	if d := h.decide("tenant", "cedar"); d.Allowed() {
		t.Fatalf("a second release freed another slot: %+v", d)
	}

	// Never released, the two held slots lapse after slot_ttl.
	h.clock.Advance(29 * time.Second)
	if d := h.decide("tenant", "cedar"); d.Allowed() {
		t.Fatalf("before slot_ttl: %+v; want still denied", d)
	}
	h.clock.Advance(2 * time.Second)
	a := h.decide("tenant", "cedar")
	wantAllowed(t, a, "after slot_ttl")
	wantAllowed(t, h.decide("tenant", "cedar"), "second after slot_ttl")
	if d := h.decide("tenant", "cedar"); d.Allowed() {
		t.Fatalf("third after slot_ttl: %+v; want denied", d)
	}
	// Releasing a lapsed slot's decision frees nothing of the new ones.
	if err := h.e.Release(ctx, second); err != nil {
		t.Fatal(err)
	}
	if d := h.decide("tenant", "cedar"); d.Allowed() {
		t.Fatalf("releasing a lapsed decision freed a live slot: %+v", d)
	}
	if err := h.e.Release(ctx, a); err != nil {
		t.Fatal(err)
	}
	wantAllowed(t, h.decide("tenant", "cedar"), "after releasing a live slot")
}

const tinyChunkPolicy = `
name: tiny-chunks
regions: [eu]
rules:
  - name: fleet
    scope: global
    match: [{key: route, value: GET /catalog}]
    kind: global_quota
    limit: 100000
    window: 1h
    lease: {chunk: 1000, ttl: 1h, gateway_chunk: 1}
`

// TestChunkContentionDeniesNone: many requests race for a gateway-local
// chunk of one token while the regional pool holds plenty. Each take serves
// the request that made it, and a request that lost the race to others'
// takes waits for the next: none is denied while the pool has tokens. (A
// request used to give up with a 429 after three lost races.)
func TestChunkContentionDeniesNone(t *testing.T) {
	h := newHarness(t, redisBackend("redis", standaloneClient), parse(t, tinyChunkPolicy), nil)
	if _, err := h.e.DepositChunk(context.Background(), "fleet", "g1", 1000, time.Hour); err != nil {
		t.Fatal(err)
	}
	const n = 64
	var (
		wg     sync.WaitGroup
		mu     sync.Mutex
		denied []string
	)
	for i := 0; i < n; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			d, err := h.e.Decide(context.Background(), &admission.Request{Descriptors: entries("route", "GET /catalog")})
			if err != nil {
				t.Error(err)
				return
			}
			if !d.Allowed() {
				mu.Lock()
				denied = append(denied, fmt.Sprintf("%s by %s (retry %d)", d.Outcome, d.Rule, d.RetryAfter))
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	if len(denied) > 0 {
		t.Fatalf("%d of %d requests not admitted with 1,000 tokens in the pool: %v", len(denied), n, denied)
	}
	st, err := h.e.PoolStats(context.Background(), "fleet")
	if err != nil {
		t.Fatal(err)
	}
	if st.Available != 1000-n {
		t.Fatalf("pool %+v: want %d left (one take per request, nothing stranded)", st, 1000-n)
	}
}

const lateSlotPolicy = `
name: late-slot
rules:
  - name: exports
    scope: tenant
    match: [{key: tenant}]
    kind: concurrency
    max_in_flight: 1
    slot_ttl: 1h
    fail_mode: closed
`

// TestLateDecideReleasesItsSlot: a decide that times out while Redis is
// paused is answered by the fail mode (503), and lands when Redis resumes,
// taking a slot nobody holds. The engine releases it: a second later the
// rule admits again, instead of denying for the hour of its slot_ttl.
func TestLateDecideReleasesItsSlot(t *testing.T) {
	srv := redistest.NewServer(t)
	h, _ := failHarness(t, srv.Addr(), parse(t, lateSlotPolicy), func(c *admission.Config) { c.BreakerFailures = 100 })
	if err := srv.Pause(); err != nil {
		t.Fatal(err)
	}
	d := h.decide("tenant", "cedar")
	if err := srv.Resume(); err != nil {
		t.Fatal(err)
	}
	if d.Outcome != admission.Unavailable {
		t.Fatalf("decide with Redis paused: %+v; want unavailable (fail closed)", d)
	}
	// The late decide has landed once a later call is answered (one
	// connection, in order); its slot makes the rule deny now.
	deadline := time.Now().Add(5 * time.Second)
	sawDeny := false
	for {
		d := h.decide("tenant", "cedar")
		if d.Allowed() {
			if err := h.e.Release(context.Background(), d); err != nil {
				t.Fatal(err)
			}
			break
		}
		if d.Outcome == admission.Deny {
			sawDeny = true
		}
		if time.Now().After(deadline) {
			t.Fatalf("5 s after the late decide the rule still denies (%+v): its slot was never released", d)
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Logf("the late decide's slot was seen held: %v", sawDeny)
}

// TestAbandonedCallsAreNotSent: while Redis is paused, decides whose callers
// got their fail mode's answer (503) and that still waited in the batcher
// are dropped, not sent when Redis resumes: only the calls already on the
// wire (at most MaxPipelines x BatchSize) are charged, and only those
// schedule the release of the slots a late decide may take. The others used
// to be sent after the pause and charged as well: 20 requests answered 503
// emptied a window of 20.
func TestAbandonedCallsAreNotSent(t *testing.T) {
	srv := redistest.NewServer(t)
	client := redis.NewClient(&redis.Options{Addr: srv.Addr(), ContextTimeoutEnabled: true, MaxRetries: -1})
	t.Cleanup(func() { client.Close() })
	rcfg := admission.DefaultRedisConfig()
	rcfg.MaxPipelines, rcfg.BatchSize = 2, 4
	rcfg.PipelineTimeout = 10 * time.Second // the pause ends first: what was sent runs then
	store, err := admission.NewRedisStore(client, rcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { store.Close() })
	const limit = 20
	doc := parse(t, `
name: abandoned
rules:
  - {name: win, scope: tenant, match: [{key: tenant}], kind: fixed_window, limit: 20, window: 1h, fail_mode: closed}
  - {name: slots, scope: tenant, match: [{key: tenant}], kind: concurrency, max_in_flight: 100, slot_ttl: 1h, fail_mode: closed}
`)
	cfg := admission.DefaultConfig()
	cfg.Namespace = namespace()
	cfg.NegativeCacheTTL = 0
	cfg.StoreTimeout = 50 * time.Millisecond
	cfg.BreakerFailures = 1000 // every decide goes to the store
	clock := newFakeClock(t0)
	e, err := admission.New(cfg, store, doc, 1, admission.WithClock(clock), admission.WithLogger(zaptest.NewLogger(t)))
	if err != nil {
		t.Fatal(err)
	}
	admission.UseStoreClock(e)
	t.Cleanup(func() { e.Close() })
	if err := store.Load(context.Background()); err != nil {
		t.Fatal(err)
	}
	h := &harness{t: t, e: e, clock: clock, ns: cfg.Namespace, doc: doc, client: client}

	if err := srv.Pause(); err != nil {
		t.Fatal(err)
	}
	resumed := false
	defer func() {
		if !resumed {
			_ = srv.Resume()
		}
	}()
	for i := 0; i < limit; i++ {
		if d := h.decide("tenant", "acme"); d.Outcome != admission.Unavailable {
			t.Fatalf("decide %d with Redis paused: %s, want unavailable (fail closed)", i, d.Outcome)
		}
	}
	onWire := rcfg.MaxPipelines * rcfg.BatchSize
	if n := admission.LateReleases(e); n > int64(onWire) {
		t.Errorf("%d late-slot releases scheduled; want at most %d (the calls that were sent)", n, onWire)
	}
	if err := srv.Resume(); err != nil {
		t.Fatal(err)
	}
	resumed = true

	// The calls that were sent run first (one connection each, in order).
	var d *admission.Decision
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if d = h.decide("tenant", "acme"); d.Source == admission.SourceStore || time.Now().After(deadline) {
			break
		}
	}
	wantAllowed(t, d, "the first request after the pause")
	charged := limit - 1 - rule(t, d, "win").Remaining
	t.Logf("%d of %d requests answered 503 were charged (%d late-slot releases)", charged, limit, admission.LateReleases(e))
	if charged > int64(onWire) {
		t.Fatalf("%d requests answered 503 were charged; want at most the %d that can have been on the wire", charged, onWire)
	}
}

// TestBreakerRefusalSchedulesNoLateRelease: a decide the open breaker
// refused was never sent, so it can take no slot: no late release is
// scheduled for it (each used to start a goroutine making three useless
// store calls over a minute, and the 1,024 allowed at once then left no
// room for a decide that really was sent).
func TestBreakerRefusalSchedulesNoLateRelease(t *testing.T) {
	addr, err := redistest.ClosedAddr()
	if err != nil {
		t.Fatal(err)
	}
	h, _ := failHarness(t, addr, parse(t, `
name: refused
rules:
  - {name: c, scope: tenant, match: [{key: tenant}], kind: concurrency, max_in_flight: 5, slot_ttl: 10m, fail_mode: open}
`), func(c *admission.Config) { c.BreakerCooldown = time.Hour })
	for i := 0; i < 5; i++ { // connection refused (unsent): opens the breaker
		h.decide("tenant", "acme")
	}
	if !h.e.BreakerOpen() {
		t.Fatal("the breaker did not open")
	}
	calls := h.e.Stats().StoreCalls
	for i := 0; i < 500; i++ {
		if d := h.decide("tenant", "acme"); d.Source != admission.SourceFailMode {
			t.Fatalf("breaker open: source %s, want the fail mode", d.Source)
		}
	}
	if n := admission.LateReleases(h.e); n != 0 {
		t.Fatalf("%d late-slot releases scheduled for decides the breaker refused; want none", n)
	}
	if got := h.e.Stats().StoreCalls; got != calls {
		t.Fatalf("store calls %d -> %d with the breaker open", calls, got)
	}
}
