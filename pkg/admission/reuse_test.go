package admission_test

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/allot-dev/allot/internal/redistest"
	"github.com/allot-dev/allot/pkg/admission"
)

const reusePolicy1 = `
name: reuse-1
rules:
  - {name: tenant, scope: tenant, match: [{key: tenant}], kind: fixed_window, limit: 40, window: 1h}
`

const reusePolicy3 = `
name: reuse-3
rules:
  - {name: tenant, scope: tenant, match: [{key: tenant}], kind: fixed_window, limit: 40, window: 1h}
  - {name: user, scope: user, match: [{key: tenant}, {key: user}], kind: fixed_window, limit: 100000, window: 1h}
  - {name: route, scope: route, match: [{key: tenant}, {key: route}], kind: token_bucket, capacity: 100000, refill_per_second: 1}
`

// TestReusedCommandsKeepEveryReplyItsOwn: a standalone store reuses its
// EVALSHA commands (RedisStore's reusable) across pipelines. Concurrent
// decisions of one and of three rules (commands of different lengths), with
// the script flushed halfway (the NOSCRIPT path with reused commands), must
// each get their own reply: for every tenant exactly its limit is allowed,
// and the allowed decisions' remaining counts are each of limit-1 .. 0
// once.
func TestReusedCommandsKeepEveryReplyItsOwn(t *testing.T) {
	redistest.Require(t, shared.err)
	ctx := context.Background()
	client := shared.redis.Client()
	t.Cleanup(func() { client.Close() })
	rcfg := admission.DefaultRedisConfig()
	store, err := admission.NewRedisStore(client, rcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { store.Close() })
	clock := newFakeClock(t0)
	engines := map[string]*admission.Engine{}
	for name, src := range map[string]string{"1": reusePolicy1, "3": reusePolicy3} {
		cfg := admission.DefaultConfig()
		cfg.NegativeCacheTTL = 0
		cfg.Namespace = namespace()
		cfg.StoreTimeout = 5 * time.Second
		cfg.ExtraDescriptors = []string{"user", "route"}
		e, err := admission.New(cfg, store, parse(t, src), 1, admission.WithClock(clock))
		if err != nil {
			t.Fatal(err)
		}
		admission.UseStoreClock(e)
		t.Cleanup(func() { e.Close() })
		engines[name] = e
	}
	const tenants, attempts, limit, workers = 12, 60, 40, 32
	type result struct {
		engine, tenant string
		allowed        bool
		remaining      int64
	}
	jobs := make(chan [2]string)
	results := make(chan result, 2*tenants*attempts)
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for j := range jobs {
				d, err := engines[j[0]].Decide(ctx, &admission.Request{Descriptors: entries("tenant", j[1], "user", "u-"+j[1], "route", "GET /r")})
				if err != nil {
					t.Errorf("%s rules, %s: %v", j[0], j[1], err)
					continue
				}
				rem := int64(-1)
				for _, r := range d.Rules {
					if r.Rule == "tenant" {
						rem = r.Remaining
					}
				}
				results <- result{j[0], j[1], d.Allowed(), rem}
			}
		}()
	}
	for i := 0; i < attempts; i++ {
		if i == attempts/2 {
			if err := client.ScriptFlush(ctx).Err(); err != nil {
				t.Fatal(err)
			}
		}
		for k := 0; k < tenants; k++ {
			for _, name := range []string{"1", "3"} {
				jobs <- [2]string{name, fmt.Sprintf("c%d", k)}
			}
		}
	}
	close(jobs)
	wg.Wait()
	close(results)
	remaining := map[string][]int64{}
	for r := range results {
		if r.allowed {
			k := r.engine + "/" + r.tenant
			remaining[k] = append(remaining[k], r.remaining)
		}
	}
	want := make([]int64, limit)
	for i := range want {
		want[i] = int64(i)
	}
	for _, name := range []string{"1", "3"} {
		for k := 0; k < tenants; k++ {
			key := fmt.Sprintf("%s/c%d", name, k)
			got := remaining[key]
			slices.Sort(got)
			if !slices.Equal(got, want) {
				t.Errorf("%s rules, tenant c%d: allowed %d with remaining %v; want each of 0..%d once", name, k, len(got), got, limit-1)
			}
		}
	}
}
