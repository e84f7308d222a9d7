package agent_test

import (
	"context"
	"fmt"
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

// TestRenewalTraffic10kQuotas measures the agent's renewal traffic with as
// many active global quotas (one per tenant) as one policy can hold, 10,000
// asked for, each spent at about 1 token per second: Acquire calls per
// second, quotas and tokens per call, and pool reads per second.
//
// A policy's canonical form is capped at policy.MaxDocumentBytes (1 MiB),
// about 3,800 such quotas, so 10,000 cannot be put in force at all; the test
// uses the most that fit and says so. The allocator is the real state
// machine behind the real Connect API without Raft (fakeAllocator).
func TestRenewalTraffic10kQuotas(t *testing.T) {
	benchEnabled(t)
	const (
		want    = 10_000
		rateper = 1.0 // decisions per second per quota
		run     = 20 * time.Second
		settled = 8 * time.Second // measure after this
	)
	build := func(n int) *policy.Document {
		doc := &policy.Document{Name: "tenk", Regions: []string{"eu"}}
		for i := 0; i < n; i++ {
			doc.Rules = append(doc.Rules, policy.Rule{
				Name: fmt.Sprintf("q%05d", i), Scope: policy.ScopeTenant,
				Match: []policy.Match{{Key: "tenant", Value: fmt.Sprintf("t%05d", i), HasValue: true}},
				Kind:  policy.KindGlobalQuota, Limit: 1_000_000, Window: time.Hour, Cost: 1, FailMode: policy.FailClosed,
				Lease: &policy.Lease{Chunk: 1000, TTL: time.Minute, Clamp: true, Strategy: policy.StrategyDemand},
			})
		}
		return doc
	}
	n := want
	doc := build(n)
	if err := doc.Validate(); err != nil {
		per := float64(len(mustCanonicalUnchecked(doc))) / float64(n)
		n = int(float64(policy.MaxDocumentBytes) * 0.99 / per)
		t.Logf("%d quotas do not fit one policy (%v); measuring with %d, the most that fit", want, err, n)
		doc = build(n)
		if err := doc.Validate(); err != nil {
			t.Fatal(err)
		}
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
	t.Logf("%d quotas, %.0f decisions/s", n, rate)
	for i := range ins {
		ins[i] = tenant(fmt.Sprintf("t%05d", i))
	}
	var denied, unavailable atomic.Int64
	read := func() (calls, wants, toks, reads float64) {
		return counterValue(t, reg, "allot_agent_acquire_calls_total"), counterValue(t, reg, "allot_agent_acquire_wants_total"),
			counterValue(t, reg, "allot_agent_acquire_tokens_total"), counterValue(t, reg, "allot_agent_pool_reads_total")
	}
	var c0, w0, k0, r0 float64
	var t0 time.Time
	start := time.Now()
	sampled := make(chan struct{})
	go func() {
		time.Sleep(settled)
		t0 = time.Now()
		c0, w0, k0, r0 = read()
		close(sampled)
	}()
	res, err := bench.Run(context.Background(), bench.Config{Name: "10k quotas", Workers: 64, Rate: rate, Duration: run, Requests: int64(rate * run.Seconds())},
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
	secs := time.Since(t0).Seconds()
	calls := c1 - c0
	t.Logf("%s", res)
	t.Logf("%d active quotas, %.0f decisions/s offered: after %s, over %.1fs: %.1f Acquire calls/s, %.0f quotas/call, %.0f tokens/call, %.0f pool reads/s; %d denied, %d unavailable after settling",
		n, rate, settled, secs, calls/secs, (w1-w0)/calls, (k1-k0)/calls, (r1-r0)/secs, denied.Load(), unavailable.Load())
	if calls/secs > 2/cfg.Lease.Tick.Seconds() {
		t.Errorf("%.1f Acquire calls/s: more than two per tick", calls/secs)
	}
}

// mustCanonicalUnchecked encodes doc without the size check, to measure it.
func mustCanonicalUnchecked(doc *policy.Document) []byte {
	small := *doc
	small.Rules = doc.Rules[:1]
	one, err := policy.Canonical(&small)
	if err != nil {
		panic(err)
	}
	return make([]byte, len(one)*len(doc.Rules))
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
