package agent_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"

	"github.com/allot-dev/allot/internal/redistest"
	"github.com/allot-dev/allot/pkg/agent"
	"github.com/allot-dev/allot/pkg/bench"
	"github.com/allot-dev/allot/pkg/policy"
)

// TestRenewalTraffic10kQuotas measures the agent's renewal traffic with
// 10,000 active global quotas, each spent at about 1 token per second:
// Acquire calls per second, quotas and tokens per call, and pool reads per
// second.
//
// The quotas are the instances of ONE template rule (every tenant: its own
// pool of 1,000,000 per hour), made active by 10,000 tenants sending
// requests through Agent.Check: the agent learns of each instance from the
// first request that needs it. Every tenant's first request is sent before
// the measured run, 1,000 at a time (the activation, reported on its own),
// then the tenants are spent at 1 token per second each. (As one named
// rule per tenant, 10,000 quotas
// do not fit a policy: its canonical form is capped at 1 MiB, about 3,300
// such rules.) The store is a real redis-server; the allocator is the real
// state machine behind the real Connect API without Raft (fakeAllocator).
func TestRenewalTraffic10kQuotas(t *testing.T) {
	benchEnabled(t)
	const (
		n       = 10_000
		rateper = 1.0 // decisions per second per quota
		run     = 20 * time.Second
		settled = 5 * time.Second // measure after this
		workers = 256
		burst   = 1000 // first requests in flight at once
	)
	doc := &policy.Document{Name: "tenk", Regions: []string{"eu"}, Rules: []policy.Rule{{
		Name: "plan", Scope: policy.ScopeTenant, Match: []policy.Match{{Key: "tenant"}},
		Kind: policy.KindGlobalQuota, Limit: 1_000_000, Window: time.Hour, Cost: 1, FailMode: policy.FailClosed,
		Lease: &policy.Lease{Chunk: 1000, TTL: time.Minute, Clamp: true, Strategy: policy.StrategyDemand},
	}}}
	if err := doc.Validate(); err != nil {
		t.Fatal(err)
	}
	rate := rateper * float64(n)
	srv, err := redistest.StartServer(context.Background())
	redistest.Require(t, err)
	defer srv.Close()
	rdb := redis.NewClient(&redis.Options{Addr: srv.Addr(), PoolSize: 64})
	defer rdb.Close()
	fa := startFakeAllocator(t)
	fa.publish(doc)
	cfg := testConfig("eu", fa.addr)
	cfg.Lease = agent.DefaultLeaseConfig()
	cfg.Lease.Margin = 50 * time.Millisecond
	cfg.Lease.StoreParallelism = 32
	cfg.DecisionLogSample = 0
	reg := prometheus.NewRegistry()
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1), agent.WithRegisterer(reg)))
	ins := make([]*agent.Input, n)
	t.Logf("1 template, %d tenants, %.0f decisions/s, at most %d wants per Acquire", n, rate, cfg.Lease.MaxWantsPerCall)
	for i := range ins {
		ins[i] = tenant(fmt.Sprintf("t%05d", i))
	}
	var denied, unavailable atomic.Int64
	read := func() (calls, wants, toks, reads float64) {
		return counterValue(t, reg, "allot_agent_acquire_calls_total"), counterValue(t, reg, "allot_agent_acquire_wants_total"),
			counterValue(t, reg, "allot_agent_acquire_tokens_total"), counterValue(t, reg, "allot_agent_pool_reads_total")
	}
	active := func() int {
		k := 0
		for _, s := range a.Leases() {
			if s.Template == "plan" {
				k++
			}
		}
		return k
	}
	// Activation: every tenant's first request, burst at a time.
	warm := time.Now()
	var firstAllowed atomic.Int64
	var wg sync.WaitGroup
	sem := make(chan struct{}, burst)
	for _, in := range ins {
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer func() { <-sem; wg.Done() }()
			if v, err := a.Check(context.Background(), in); err == nil && v.Allowed {
				firstAllowed.Add(1)
			}
		}()
	}
	wg.Wait()
	cw, ww, kw, _ := read()
	t.Logf("activation: %d first requests, %d at a time, in %s: %d allowed, %d active quotas; %.0f Acquire calls, %.0f quotas/call, %.1f tokens/call",
		n, burst, time.Since(warm).Round(time.Millisecond), firstAllowed.Load(), active(), cw, ww/cw, kw/cw)

	waits := func() float64 { return counterValue(t, reg, "allot_agent_starve_waits_total") }
	var c0, w0, k0, r0, s0 float64
	var t0 time.Time
	var active0, log0 int
	start := time.Now()
	sampled := make(chan struct{})
	go func() {
		time.Sleep(settled)
		t0 = time.Now()
		c0, w0, k0, r0 = read()
		s0 = waits()
		active0, log0 = active(), len(fa.acquireLog())
		close(sampled)
	}()
	res, err := bench.Run(context.Background(), bench.Config{Name: "10k quotas", Workers: workers, Rate: rate, Duration: run, Requests: int64(rate * run.Seconds())},
		func(ctx context.Context, w int, i uint64) error {
			v, err := a.Check(ctx, ins[(uint64(w)*7919+i*104729)%uint64(n)])
			if err != nil {
				return err
			}
			if !v.Allowed && time.Since(start) > settled+time.Second {
				if v.Unavailable {
					unavailable.Add(1)
				} else {
					denied.Add(1)
				}
			}
			return nil
		})
	if err != nil {
		t.Fatal(err)
	}
	<-sampled
	c1, w1, k1, r1 := read()
	s1 := waits()
	active1 := active()
	secs := time.Since(t0).Seconds()
	calls := c1 - c0
	maxWants := 0
	for _, req := range fa.acquireLog()[log0:] {
		maxWants = max(maxWants, len(req.GetWants()))
	}
	t.Logf("%s", res)
	t.Logf("%d active quotas (instances of one template) when the measurement started, %d when it ended; %.0f decisions/s offered by %d callers: "+
		"after %s, over %.1fs: %.1f Acquire calls/s (%.2f per %s tick), %.0f quotas/call, %.0f tokens/call, largest call %d wants, "+
		"%.0f pool reads/s; %.0f requests (%.2f%% of those offered) waited for a renewal; %d denied, %d unavailable after settling",
		active0, active1, rate, workers, settled, secs, calls/secs, calls/secs*cfg.Lease.Tick.Seconds(), cfg.Lease.Tick,
		(w1-w0)/calls, (k1-k0)/calls, maxWants, (r1-r0)/secs, s1-s0, 100*(s1-s0)/(rate*secs), denied.Load(), unavailable.Load())
	if active0 < n*99/100 {
		t.Errorf("%d active quotas when the measurement started, want about %d", active0, n)
	}
	if calls/secs > 1/cfg.Lease.Tick.Seconds()+1 {
		t.Errorf("%.1f Acquire calls/s: more than one per tick", calls/secs)
	}
}

// counterValue sums a registered counter's children.
func counterValue(t testing.TB, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	v := 0.0
	for _, mf := range mfs {
		if mf.GetName() == name {
			for _, m := range mf.GetMetric() {
				v += m.GetCounter().GetValue()
			}
		}
	}
	return v
}
