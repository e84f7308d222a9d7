package admission_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"pgregory.net/rapid"

	"github.com/allot-dev/allot/pkg/admission"
)

const propPolicy = `
name: prop
regions: [eu]
rules:
  - name: b
    scope: user
    match: [{key: tenant}, {key: user}]
    kind: token_bucket
    capacity: 5
    refill_per_second: 1.5
  - name: f
    scope: tenant
    match: [{key: tenant}]
    kind: fixed_window
    limit: 12
    window: 2s
  - name: s
    scope: route
    match: [{key: tenant}, {key: route}]
    kind: sliding_window
    limit: 7
    window: 3s
  - name: c
    scope: route
    match: [{key: route, value: export}, {key: tenant}]
    kind: concurrency
    max_in_flight: 2
    slot_ttl: 5s
  - name: q
    scope: tenant
    match: [{key: tenant, value: acme}]
    kind: global_quota
    limit: 1000
    window: 1m
    lease: {chunk: 100, ttl: 1m}
  - name: sh
    scope: user
    match: [{key: tenant}, {key: user}]
    kind: token_bucket
    capacity: 3
    refill_per_second: 0.5
    shadow: true
`

// TestPropertyScriptMatchesMemory: for random sequences of requests,
// releases, deposits and clock steps, the Lua script on a real redis-server
// and the embedded store give identical decisions. The embedded store is the
// readable model of the script.
func TestPropertyScriptMatchesMemory(t *testing.T) {
	doc := parse(t, propPolicy)
	client := standaloneClient(t) // one connection pool for every check
	mem, red := memoryBackend(), redisBackend("redis", func(*testing.T) redis.UniversalClient { return client })
	rapid.Check(t, func(rt *rapid.T) {
		hm := newHarness(t, mem, doc, nil)
		hr := newHarness(t, red, doc, nil)
		ctx := context.Background()
		var held [2][]*admission.Decision
		steps := rapid.IntRange(1, 60).Draw(rt, "steps")
		for i := 0; i < steps; i++ {
			switch rapid.IntRange(0, 9).Draw(rt, "action") {
			case 0, 1:
				d := time.Duration(rapid.IntRange(0, 3000).Draw(rt, "ms")) * time.Millisecond
				hm.clock.Advance(d)
				hr.clock.Advance(d)
			case 2:
				if len(held[0]) == 0 {
					continue
				}
				j := rapid.IntRange(0, len(held[0])-1).Draw(rt, "release")
				if err := hm.e.Release(ctx, held[0][j]); err != nil {
					rt.Fatal(err)
				}
				if err := hr.e.Release(ctx, held[1][j]); err != nil {
					rt.Fatal(err)
				}
			case 3:
				n := int64(rapid.IntRange(1, 20).Draw(rt, "tokens"))
				ttl := time.Duration(rapid.IntRange(1, 20).Draw(rt, "ttl")) * time.Second
				id := fmt.Sprintf("g%d", i)
				a, err1 := hm.e.DepositChunk(ctx, "q", id, n, ttl)
				b, err2 := hr.e.DepositChunk(ctx, "q", id, n, ttl)
				if err1 != nil || err2 != nil || a != b {
					rt.Fatalf("deposit: memory %v %v, redis %v %v", a, err1, b, err2)
				}
			default:
				req := &admission.Request{
					Descriptors: entries(
						"tenant", rapid.SampledFrom([]string{"acme", "bolt"}).Draw(rt, "tenant"),
						"user", rapid.SampledFrom([]string{"u1", "u2", "u3"}).Draw(rt, "user"),
						"route", rapid.SampledFrom([]string{"read", "export"}).Draw(rt, "route"),
					),
					Hits: int64(rapid.IntRange(1, 3).Draw(rt, "hits")),
				}
				dm, err1 := hm.e.Decide(ctx, req)
				dr, err2 := hr.e.Decide(ctx, req)
				if err1 != nil || err2 != nil {
					rt.Fatalf("Decide: %v / %v", err1, err2)
				}
				if got, want := summary(dr), summary(dm); got != want {
					rt.Fatalf("step %d: redis decided\n%s\nmemory decided\n%s", i, got, want)
				}
				if dm.HasSlots() {
					held[0] = append(held[0], dm)
					held[1] = append(held[1], dr)
				}
			}
		}
		sm, err1 := hm.e.PoolStats(ctx, "q")
		sr, err2 := hr.e.PoolStats(ctx, "q")
		if err1 != nil || err2 != nil || sm != sr {
			rt.Fatalf("pool stats: memory %+v %v, redis %+v %v", sm, err1, sr, err2)
		}
	})
}

// summary is the part of a decision both stores must agree on.
func summary(d *admission.Decision) string {
	s := fmt.Sprintf("%s %s %s retry=%d remaining=%d would_deny=%v", d.Outcome, d.Rule, d.Scope, d.RetryAfter, d.Remaining, d.WouldDeny)
	for _, r := range d.Rules {
		s += fmt.Sprintf("\n  %s allowed=%v remaining=%d retry=%d reset=%d", r.Rule, r.Allowed, r.Remaining, r.RetryAfter, r.Reset)
	}
	return s
}

// TestPropertyBucketBound: a token bucket never admits more than
// capacity + refill x T over any run of length T, a denial never changes
// what the next request sees, and (liveness) a request is admitted exactly
// when the tokens the bucket holds cover its cost. The reference model
// keeps the bucket in millitokens as the policy implies: capacity 20 is
// 20000, and 2 tokens/s refill 2 millitokens per millisecond, so with a
// millisecond clock the refill has no rounding and the model is exact.
func TestPropertyBucketBound(t *testing.T) {
	doc := parse(t, `
name: bound
rules:
  - name: b
    scope: tenant
    match: [{key: tenant}]
    kind: token_bucket
    capacity: 20
    refill_per_second: 2
`)
	rapid.Check(t, func(rt *rapid.T) {
		h := newHarness(t, memoryBackend(), doc, nil)
		var admitted int64
		var elapsed time.Duration
		lastDenied := int64(-1)
		const capMilli, refillMilliPerMs = 20_000, 2
		model := int64(capMilli) // millitokens in the bucket: it starts full
		for i, n := 0, rapid.IntRange(1, 200).Draw(rt, "n"); i < n; i++ {
			step := time.Duration(rapid.IntRange(0, 1500).Draw(rt, "step")) * time.Millisecond
			h.clock.Advance(step)
			elapsed += step
			model = min(capMilli, model+refillMilliPerMs*step.Milliseconds())
			hits := int64(rapid.IntRange(1, 5).Draw(rt, "hits"))
			d := h.decideReq(&admission.Request{Descriptors: entries("tenant", "t"), Hits: hits})
			r := rule(t, d, "b")
			// Liveness and exactness against the model: the request is
			// admitted iff the bucket holds its cost, and what remains is
			// what the model keeps.
			if want := model >= hits*1000; d.Allowed() != want || r.Allowed != want {
				rt.Fatalf("request %d (%d hits) after %s: allowed %v (rule %v), want %v: the bucket holds %d millitokens",
					i, hits, elapsed, d.Allowed(), r.Allowed, want, model)
			}
			if d.Allowed() {
				model -= hits * 1000
			}
			if r.Remaining != model/1000 {
				rt.Fatalf("request %d (%d hits) after %s: remaining %d, want %d (%d millitokens)", i, hits, elapsed, r.Remaining, model/1000, model)
			}
			if d.Allowed() {
				admitted += hits
				lastDenied = -1
			} else {
				if step == 0 && lastDenied >= 0 && r.Remaining != lastDenied {
					rt.Fatalf("a denial changed the bucket: %d then %d", lastDenied, r.Remaining)
				}
				lastDenied = r.Remaining
			}
			// 2 tokens/s over elapsed, plus the initial 20.
			if bound := 20 + 2*elapsed.Milliseconds()/1000; admitted > bound {
				rt.Fatalf("admitted %d in %s, bound %d", admitted, elapsed, bound)
			}
		}
	})
}
