package agent_test

import (
	"context"
	"math"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/allot-dev/allot/pkg/agent"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// TestAllocatorMarginIsUsed: the margin the allocator's answers state
// (lease_margin_ms, the one its stated bound assumes) is used for the
// deadlines of the grants of that answer on when it is larger than the
// agent's own (testConfig's 50 ms), with one warning however many answers
// state it. A smaller one, or none (an allocator from before the field),
// leaves the agent's own.
func TestAllocatorMarginIsUsed(t *testing.T) {
	for _, tt := range []struct {
		name     string
		marginMs int64
		want     time.Duration
		warnings int
	}{
		{"larger", 2000, 2 * time.Second, 1},
		{"smaller", 10, 50 * time.Millisecond, 0},
		{"unstated", 0, 50 * time.Millisecond, 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			rdb, fa, doc, cfg := threeQuotasAgent(t)
			fa.setHook(func(_ context.Context, _ *allotv1.AcquireRequest, commit func() (*allotv1.AcquireResponse, error)) (*allotv1.AcquireResponse, error) {
				resp, err := commit()
				if err == nil {
					resp.LeaseMarginMs = tt.marginMs
				}
				return resp, err
			})
			core, logs := observer.New(zap.WarnLevel)
			var mu sync.Mutex
			var deps []agent.LeaseEvent
			a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1), agent.WithLogger(zap.New(core)),
				agent.WithLeaseObserver(func(e agent.LeaseEvent) {
					if e.Kind == agent.LeaseEventDeposit {
						mu.Lock()
						deps = append(deps, e)
						mu.Unlock()
					}
				})))
			for _, ten := range []string{"a", "b"} { // one answer each
				if v := mustCheck(t, a.Agent, tenant(ten)); !v.Allowed {
					t.Fatalf("tenant %s: %+v", ten, v)
				}
			}
			mu.Lock()
			defer mu.Unlock()
			if len(deps) < 2 {
				t.Fatalf("%d deposits, want one per tenant", len(deps))
			}
			for _, d := range deps {
				// The chunk lives in the store until At + TTL at the latest,
				// which must be the margin before the allocator's expiry
				// (one machine: one clock).
				expiry, limit := d.At+d.TTLMs*int64(time.Millisecond), d.ExpiresMs*int64(time.Millisecond)-int64(tt.want)
				if d.Outcome != agent.LeaseOK || expiry > limit {
					t.Errorf("deposit of %s: %s, spendable until %d ns, %s past the allocator's expiry minus %s",
						d.GrantID, d.Outcome, expiry, time.Duration(expiry-limit), tt.want)
				}
			}
			if n := logs.FilterMessageSnippet("lease margin is larger").Len(); n != tt.warnings {
				t.Errorf("%d warnings of the allocator's larger margin after %d answers, want %d", n, len(fa.acquireLog()), tt.warnings)
			}
		})
	}
}

// TestLeaderClockOffsetGauge: the measured offset of the leader's clock from
// the agent's is exported. An agent whose clock is 3 s behind the machine's
// (the fake allocator's leader clock) reads +3 s, within the round trip,
// after its first answer, and 0 before.
func TestLeaderClockOffsetGauge(t *testing.T) {
	rdb, _, doc, cfg := threeQuotasAgent(t)
	reg := prometheus.NewRegistry()
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1), agent.WithRegisterer(reg),
		agent.WithClock(agent.OffsetClock{Offset: -3 * time.Second})))
	const name = "allot_agent_leader_clock_offset_seconds"
	if v, n := metricSeries(t, reg, name); n != 1 || v != 0 {
		t.Fatalf("%s before any answer: %d series at %v, want one at 0", name, n, v)
	}
	if v := mustCheck(t, a.Agent, tenant("a")); !v.Allowed {
		t.Fatalf("tenant a: %+v", v)
	}
	off, rtt := a.ClockOffset()
	v := metricValue(t, reg, name)
	if v != float64(off)/1e3 || math.Abs(v-3) > rtt.Seconds()+0.002 {
		t.Fatalf("%s = %v after an answer (offset %d ms, round trip %s), want 3 within the round trip", name, v, off, rtt)
	}
}
