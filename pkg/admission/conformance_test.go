package admission_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/policy"
)

// The conformance suite: every case runs on the embedded store, on a real
// redis-server and on a real 3-master Redis Cluster, with one fake clock
// driving the engine and the store. The worked examples are the reference
// design's (chapters 4, 7, 9, 10, 12, 13).
var conformance = []struct {
	name string
	run  func(t *testing.T, b backend)
}{
	{"token bucket P-READ burst, refill, cap", testTokenBucket},
	{"export Retry-After 4 s", testExportRetry},
	{"fixed window boundary burst", testFixedWindowBurst},
	{"sliding window 18.5 estimate", testSlidingEstimate},
	{"sliding window refuses the boundary burst", testSlidingBoundary},
	{"concurrency: fourth export denied while rate tokens remain", testConcurrency},
	{"concurrency: expired slots are dropped, renew, release", testSlotLeases},
	{"concurrency: release by request id", testReleaseRequest},
	{"hierarchy: all or nothing", testHierarchy},
	{"leased pool: earliest expiry first, expired never spends", testPool},
	{"leased pool: a pre-grant spends only from its start", testPregrant},
	{"leased pool: exhausted pool retry", testPoolExhausted},
	{"quota template: one pool per tenant, in the tenant's slot", testTemplatePools},
	{"gateway-local chunk: refunded when a tenant rule denies", testLocalChunkRefund},
	{"shadow rules: own keys, would_deny", testShadow},
	{"idempotency: replay returns the earlier decision", testIdempotency},
	{"atomicity: one winner for the last token", testAtomicity},
	{"tenants are isolated", testTenantIsolation},
	{"rules under two tags: refund on denial", testCrossTagRefund},
	{"refund: a shadow rule that denied is not given back", testRefundSkipsShadow},
	{"refund: the undone decision leaves no record to replay", testRefundDropsRecord},
	{"idempotency: a replay holds no slot of its own", testReplayHoldsNoSlot},
	{"idempotency: a replay recorded under a larger policy", testReplayOfALargerPolicy},
	{"policy versions", testApply},
	{"key layout: tags and hashed principals", testKeyLayout},
	{"numbers beyond 32 bits", testLargeNumbers},
	{"windows: a retuned length starts a fresh window", testWindowRetune},
	{"windows: a clock two windows back keeps counting", testWindowClockBack},
	{"idempotency: a retry passes the negative cache", testRetryPassesNegativeCache},
	{"idempotency: a retry passes a starved gateway-local chunk", testRetryPassesStarvedChunk},
	{"refund: a slot the request held before stays held", testRefundKeepsHeldSlot},
}

// testLargeNumbers: counts and retry times beyond 32 bits come back exact
// (the script's reply then carries doubles instead of 32-bit integers).
func testLargeNumbers(t *testing.T, b backend) {
	h := newHarness(t, b, parse(t, `
name: large
rules:
  - {name: big, scope: tenant, match: [{key: tenant}], kind: fixed_window, limit: 5000000000, window: 1m}
`), nil)
	for i := int64(1); i <= 2; i++ {
		d := h.decide("tenant", "atlas")
		wantAllowed(t, d, "a request under a 5e9 limit")
		if got, want := rule(t, d, "big").Remaining, 5_000_000_000-i; got != want {
			t.Fatalf("request %d: remaining %d, want %d", i, got, want)
		}
	}
}

func TestConformance(t *testing.T) {
	for _, b := range backends() {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			for _, tc := range conformance {
				t.Run(tc.name, func(t *testing.T) { tc.run(t, b) })
			}
		})
	}
}

// testTokenBucket is reference chapter 7's P-READ table: capacity 20, refill
// 2/s, cost 1.
func testTokenBucket(t *testing.T, b backend) {
	h := newHarness(t, b, northstar(t), nil)
	h.fund("p-global", 1_000_000)
	for i := 0; i < 20; i++ {
		d := h.decide(catalog("cedar", "U-17")...)
		wantAllowed(t, d, "burst")
		if got, want := rule(t, d, "p-read").Remaining, int64(19-i); got != want {
			t.Fatalf("request %d: p-read remaining %d, want %d", i+1, got, want)
		}
	}
	// The 21st: need 1 token at 2 tokens/s -> retryAfter = ceil(1/2) = 1 s.
	wantDenied(t, h.decide(catalog("cedar", "U-17")...), "21st", "p-read", policy.ScopeUser, 1)

	// 5 s later: 0 + 2 x 5 = 10 tokens.
	h.clock.Advance(5 * time.Second)
	for i := 0; i < 10; i++ {
		wantAllowed(t, h.decide(catalog("cedar", "U-17")...), "after 5 s")
	}
	wantDenied(t, h.decide(catalog("cedar", "U-17")...), "11th after 5 s", "p-read", policy.ScopeUser, 1)

	// 300 ms at 2 tokens/s is 600 millitokens: not yet a token; 200 ms
	// more makes 1000 millitokens exactly.
	h.clock.Advance(300 * time.Millisecond)
	wantDenied(t, h.decide(catalog("cedar", "U-17")...), "after 300 ms", "p-read", policy.ScopeUser, 1)
	h.clock.Advance(200 * time.Millisecond)
	wantAllowed(t, h.decide(catalog("cedar", "U-17")...), "after 500 ms")

	// Long idle: capped at capacity 20.
	h.clock.Advance(100 * time.Second)
	d := h.decide(catalog("cedar", "U-17")...)
	if got := rule(t, d, "p-read").Remaining; got != 19 {
		t.Fatalf("after idle: remaining %d, want 19 (capped at 20)", got)
	}
	// RateLimit header values: q=20, w=10 (20 tokens at 2/s), t = 1 s to refill
	// the one token spent.
	r := rule(t, d, "p-read")
	if r.Quota != 20 || r.Window != 10 || r.Reset != 1 {
		t.Fatalf("p-read advertised q=%d w=%d t=%d, want 20, 10, 1", r.Quota, r.Window, r.Reset)
	}

	// No refill for negative time: a clock that goes back adds nothing.
	h.clock.Advance(-50 * time.Second)
	d = h.decide(catalog("cedar", "U-17")...)
	if got := rule(t, d, "p-read").Remaining; got != 18 {
		t.Fatalf("after the clock went back: remaining %d, want 18", got)
	}
}

// testExportRetry is chapter 7's worked example: a bucket shaped like
// P-READ's holding 3 tokens, an export costing 10: deficit 7 at 2/s = 3.5 s,
// rounded up to Retry-After 4.
func testExportRetry(t *testing.T, b backend) {
	h := newHarness(t, b, northstar(t), nil)
	d := h.decide(export("cedar")...)
	wantAllowed(t, d, "export 1")
	if got := rule(t, d, "p-export").Remaining; got != 10 {
		t.Fatalf("weighted cost: remaining %d after one export, want 10 (20 - 10)", got)
	}
	wantAllowed(t, h.decide(export("cedar")...), "export 2")
	h.clock.Advance(1500 * time.Millisecond) // 0 + 2 x 1.5 = 3 tokens
	d = h.decide(export("cedar")...)
	wantDenied(t, d, "export 3", "p-export", policy.ScopeTenant, 4)
	if got := rule(t, d, "p-export").Remaining; got != 3 {
		t.Fatalf("bucket holds %d, want 3", got)
	}
	// A read costs 1 and is a different rule: unaffected.
	h.fund("p-global", 100)
	wantAllowed(t, h.decide(catalog("cedar", "U-1")...), "read beside exports")
}

// testFixedWindowBurst is chapter 4's table: P-ANON, 20 per 10 s in windows
// aligned to epoch multiples of 10 s. 20 at 9.9 s and 20 at 10.1 s: forty
// admissions in 0.2 s, twice the stated limit, with no bug anywhere.
func testFixedWindowBurst(t *testing.T, b backend) {
	h := newHarness(t, b, northstar(t), nil)
	h.clock.Set(9900 * time.Millisecond)
	for i := 0; i < 20; i++ {
		wantAllowed(t, h.decide(anon("203.0.113.7")...), "window 1")
	}
	d := h.decide(anon("203.0.113.7")...)
	wantDenied(t, d, "21st in window 1", "p-anon", policy.ScopeIP, 1) // 100 ms to the boundary, rounded up
	h.clock.Set(10100 * time.Millisecond)
	for i := 0; i < 20; i++ {
		wantAllowed(t, h.decide(anon("203.0.113.7")...), "window 2")
	}
	// 40 admitted in 0.2 s, twice the limit: the fixed window's flaw.
	wantDenied(t, h.decide(anon("203.0.113.7")...), "21st in window 2", "p-anon", policy.ScopeIP, 10)
	// Another address has its own counter.
	wantAllowed(t, h.decide(anon("198.51.100.1")...), "other address")
}

const slidingPolicy = `
name: sliding
rules:
  - name: strict
    scope: user
    match: [{key: tenant}, {key: user}]
    kind: sliding_window
    limit: 20
    window: 10s
`

// testSlidingEstimate is chapter 7's example: W = 10 s, prev = 18, curr = 5,
// elapsed 2.5 s: 18 x 0.75 + 5 = 18.5, so one more gives 19.5 <= 20 and is
// allowed.
func testSlidingEstimate(t *testing.T, b backend) {
	h := newHarness(t, b, parse(t, slidingPolicy), nil)
	req := []string{"tenant", "cedar", "user", "U-17"}
	h.clock.Set(time.Second)
	for i := 0; i < 18; i++ {
		wantAllowed(t, h.decide(req...), "previous window")
	}
	h.clock.Set(12500 * time.Millisecond)
	for i := 0; i < 5; i++ {
		wantAllowed(t, h.decide(req...), "current window")
	}
	// Estimate now 18 x 0.75 + 5 = 18.5; one more -> 19.5 <= 20.
	d := h.decide(req...)
	wantAllowed(t, d, "the 19.5 request")
	if got := rule(t, d, "strict").Remaining; got != 0 {
		t.Fatalf("remaining %d, want floor(20 - 19.5) = 0", got)
	}
	// 18 x 0.75 + 6 + 1 = 20.5 > 20: denied; the weight of the previous
	// window must fall to 13: 18 x (1 - e/10) <= 13 at e >= 2.78 s, 278 ms
	// from now, rounded up to 1 s.
	wantDenied(t, h.decide(req...), "the 20.5 request", "strict", policy.ScopeUser, 1)
	h.clock.Set(12778 * time.Millisecond)
	wantAllowed(t, h.decide(req...), "after the previous window decayed")
}

// testSlidingBoundary: the fixed window's boundary burst against a sliding
// counter: 20 at 9.9 s, then at 10.1 s the estimate is
// 20 x (1 - 0.1/10) + 0 = 19.8, so the second burst is refused outright.
func testSlidingBoundary(t *testing.T, b backend) {
	h := newHarness(t, b, parse(t, slidingPolicy), nil)
	req := []string{"tenant", "cedar", "user", "U-17"}
	h.clock.Set(9900 * time.Millisecond)
	for i := 0; i < 20; i++ {
		wantAllowed(t, h.decide(req...), "first burst")
	}
	h.clock.Set(10100 * time.Millisecond)
	d := h.decide(req...)
	if d.Allowed() {
		t.Fatal("second burst admitted; the sliding estimate 19.8 + 1 > 20 must refuse it")
	}
	if got := rule(t, d, "strict").Remaining; got != 0 {
		t.Fatalf("remaining %d, want floor(20 - 19.8) = 0", got)
	}
}

// testConcurrency is chapter 10: P-EXPORT costs 10 of a 20-token bucket
// refilled at 2/s, and at most 3 exports run at once per tenant. Three
// exports started 5 s apart run together; the fourth is denied by the
// concurrency rule while rate tokens remain, and the denial spends nothing.
func testConcurrency(t *testing.T, b backend) {
	h := newHarness(t, b, northstar(t), nil)
	var running []*admission.Decision
	for i := 0; i < 3; i++ {
		d := h.decide(export("cedar")...)
		wantAllowed(t, d, "export")
		if !d.HasSlots() {
			t.Fatal("an admitted export holds no slot")
		}
		running = append(running, d)
		h.clock.Advance(5 * time.Second)
	}
	d := h.decide(export("cedar")...)
	wantDenied(t, d, "fourth export", "p-export-concurrency", policy.ScopeTenant, 1)
	rate := rule(t, d, "p-export")
	if !rate.Allowed || rate.Remaining < 10 {
		t.Fatalf("p-export: allowed %v remaining %d; want rate tokens left (>= 10)", rate.Allowed, rate.Remaining)
	}
	// Release one export: the fourth now runs, and the bucket shows that the
	// denied attempt spent nothing (20 - 10 = 10).
	if err := h.e.Release(context.Background(), running[0]); err != nil {
		t.Fatal(err)
	}
	if err := h.e.Release(context.Background(), running[0]); err != nil { // idempotent
		t.Fatal(err)
	}
	d = h.decide(export("cedar")...)
	wantAllowed(t, d, "fourth export after a release")
	if got := rule(t, d, "p-export").Remaining; got != 10 {
		t.Fatalf("p-export remaining %d, want 10: the denied attempt must not have been charged", got)
	}
	if got := rule(t, d, "p-export-concurrency").Remaining; got != 0 {
		t.Fatalf("slots remaining %d, want 0", got)
	}
	// Another tenant has its own slots.
	wantAllowed(t, h.decide(export("dune")...), "another tenant's export")
}

// testSlotLeases: a slot whose worker crashed expires after slot_ttl and is
// dropped by the next acquire; Renew keeps a slot alive; renewing an expired
// slot reports ErrSlotLost.
func testSlotLeases(t *testing.T, b backend) {
	h := newHarness(t, b, northstar(t), nil)
	ctx := context.Background()
	var ds []*admission.Decision
	for i := 0; i < 3; i++ {
		d := h.decide(export("cedar")...)
		wantAllowed(t, d, "export")
		ds = append(ds, d)
		h.clock.Advance(5 * time.Second)
	}
	// At 9 minutes renew the last export: it now lives to 19 min.
	h.clock.Advance(9*time.Minute - 15*time.Second)
	if err := h.e.Renew(ctx, ds[2]); err != nil {
		t.Fatalf("Renew: %v", err)
	}
	// At 10 min 30 s the first two have expired (never released).
	h.clock.Advance(90 * time.Second)
	if err := h.e.Renew(ctx, ds[0]); !errors.Is(err, admission.ErrSlotLost) {
		t.Fatalf("Renew of an expired slot: %v, want ErrSlotLost", err)
	}
	d := h.decide(export("cedar")...)
	wantAllowed(t, d, "export after expiry")
	if got := rule(t, d, "p-export-concurrency").Remaining; got != 1 {
		t.Fatalf("slots remaining %d, want 1 (renewed one + this one held)", got)
	}
}

// testHierarchy is chapter 9's table for Atlas: P-TENANT (leased pool),
// U-17's P-READ bucket, and P-GLOBAL. All must admit; a denial debits none.
func testHierarchy(t *testing.T, b backend) {
	h := newHarness(t, b, northstar(t), nil)
	h.fund("p-global", 1_000_000)
	// U-17 spends 8 of 20 while Atlas's pool has 10: 12 left.
	h.fund("p-tenant-atlas", 10)
	for i := 0; i < 8; i++ {
		wantAllowed(t, h.decide(catalog("atlas", "U-17")...), "setup")
	}
	// U-99 spends the rest of Atlas's pool.
	wantAllowed(t, h.decide(catalog("atlas", "U-99")...), "setup")
	wantAllowed(t, h.decide(catalog("atlas", "U-99")...), "setup")

	// Case 1: tenant exhausted, U-17 has 12: denied by the tenant rule, and
	// U-17's 12 tokens are untouched.
	d := h.decide(catalog("atlas", "U-17")...)
	wantDenied(t, d, "case 1", "p-tenant-atlas", policy.ScopeTenant, 1)
	if got := rule(t, d, "p-read").Remaining; got != 11 { // would be 11 after this request
		t.Fatalf("case 1: p-read would leave %d, want 11", got)
	}

	// Case 3 setup: 500 in the pool.
	h.fund("p-tenant-atlas", 500)
	d = h.decide(catalog("atlas", "U-17")...)
	wantAllowed(t, d, "case 3")
	if got := rule(t, d, "p-read").Remaining; got != 11 {
		t.Fatalf("case 3: U-17 has %d, want 11 (12 - 1: case 1 charged nothing)", got)
	}
	if got := rule(t, d, "p-tenant-atlas").Remaining; got != 499 {
		t.Fatalf("case 3: pool has %d, want 499", got)
	}

	// Case 2: U-17 empties its bucket; the tenant is then not charged.
	for i := 0; i < 11; i++ {
		wantAllowed(t, h.decide(catalog("atlas", "U-17")...), "drain U-17")
	}
	before := h.stats("p-tenant-atlas")
	d = h.decide(catalog("atlas", "U-17")...)
	wantDenied(t, d, "case 2", "p-read", policy.ScopeUser, 1)
	after := h.stats("p-tenant-atlas")
	if after.Available != before.Available || after.Consumed != before.Consumed {
		t.Fatalf("case 2: pool %+v -> %+v; a denied request must charge nothing", before, after)
	}
	if before.Available != 488 {
		t.Fatalf("pool available %d, want 488", before.Available)
	}
}

// quotaPolicy has one tenant-scoped leased pool of cost 1.
const quotaPolicy = `
name: quota
regions: [eu]
rules:
  - name: q-acme
    scope: tenant
    match: [{key: tenant, value: acme}]
    kind: global_quota
    limit: 1000
    window: 1m
    lease: {chunk: 500, ttl: 1m}
`

// testPool: grants keep their own expiries; spending takes the
// earliest-expiring first; expired tokens never spend and are counted.
func testPool(t *testing.T, b backend) {
	h := newHarness(t, b, parse(t, quotaPolicy), nil)
	ctx := context.Background()
	req := []string{"tenant", "acme"}
	wantDenied(t, h.decide(req...), "empty pool", "q-acme", policy.ScopeTenant, 1)

	for _, g := range []struct {
		id     string
		tokens int64
		ttl    time.Duration
	}{{"late", 100, 10 * time.Second}, {"early", 100, 5 * time.Second}} {
		ok, err := h.e.DepositChunk(ctx, "q-acme", g.id, g.tokens, g.ttl)
		if err != nil || !ok {
			t.Fatalf("deposit %s: %v %v", g.id, ok, err)
		}
	}
	if ok, err := h.e.DepositChunk(ctx, "q-acme", "early", 100, 5*time.Second); err != nil || ok {
		t.Fatalf("duplicate deposit: added %v, err %v; want not added", ok, err)
	}
	for i := 0; i < 30; i++ {
		wantAllowed(t, h.decide(req...), "spend")
	}
	s := h.stats("q-acme")
	if s.Available != 170 || s.Consumed != 30 || s.Deposited != 200 || s.Chunks != 2 || s.Starved != 1 {
		t.Fatalf("stats %+v; want available 170, consumed 30, deposited 200, 2 chunks, starved 1", s)
	}
	// At 6 s the early grant (70 left) expires; the late one was untouched.
	h.clock.Advance(6 * time.Second)
	s = h.stats("q-acme")
	if s.Available != 100 || s.Expired != 70 || s.Chunks != 1 {
		t.Fatalf("after the early expiry %+v; want available 100 (late untouched), expired 70", s)
	}
	// At 10 s exactly the late grant expires: nothing spends.
	h.clock.Advance(4 * time.Second)
	wantDenied(t, h.decide(req...), "all expired", "q-acme", policy.ScopeTenant, 1)
	if s := h.stats("q-acme"); s.Available != 0 || s.Expired != 170 {
		t.Fatalf("stats %+v; want nothing available, 170 expired", s)
	}
	// Bad grants.
	for _, tc := range []struct {
		quota, id string
		tokens    int64
		ttl       time.Duration
		want      error
	}{
		{"nope", "g", 1, time.Second, admission.ErrUnknownQuota},
		{"q-acme", "", 1, time.Second, admission.ErrBadGrant},
		{"q-acme", "g", 0, time.Second, admission.ErrBadGrant},
		{"q-acme", "g", -5, time.Second, admission.ErrBadGrant},
		{"q-acme", "g", 1, 0, admission.ErrBadGrant},
		{"q-acme", "g", 1, 48 * time.Hour, admission.ErrBadGrant},
		{"q-acme", strings.Repeat("g", 200), 1, time.Second, admission.ErrBadGrant},
	} {
		if _, err := h.e.DepositChunk(ctx, tc.quota, tc.id, tc.tokens, tc.ttl); !errors.Is(err, tc.want) {
			t.Errorf("DepositChunk(%q, %q, %d, %s) = %v, want %v", tc.quota, tc.id, tc.tokens, tc.ttl, err, tc.want)
		}
	}
}

// testPregrant: a pre-grant (tokens of the next window) is held but neither
// spends nor counts as available before its start; it leaves the current
// window's exhausted mark alone; from its start it spends like any chunk;
// one that expires without ever opening is counted as expired.
func testPregrant(t *testing.T, b backend) {
	h := newHarness(t, b, parse(t, quotaPolicy), nil)
	ctx := context.Background()
	req := []string{"tenant", "acme"}
	if ok, err := h.e.DepositChunk(ctx, "q-acme", "cur", 2, time.Minute); err != nil || !ok {
		t.Fatalf("deposit cur: %v %v", ok, err)
	}
	if err := h.e.MarkExhausted(ctx, "q-acme", 2*time.Second); err != nil {
		t.Fatal(err)
	}
	if ok, err := h.e.DepositPregrant(ctx, "q-acme", "next", 100, 2*time.Second, 10*time.Second); err != nil || !ok {
		t.Fatalf("deposit next: %v %v", ok, err)
	}
	if ok, err := h.e.DepositPregrant(ctx, "q-acme", "next", 100, 2*time.Second, 10*time.Second); err != nil || ok {
		t.Fatalf("duplicate pre-grant: added %v, err %v; want not added", ok, err)
	}
	if ok, err := h.e.DepositPregrant(ctx, "q-acme", "never", 7, time.Second, 1500*time.Millisecond); err != nil || !ok {
		t.Fatalf("deposit never: %v %v", ok, err)
	}
	wantAllowed(t, h.decide(req...), "spend cur")
	wantAllowed(t, h.decide(req...), "spend cur")
	wantDenied(t, h.decide(req...), "only pre-grants left (retry: the exhausted mark)", "q-acme", policy.ScopeTenant, 2)
	s := h.stats("q-acme")
	if s.Available != 0 || s.Pending != 107 || s.Chunks != 1 || s.Deposited != 109 || s.Exhausted <= 0 {
		t.Fatalf("before the start %+v; want 0 available, 107 pending, 1 chunk, still exhausted", s)
	}
	// At 2 s "never" has expired unopened (nothing loaded the pool since it
	// opened at 1 s) and "next" opens.
	h.clock.Advance(2 * time.Second)
	wantAllowed(t, h.decide(req...), "spend next at its start")
	s = h.stats("q-acme")
	if s.Available != 99 || s.Pending != 0 || s.Chunks != 2 || s.Expired != 7 {
		t.Fatalf("after the start %+v; want 99 available, none pending, 2 chunks, 7 expired", s)
	}
	for _, tc := range []struct{ start, ttl time.Duration }{{0, time.Second}, {time.Second, time.Second}, {2 * time.Second, time.Second}} {
		if _, err := h.e.DepositPregrant(ctx, "q-acme", "bad", 1, tc.start, tc.ttl); !errors.Is(err, admission.ErrBadGrant) {
			t.Errorf("DepositPregrant(start %s, ttl %s) = %v, want ErrBadGrant", tc.start, tc.ttl, err)
		}
	}
}

// templatePolicy gives every tenant a leased pool of its own (a template)
// beside a per-tenant token bucket, and Acme a fixed pool too.
const templatePolicy = `
name: plans
regions: [eu]
rules:
  - name: plan
    scope: tenant
    match: [{key: tenant}]
    kind: global_quota
    limit: 1000
    window: 1m
    lease: {chunk: 500, ttl: 1m}
  - name: q-acme
    scope: tenant
    match: [{key: tenant, value: acme}]
    kind: global_quota
    limit: 1000
    window: 1m
    lease: {chunk: 500, ttl: 1m}
  - name: burst
    scope: tenant
    match: [{key: tenant}]
    kind: token_bucket
    capacity: 100
    refill_per_second: 1
`

// testTemplatePools: a template's instances are pools of their own, named
// by policy.InstanceName, keyed under the tenant's hash tag (one script
// call with the tenant's other rules, even on a cluster); a tenant matching
// the template and a fixed rule is charged to both; an instance whose name
// had to be hashed keeps its pool under a tag of its own.
func testTemplatePools(t *testing.T, b backend) {
	h := newHarness(t, b, parse(t, templatePolicy), nil)
	ctx := context.Background()
	birch := policy.InstanceName("plan", []string{"birch"})
	d := h.decide("tenant", "birch")
	wantDenied(t, d, "empty instance", "plan", policy.ScopeTenant, 1)
	if r := rule(t, d, "plan"); r.Pool != birch {
		t.Fatalf("denied by pool %q, want %q", r.Pool, birch)
	}
	h.fund(birch, 2)
	wantAllowed(t, h.decide("tenant", "birch"), "birch's own pool")
	wantAllowed(t, h.decide("tenant", "birch"), "birch's own pool")
	wantDenied(t, h.decide("tenant", "birch"), "birch's pool spent", "plan", policy.ScopeTenant, 1)
	wantDenied(t, h.decide("tenant", "cedar"), "cedar's pool is not birch's", "plan", policy.ScopeTenant, 1)
	if s := h.stats(birch); s.Consumed != 2 || s.Starved != 2 {
		t.Fatalf("birch's pool %+v, want 2 consumed, 2 starved (empty, then spent)", s)
	}

	// Acme matches the template and its own pool: both must allow.
	h.fund("plan/acme", 10)
	d = h.decide("tenant", "acme")
	wantDenied(t, d, "acme without its fixed pool", "q-acme", policy.ScopeTenant, 1)
	h.fund("q-acme", 10)
	d = h.decide("tenant", "acme")
	wantAllowed(t, d, "acme with both pools")
	if r := rule(t, d, "q-acme"); r.Pool != "q-acme" {
		t.Fatalf("fixed pool named %q", r.Pool)
	}
	if a, q := h.stats("plan/acme"), h.stats("q-acme"); a.Consumed != 1 || q.Consumed != 1 {
		t.Fatalf("acme consumed %d from its plan, %d from its own pool; want 1 and 1", a.Consumed, q.Consumed)
	}

	// One script call per decision, every key under the tenant's tag.
	calls, err := h.e.ScriptCalls(&admission.Request{Descriptors: entries("tenant", "acme")})
	if err != nil {
		t.Fatal(err)
	}
	if len(calls) != 1 {
		t.Fatalf("%d script calls, want 1", len(calls))
	}
	for _, k := range calls[0].Keys {
		if !strings.Contains(k, "{t:acme}") {
			t.Errorf("key %q lacks {t:acme}", k)
		}
	}
	if z, _, err := h.e.PoolKeys("plan/acme"); err != nil || z != h.ns+":{t:acme}:pool:plan/acme:z" {
		t.Fatalf("PoolKeys = %q, %v", z, err)
	}

	// A tenant too long to name in full: a hashed instance, its pool under
	// a tag of its own, spent in a second call.
	long := strings.Repeat("l", 200)
	hashed := policy.InstanceName("plan", []string{long})
	h.fund(hashed, 1)
	wantAllowed(t, h.decide("tenant", long), "hashed instance")
	wantDenied(t, h.decide("tenant", long), "hashed instance spent", "plan", policy.ScopeTenant, 1)
	if z, _, err := h.e.PoolKeys(hashed); err != nil || !strings.Contains(z, "{g:"+hashed+"}") {
		t.Fatalf("PoolKeys(hashed) = %q, %v", z, err)
	}

	for _, bad := range []string{"plan", "plan/a/b", "q-acme/x", "nope/x", "plan/a{"} {
		if _, err := h.e.DepositChunk(ctx, bad, "g", 1, time.Second); !errors.Is(err, admission.ErrUnknownQuota) {
			t.Errorf("DepositChunk(%q) = %v, want ErrUnknownQuota", bad, err)
		}
	}
}

// testPoolExhausted: a pool the allocator marked exhausted answers with a
// Retry-After to the end of the mark.
func testPoolExhausted(t *testing.T, b backend) {
	h := newHarness(t, b, parse(t, quotaPolicy), nil)
	if err := h.e.MarkExhausted(context.Background(), "q-acme", 30*time.Second); err != nil {
		t.Fatal(err)
	}
	wantDenied(t, h.decide("tenant", "acme"), "exhausted", "q-acme", policy.ScopeTenant, 30)
	if s := h.stats("q-acme"); s.Exhausted != 30*time.Second {
		t.Fatalf("exhausted %s, want 30s", s.Exhausted)
	}
	h.fund("q-acme", 5)
	wantAllowed(t, h.decide("tenant", "acme"), "after a deposit")
}

// testLocalChunkRefund: P-GLOBAL is spent from a gateway-local chunk of 100
// taken from the regional pool; when a tenant rule then denies, the token
// goes back in process.
func testLocalChunkRefund(t *testing.T, b backend) {
	h := newHarness(t, b, northstar(t), nil)
	h.fund("p-global", 1000)
	wantAllowed(t, h.decide(catalog("cedar", "U-1")...), "first read")
	s := h.stats("p-global")
	if s.Available != 900 || s.Local != 99 || s.Consumed != 100 {
		t.Fatalf("after one read: %+v; want 900 in the store, 99 held locally, 100 taken", s)
	}
	for i := 0; i < 19; i++ {
		wantAllowed(t, h.decide(catalog("cedar", "U-1")...), "reads")
	}
	if s := h.stats("p-global"); s.Local != 80 {
		t.Fatalf("local %d, want 80", s.Local)
	}
	// U-1's bucket is empty: P-READ denies after P-GLOBAL spent; refunded.
	wantDenied(t, h.decide(catalog("cedar", "U-1")...), "21st", "p-read", policy.ScopeUser, 1)
	if s := h.stats("p-global"); s.Local != 80 || s.Available != 900 {
		t.Fatalf("after the denial: %+v; want local 80 (refunded), store 900", s)
	}
	// 980 more reads by other users drain local and store (10 takes of 100).
	for i := 0; i < 980; i++ {
		wantAllowed(t, h.decide(catalog("cedar", "U-"+itoa(100+i/20))...), "drain")
	}
	s = h.stats("p-global")
	if s.Local != 0 || s.Available != 0 {
		t.Fatalf("after 1000 reads: %+v; want everything spent", s)
	}
	wantDenied(t, h.decide(catalog("cedar", "U-9999")...), "global pool empty", "p-global", policy.ScopeGlobal, 1)
}

func itoa(i int) string {
	if i == 0 {
		return "0"
	}
	var b []byte
	for ; i > 0; i /= 10 {
		b = append([]byte{byte('0' + i%10)}, b...)
	}
	return string(b)
}

const shadowPolicy = `
name: shadow
rules:
  - name: live
    scope: user
    match: [{key: tenant}, {key: user}]
    kind: token_bucket
    capacity: 20
    refill_per_second: 2
  - name: tighter
    description: proposed limit, measured before it is enforced
    scope: user
    match: [{key: tenant}, {key: user}]
    kind: token_bucket
    capacity: 5
    refill_per_second: 1
    shadow: true
`

// testShadow: a shadow rule is evaluated under its own key, reports
// would_deny, and never denies or touches the live rule's counter.
func testShadow(t *testing.T, b backend) {
	h := newHarness(t, b, parse(t, shadowPolicy), nil)
	req := []string{"tenant", "cedar", "user", "U-17"}
	for i := 0; i < 5; i++ {
		d := h.decide(req...)
		wantAllowed(t, d, "within both")
		if d.WouldDeny {
			t.Fatalf("request %d: would_deny within the shadow limit", i+1)
		}
	}
	d := h.decide(req...)
	wantAllowed(t, d, "6th: shadow would deny, live admits")
	if !d.WouldDeny || rule(t, d, "tighter").Allowed {
		t.Fatal("6th request: want would_deny from the shadow rule")
	}
	if got := rule(t, d, "live").Remaining; got != 14 {
		t.Fatalf("live remaining %d, want 14", got)
	}
	if d.Remaining != 14 {
		t.Fatalf("decision remaining %d, want 14 (shadow rules do not count)", d.Remaining)
	}
	calls, err := h.e.ScriptCalls(&admission.Request{Descriptors: entries(req...)})
	if err != nil || len(calls) != 1 || len(calls[0].Keys) != 3 || calls[0].Keys[1] == calls[0].Keys[2] {
		t.Fatalf("script calls %v, %v: want one call whose two rule keys differ", calls, err)
	}
	// A request the shadow rule could never admit (6 hits, capacity 5) is
	// not refused for it: the shadow rule reports would_deny, the live
	// rule decides.
	d, err = h.e.Decide(context.Background(), &admission.Request{Descriptors: entries("tenant", "cedar", "user", "U-18"), Hits: 6})
	if err != nil {
		t.Fatalf("6 hits against a shadow capacity of 5: %v; want a decision", err)
	}
	wantAllowed(t, d, "6 hits: over the shadow rule's capacity, within the live one")
	if !d.WouldDeny || rule(t, d, "tighter").Allowed || rule(t, d, "live").Remaining != 14 {
		t.Fatalf("6 hits: would_deny %v, tighter allowed %v, live remaining %d; want would_deny, denied, 14",
			d.WouldDeny, rule(t, d, "tighter").Allowed, rule(t, d, "live").Remaining)
	}
}

// testIdempotency: a retry with the same request id within the TTL returns
// the earlier decision and debits nothing again; after the TTL it is a new
// request.
func testIdempotency(t *testing.T, b backend) {
	h := newHarness(t, b, northstar(t), func(c *admission.Config) { c.IdempotencyTTL = 300 * time.Millisecond })
	req := &admission.Request{Descriptors: entries(export("cedar")...), RequestID: "req-1"}
	first := h.decideReq(req)
	wantAllowed(t, first, "first")
	again := h.decideReq(req)
	wantAllowed(t, again, "retry")
	if again.ID != first.ID || again.Source != admission.SourceReplay {
		t.Fatalf("retry: id %s source %s; want the earlier id %s from a replay", again.ID, again.Source, first.ID)
	}
	if got := rule(t, again, "p-export").Remaining; got != 10 {
		t.Fatalf("retry reports remaining %d, want the earlier 10", got)
	}
	other := h.decideReq(&admission.Request{Descriptors: entries(export("cedar")...), RequestID: "req-2"})
	wantAllowed(t, other, "another request")
	if got := rule(t, other, "p-export").Remaining; got != 0 {
		t.Fatalf("remaining %d, want 0: the retry must not have been charged", got)
	}
	// The id on another request is a new request: decided and charged, not
	// handed the export's admission (another tenant, another route).
	h.fund("p-global", 1000)
	for _, kv := range [][]string{export("elm"), catalog("cedar", "U-1")} {
		d := h.decideReq(&admission.Request{Descriptors: entries(kv...), RequestID: "req-1"})
		if d.Source == admission.SourceReplay || d.ID == first.ID {
			t.Fatalf("req-1 on %v: source %s id %s; want a new decision", kv, d.Source, d.ID)
		}
	}
	if d := h.decideReq(&admission.Request{Descriptors: entries(export("elm")...), RequestID: "req-1"}); d.Source != admission.SourceReplay {
		t.Fatalf("elm's req-1 retried: source %s, want a replay of elm's own decision", d.Source)
	}
	// Bounded retention: after the TTL (real time for Redis, the fake
	// clock for the embedded store) the id is new again.
	h.clock.Advance(10 * time.Second)
	time.Sleep(350 * time.Millisecond)
	late := h.decideReq(req)
	if late.Source == admission.SourceReplay || late.ID == first.ID {
		t.Fatalf("after the TTL: source %s id %s; want a new decision", late.Source, late.ID)
	}
}

const lastTokenPolicy = `
name: last
rules:
  - name: five
    scope: tenant
    match: [{key: tenant}]
    kind: token_bucket
    capacity: 5
    refill_per_second: 0
    zero_refill_reason: a fixed allowance for the atomicity test
  - name: user
    scope: user
    match: [{key: tenant}, {key: user}]
    kind: fixed_window
    limit: 1000
    window: 1m
`

// testAtomicity: 64 goroutines race for the last token of a two-rule
// decision; exactly one wins, and only the winner is charged anywhere.
func testAtomicity(t *testing.T, b backend) {
	h := newHarness(t, b, parse(t, lastTokenPolicy), nil)
	for i := 0; i < 4; i++ {
		wantAllowed(t, h.decide("tenant", "cedar", "user", "U-0"), "setup")
	}
	const racers = 64
	var (
		wg      sync.WaitGroup
		mu      sync.Mutex
		winners []string
		start   = make(chan struct{})
	)
	for i := 0; i < racers; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			<-start
			d, err := h.e.Decide(context.Background(), &admission.Request{Descriptors: entries("tenant", "cedar", "user", "U-"+itoa(i))})
			if err != nil {
				t.Error(err)
				return
			}
			if d.Outcome == admission.Unavailable {
				t.Errorf("racer %d: unavailable", i)
			}
			if d.Allowed() {
				mu.Lock()
				winners = append(winners, "U-"+itoa(i))
				mu.Unlock()
			}
		}(i)
	}
	close(start)
	wg.Wait()
	if len(winners) != 1 {
		t.Fatalf("%d winners %v for the last token, want exactly 1", len(winners), winners)
	}
	d := h.decide("tenant", "cedar", "user", "U-0")
	wantDenied(t, d, "after the race", "five", policy.ScopeTenant, -1)
	want := int64(995) // 4 setup requests charged, denials not, this one would be
	if winners[0] == "U-0" {
		want = 994
	}
	if got := rule(t, d, "user").Remaining; got != want {
		t.Fatalf("U-0 user rule would leave %d, want %d", got, want)
	}
}

// testTenantIsolation: Atlas exhausting its limits leaves Birch untouched.
func testTenantIsolation(t *testing.T, b backend) {
	h := newHarness(t, b, northstar(t), nil)
	h.fund("p-tenant-atlas", 100)
	h.fund("p-tenant-birch", 100)
	for i := 0; i < 2; i++ {
		wantAllowed(t, h.decide(export("atlas")...), "atlas export")
	}
	wantDenied(t, h.decide(export("atlas")...), "atlas third export", "p-export", policy.ScopeTenant, 5)
	d := h.decide(export("birch")...)
	wantAllowed(t, d, "birch export")
	if got := rule(t, d, "p-export").Remaining; got != 10 {
		t.Fatalf("birch remaining %d, want 10: Atlas must not touch Birch's bucket", got)
	}
}

const crossTagPolicy = `
name: cross
rules:
  - name: per-ip
    scope: ip
    match: [{key: ip}]
    kind: fixed_window
    limit: 5
    window: 1m
  - name: per-tenant
    scope: tenant
    match: [{key: tenant}]
    kind: fixed_window
    limit: 1
    window: 1m
`

// testCrossTagRefund: an ip rule and a tenant rule live under different hash
// tags, so they are two store calls; when the tenant rule denies, the ip
// rule's debit is refunded.
func testCrossTagRefund(t *testing.T, b backend) {
	h := newHarness(t, b, parse(t, crossTagPolicy), nil)
	wantAllowed(t, h.decide("ip", "192.0.2.1", "tenant", "t1"), "first")
	wantDenied(t, h.decide("ip", "192.0.2.1", "tenant", "t1"), "tenant full", "per-tenant", policy.ScopeTenant, 60)
	// The ip counter holds 1 (the refund undid the denied request): four
	// more tenants pass, the sixth request from the address is denied.
	for i := 2; i <= 5; i++ {
		wantAllowed(t, h.decide("ip", "192.0.2.1", "tenant", "t"+itoa(i)), "other tenants")
	}
	wantDenied(t, h.decide("ip", "192.0.2.1", "tenant", "t6"), "ip full", "per-ip", policy.ScopeIP, 60)
}

// testRefundSkipsShadow: when a later tag's rule denies, the refund gives
// back only what the earlier call debited. A shadow rule that denied in that
// call was not debited, and refunding it would undercount what it watches.
func testRefundSkipsShadow(t *testing.T, b backend) {
	h := newHarness(t, b, parse(t, crossTagPolicy+`
  - name: ip-watch
    scope: ip
    match: [{key: ip}]
    kind: fixed_window
    limit: 1
    window: 1m
    shadow: true
`), nil)
	d := h.decide("ip", "192.0.2.1", "tenant", "t1")
	wantAllowed(t, d, "first")
	if d.WouldDeny {
		t.Fatal("first request: would_deny within the shadow limit")
	}
	d = h.decide("ip", "192.0.2.1", "tenant", "t1")
	wantDenied(t, d, "tenant full", "per-tenant", policy.ScopeTenant, 60)
	if rule(t, d, "ip-watch").Allowed {
		t.Fatal("second request: the shadow rule should have denied")
	}
	// The shadow counter still holds the first request: it denies again.
	d = h.decide("ip", "192.0.2.1", "tenant", "t2")
	wantAllowed(t, d, "another tenant")
	if !d.WouldDeny || rule(t, d, "ip-watch").Allowed {
		t.Fatal("third request: want would_deny; the refund gave the shadow rule back a request it never counted")
	}
	if got := rule(t, d, "per-ip").Remaining; got != 3 {
		t.Fatalf("per-ip remaining %d, want 3 (the denied request refunded)", got)
	}
}

// testRefundDropsRecord: a request admitted under one tag and denied under
// a later one is refunded under the first, and the refund drops the first
// call's idempotency record with it. Left behind, a retry of the request
// would replay the refunded call and pass that tag without being charged.
func testRefundDropsRecord(t *testing.T, b backend) {
	h := newHarness(t, b, parse(t, `
name: refund-record
rules:
  - name: per-ip
    scope: ip
    match: [{key: ip}]
    kind: token_bucket
    capacity: 5
    refill_per_second: 0
    zero_refill_reason: counts every request of the test
  - name: per-tenant
    scope: tenant
    match: [{key: tenant}]
    kind: fixed_window
    limit: 1
    window: 1m
`), func(c *admission.Config) { c.IdempotencyTTL = time.Hour })
	req := func(id, tenant string) *admission.Request {
		return &admission.Request{Descriptors: entries("ip", "192.0.2.1", "tenant", tenant), RequestID: id}
	}
	wantAllowed(t, h.decideReq(req("r1", "t1")), "r1")
	wantDenied(t, h.decideReq(req("r2", "t1")), "r2, tenant full", "per-tenant", policy.ScopeTenant, 60)
	h.clock.Advance(time.Minute) // the tenant's window turns
	d := h.decideReq(req("r2", "t1"))
	wantAllowed(t, d, "r2 retried in the next window")
	if d.Source == admission.SourceReplay {
		t.Fatal("r2's retry replayed a refunded decision")
	}
	if got := rule(t, d, "per-ip").Remaining; got != 3 {
		t.Fatalf("r2's retry: per-ip remaining %d, want 3 (r1 and r2 charged)", got)
	}
	d = h.decideReq(req("r3", "t2"))
	if got := rule(t, d, "per-ip").Remaining; got != 2 {
		t.Fatalf("r3: per-ip remaining %d, want 2", got)
	}
	// A retry of an admitted request still replays.
	if d := h.decideReq(req("r1", "t1")); d.Source != admission.SourceReplay {
		t.Fatalf("r1 retried: source %s, want a replay", d.Source)
	}
}

// testReplayHoldsNoSlot: a replayed export returns the earlier decision,
// whose request holds the concurrency slot. The replay holds none, so
// releasing it cannot free the slot while the earlier request still runs.
func testReplayHoldsNoSlot(t *testing.T, b backend) {
	h := newHarness(t, b, northstar(t), func(c *admission.Config) { c.IdempotencyTTL = time.Hour })
	req := func(id string) *admission.Request {
		return &admission.Request{Descriptors: entries(export("cedar")...), RequestID: id}
	}
	for _, id := range []string{"a", "b", "c"} {
		wantAllowed(t, h.decideReq(req(id)), "export "+id)
		h.clock.Advance(5 * time.Second)
	}
	d := h.decideReq(req("a"))
	if d.Source != admission.SourceReplay || d.HasSlots() {
		t.Fatalf("export a retried: source %s, holds slots %v; want a replay holding none", d.Source, d.HasSlots())
	}
	if err := h.e.Release(context.Background(), d); err != nil {
		t.Fatal(err)
	}
	wantDenied(t, h.decideReq(req("d")), "a fourth export while a, b and c run", "p-export-concurrency", policy.ScopeTenant, 1)
}

// testApply: versions move forward atomically; an older or invalid version
// is rejected and the version in force stays; unchanged rules keep their
// counters; every decision records its version.
// testReplayOfALargerPolicy: a retry replays a decision recorded under a
// policy of twelve rules after the policy shrank to one. Its reply carries
// the twelve rules' numbers, more than a reply to a one-rule call can (the
// Redis store reads a decision's reply into a buffer sized for the call's
// rules, and asks again for a replay that does not fit): it is answered as
// the earlier decision, and charged nothing.
func testReplayOfALargerPolicy(t *testing.T, b backend) {
	var big strings.Builder
	big.WriteString("name: twelve\nrules:\n")
	for i := range 12 {
		fmt.Fprintf(&big, "  - {name: w%d, scope: tenant, match: [{key: tenant}], kind: fixed_window, limit: %d, window: 1m}\n", i, 5_000_000_000+i)
	}
	h := newHarness(t, b, parse(t, big.String()), nil)
	req := &admission.Request{Descriptors: entries("tenant", "atlas"), RequestID: "retry-me"}
	first := h.decideReq(req)
	wantAllowed(t, first, "under twelve rules")
	small := parse(t, `
name: one
rules:
  - {name: w0, scope: tenant, match: [{key: tenant}], kind: fixed_window, limit: 5000000000, window: 1m}
`)
	if err := h.e.Apply(small, 2); err != nil {
		t.Fatal(err)
	}
	again := h.decideReq(req)
	wantAllowed(t, again, "the retry under one rule")
	if again.ID != first.ID || again.Source != admission.SourceReplay {
		t.Fatalf("retry: id %s source %s; want the earlier id %s from a replay", again.ID, again.Source, first.ID)
	}
	other := h.decideReq(&admission.Request{Descriptors: entries("tenant", "atlas"), RequestID: "another"})
	if got := rule(t, other, "w0").Remaining; got != 5_000_000_000-2 {
		t.Fatalf("remaining %d after two decisions, want %d: the replay must not be charged", got, int64(5_000_000_000-2))
	}
	// The replayed id is the decision's own, not a view of a reply buffer
	// the next calls read into.
	for range 20 {
		h.decideReq(&admission.Request{Descriptors: entries("tenant", "atlas"), RequestID: "more"})
	}
	if again.ID != first.ID {
		t.Fatalf("the replayed id became %q after more decisions, want %q", again.ID, first.ID)
	}
}

func testApply(t *testing.T, b backend) {
	h := newHarness(t, b, northstar(t), nil)
	h.fund("p-global", 1000)
	for i := 0; i < 5; i++ {
		wantAllowed(t, h.decide(catalog("cedar", "U-1")...), "v1")
	}
	v2 := northstar(t)
	v2.Rule("p-export").Capacity = 30 // retune one rule
	if err := h.e.Apply(v2, 2); err != nil {
		t.Fatal(err)
	}
	d := h.decide(catalog("cedar", "U-1")...)
	if d.PolicyVersion != 2 || rule(t, d, "p-read").Remaining != 14 {
		t.Fatalf("v2: version %d remaining %d; want 2 and 14 (counters carried over)", d.PolicyVersion, rule(t, d, "p-read").Remaining)
	}
	if err := h.e.Apply(northstar(t), 2); !errors.Is(err, admission.ErrStalePolicy) {
		t.Fatalf("re-applying v2: %v, want ErrStalePolicy", err)
	}
	if err := h.e.Apply(northstar(t), 1); !errors.Is(err, admission.ErrStalePolicy) {
		t.Fatalf("applying v1 after v2: %v, want ErrStalePolicy", err)
	}
	bad := northstar(t)
	bad.Rule("p-export").Cost = 50 // above capacity
	if err := h.e.Apply(bad, 3); !errors.Is(err, admission.ErrInvalidPolicy) || !errors.Is(err, policy.ErrInvalid) {
		t.Fatalf("invalid v3: %v, want ErrInvalidPolicy wrapping policy.ErrInvalid", err)
	}
	if _, v := h.e.Policy(); v != 2 {
		t.Fatalf("version in force %d, want 2 (last known good)", v)
	}
	// Exports: the new capacity 30 applies at once.
	d = h.decide(export("cedar")...)
	if got := rule(t, d, "p-export").Remaining; got != 20 {
		t.Fatalf("export under v2: remaining %d, want 30 - 10", got)
	}
}

// testKeyLayout: every key of a tenant carries {t:<tenant>}; principals never
// appear in key names; the namespace prefixes everything.
func testKeyLayout(t *testing.T, b backend) {
	h := newHarness(t, b, northstar(t), nil)
	h.fund("p-global", 100)
	h.fund("p-tenant-atlas", 100)
	wantAllowed(t, h.decide(catalog("atlas", "U-17")...), "read")
	wantAllowed(t, h.decide(anon("203.0.113.7")...), "anon")
	wantAllowed(t, h.decideReq(&admission.Request{Descriptors: entries(export("atlas")...), RequestID: "user-visible-id"}), "export")
	keys := h.keys(h.ns)
	if len(keys) < 6 {
		t.Fatalf("keys %v: want at least bucket, pools, window, slots, idempotency", keys)
	}
	for _, k := range keys {
		if !strings.HasPrefix(k, h.ns+":{") {
			t.Errorf("key %q lacks the namespace and a hash tag", k)
		}
		for _, secret := range []string{"U-17", "203.0.113.7", "user-visible-id"} {
			if strings.Contains(k, secret) {
				t.Errorf("key %q contains the principal %q in clear", k, secret)
			}
		}
	}
	calls, err := h.e.ScriptCalls(&admission.Request{Descriptors: entries(catalog("atlas", "U-17")...)})
	if err != nil {
		t.Fatal(err)
	}
	if len(calls) != 1 { // P-GLOBAL is local; P-TENANT and P-READ share Atlas's tag
		t.Fatalf("%d script calls for an Atlas read, want 1", len(calls))
	}
	for _, k := range calls[0].Keys {
		if !strings.Contains(k, "{t:atlas}") {
			t.Errorf("key %q of an Atlas decision lacks {t:atlas}", k)
		}
	}
}

// testReleaseRequest: slots are found again from the descriptors and the
// request id, without the Decision.
func testReleaseRequest(t *testing.T, b backend) {
	h := newHarness(t, b, northstar(t), nil)
	ctx := context.Background()
	req := &admission.Request{Descriptors: entries(export("cedar")...), RequestID: "job-1"}
	wantAllowed(t, h.decideReq(req), "export")
	if n, err := h.e.ReleaseRequest(ctx, req); err != nil || n != 1 {
		t.Fatalf("ReleaseRequest = %d, %v; want 1 slot", n, err)
	}
	if n, err := h.e.ReleaseRequest(ctx, req); err != nil || n != 0 {
		t.Fatalf("second ReleaseRequest = %d, %v; want 0", n, err)
	}
	if _, err := h.e.ReleaseRequest(ctx, &admission.Request{Descriptors: entries(export("cedar")...)}); !errors.Is(err, admission.ErrInvalidRequest) {
		t.Fatalf("without a request id: %v", err)
	}
}

// testWindowRetune: a rule's counters outlive a retune (its digest leaves
// its numbers out), but a window's state holds its index in windows of the
// old length. A window that grew (1m to 1h) starts afresh: its index used
// to read as a clock gone back by ages, and the rule denied with a
// Retry-After of some 3,000 years until the key expired. One that shrank
// starts afresh too.
func testWindowRetune(t *testing.T, b backend) {
	for _, kind := range []string{"fixed_window", "sliding_window"} {
		t.Run(kind, func(t *testing.T) {
			doc := func(window string) *policy.Document {
				return parse(t, `
name: retune
rules:
  - {name: win, scope: tenant, match: [{key: tenant}], kind: `+kind+`, limit: 3, window: `+window+`}
`)
			}
			h := newHarness(t, b, doc("1m"), nil)
			for i := 0; i < 3; i++ {
				wantAllowed(t, h.decide("tenant", "acme"), "1m window")
			}
			if d := h.decide("tenant", "acme"); d.Allowed() {
				t.Fatal("4th request in the 1m window allowed")
			}
			if err := h.e.Apply(doc("1h"), 2); err != nil {
				t.Fatal(err)
			}
			h.clock.Advance(time.Second)
			for i := 0; i < 3; i++ {
				d := h.decide("tenant", "acme")
				wantAllowed(t, d, "after growing the window to 1h")
				if r := rule(t, d, "win"); r.Remaining != int64(2-i) || r.Reset > 3600 {
					t.Fatalf("request %d of the 1h window: remaining %d, reset %d s; want %d and at most 3600", i+1, r.Remaining, r.Reset, 2-i)
				}
			}
			d := h.decide("tenant", "acme")
			if d.Outcome != admission.Deny || d.RetryAfter < 1 || d.RetryAfter > 2*3600 || rule(t, d, "win").Reset > 3600 {
				t.Fatalf("4th request of the 1h window: %s, retry %d s, reset %d s; want denied within the window's reach",
					d.Outcome, d.RetryAfter, rule(t, d, "win").Reset)
			}
			h.clock.Advance(time.Duration(d.RetryAfter) * time.Second)
			wantAllowed(t, h.decide("tenant", "acme"), "after the Retry-After")

			if err := h.e.Apply(doc("1m"), 3); err != nil {
				t.Fatal(err)
			}
			d = h.decide("tenant", "acme")
			wantAllowed(t, d, "after shrinking the window to 1m")
			if r := rule(t, d, "win"); r.Remaining != 2 || r.Reset > 60 {
				t.Fatalf("after shrinking: remaining %d, reset %d s; want a fresh 1m window", r.Remaining, r.Reset)
			}
		})
	}
}

// testRetryPassesNegativeCache: the retry of an admitted request (its
// request id, descriptors and hits) gets the earlier admission back even
// while its key is in the negative cache: the cache used to answer it with
// a 429 before the store could replay it. A request whose id this engine
// never admitted is still denied from the cache, without a store call, and
// so is the admitted id on another request.
func testRetryPassesNegativeCache(t *testing.T, b backend) {
	h := newHarness(t, b, parse(t, `
name: retry
rules:
  - {name: b, scope: tenant, match: [{key: tenant}], kind: token_bucket, capacity: 2, refill_per_second: 1}
`), func(c *admission.Config) { c.NegativeCacheTTL = 250 * time.Millisecond })
	req := func(id string, hits int64) *admission.Request {
		return &admission.Request{Descriptors: entries("tenant", "acme"), RequestID: id, Hits: hits}
	}
	first := h.decideReq(req("req-1", 1))
	wantAllowed(t, first, "first")
	wantAllowed(t, h.decide("tenant", "acme"), "second")
	wantDenied(t, h.decide("tenant", "acme"), "third", "b", policy.ScopeTenant, 1)

	calls := h.e.Stats().StoreCalls
	retry := h.decideReq(req("req-1", 1))
	if !retry.Allowed() || retry.Source != admission.SourceReplay || retry.ID != first.ID {
		t.Fatalf("retry of req-1: %s from %s, id %s; want the earlier admission %s replayed", retry.Outcome, retry.Source, retry.ID, first.ID)
	}
	if got := h.e.Stats().StoreCalls; got != calls+1 {
		t.Fatalf("store calls %d -> %d; want the one that replayed", calls, got)
	}
	for _, r := range []*admission.Request{req("req-2", 1), req("req-1", 2), req("", 1)} {
		d := h.decideReq(r)
		if d.Outcome != admission.Deny || d.Source != admission.SourceNegativeCache {
			t.Fatalf("id %q, hits %d: %s from %s; want denied from the negative cache", r.RequestID, r.Hits, d.Outcome, d.Source)
		}
	}
	if got := h.e.Stats().StoreCalls; got != calls+1 {
		t.Fatalf("store calls %d -> %d: requests not admitted before reached the store", calls+1, got)
	}
}

// starvedChunkPolicy is tinyChunkPolicy (gateway chunks of one token) with a
// tenant bucket decided in the store.
const starvedChunkPolicy = tinyChunkPolicy + `  - {name: per-tenant, scope: tenant, match: [{key: tenant}], kind: token_bucket, capacity: 100, refill_per_second: 1}
`

// testRetryPassesStarvedChunk: a gateway-local chunk whose regional pool
// was found empty denies without a store call for a while; the retry of a
// request admitted before is not denied so (it used to be): the tenant's
// store call replays the earlier admission. A request with a new id still
// meets the starved chunk, without a store call.
func testRetryPassesStarvedChunk(t *testing.T, b backend) {
	h := newHarness(t, b, parse(t, starvedChunkPolicy), func(c *admission.Config) { c.NegativeCacheTTL = 250 * time.Millisecond })
	h.fund("fleet", 1)
	req := func(id string) *admission.Request {
		return &admission.Request{Descriptors: entries("route", "GET /catalog", "tenant", "acme"), RequestID: id}
	}
	first := h.decideReq(req("req-1"))
	wantAllowed(t, first, "the pool's only token")
	wantDenied(t, h.decideReq(req("req-2")), "pool empty", "fleet", policy.ScopeGlobal, 1)

	calls := h.e.Stats().StoreCalls
	retry := h.decideReq(req("req-1"))
	if !retry.Allowed() || retry.Source != admission.SourceReplay || retry.ID != first.ID || !rule(t, retry, "fleet").Allowed {
		t.Fatalf("retry of req-1: %s by %q from %s, id %s; want the earlier admission %s replayed", retry.Outcome, retry.Rule, retry.Source, retry.ID, first.ID)
	}
	if got := h.e.Stats().StoreCalls; got != calls+1 {
		t.Fatalf("store calls %d -> %d; want the tenant's, which replayed", calls, got)
	}
	wantDenied(t, h.decideReq(req("req-3")), "a new id", "fleet", policy.ScopeGlobal, 1)
	if got := h.e.Stats().StoreCalls; got != calls+1 {
		t.Fatalf("store calls %d -> %d: a new id passed the starved chunk", calls+1, got)
	}
	if s := h.stats("fleet"); s.Consumed != 1 {
		t.Fatalf("pool %+v: want the one token consumed", s)
	}
}

// testRefundKeepsHeldSlot: a retry of a running request (its request id,
// without idempotency) passes a concurrency rule on the slot the request
// holds and takes none; when a later tag's rule then denies, the refund
// must leave that slot to the running request. It used to remove it, and a
// second request ran beside the first under max_in_flight 1. A slot the
// decide took is still given back.
func testRefundKeepsHeldSlot(t *testing.T, b backend) {
	h := newHarness(t, b, parse(t, `
name: held-slot
rules:
  - {name: c, scope: ip, match: [{key: ip}], kind: concurrency, max_in_flight: 1, slot_ttl: 1m}
  - {name: b, scope: tenant, match: [{key: tenant}], kind: token_bucket, capacity: 1, refill_per_second: 0.001}
`), func(c *admission.Config) { c.IdempotencyTTL = 0 })
	req := func(id, tenant string) *admission.Request {
		return &admission.Request{Descriptors: entries("ip", "192.0.2.1", "tenant", tenant), RequestID: id}
	}
	a := h.decideReq(req("X", "t1"))
	wantAllowed(t, a, "X")
	wantDenied(t, h.decideReq(req("X", "t1")), "X retried, t1's bucket empty", "b", policy.ScopeTenant, 1000)
	if d := h.decideReq(req("Y", "t2")); d.Allowed() || d.Rule != "c" {
		t.Fatalf("Y while X runs: %s by %q; want denied by c (X holds the only slot)", d.Outcome, d.Rule)
	}
	if err := h.e.Release(context.Background(), a); err != nil {
		t.Fatal(err)
	}
	// W takes the free slot, t1's bucket denies: the refund gives it back.
	wantDenied(t, h.decideReq(req("W", "t1")), "W, t1's bucket empty", "b", policy.ScopeTenant, 1000)
	wantAllowed(t, h.decideReq(req("Y", "t2")), "Y after X's release and W's refund")
}

// testWindowClockBack: the store's clock stepping back by a few windows (a
// failover to a replica whose clock is behind) keeps counting in the newest
// window, as it does for one window back; only an index further ahead than
// any clock step (a retuned length, testWindowRetune) starts afresh.
func testWindowClockBack(t *testing.T, b backend) {
	for _, kind := range []string{"fixed_window", "sliding_window"} {
		t.Run(kind, func(t *testing.T) {
			h := newHarness(t, b, parse(t, `
name: clockback
rules:
  - {name: win, scope: tenant, match: [{key: tenant}], kind: `+kind+`, limit: 3, window: 1s}
`), nil)
			for i := 0; i < 3; i++ {
				wantAllowed(t, h.decide("tenant", "acme"), "the newest window")
			}
			for _, back := range []time.Duration{-time.Second, -time.Second} {
				h.clock.Advance(back)
				d := h.decide("tenant", "acme")
				if d.Allowed() {
					t.Fatalf("the clock %s back: a 4th request allowed (the counter restarted)", -back)
				}
				if r := rule(t, d, "win"); r.RetryAfter < 1 || r.RetryAfter > 4 {
					t.Fatalf("the clock %s back: retry after %d s, want 1-4 (the newest window's end)", -back, r.RetryAfter)
				}
			}
		})
	}
}
