package agent_test

import (
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/allot-dev/allot/pkg/agent"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// TestCountersStartAtZero: a fresh agent serves every known label value of
// its event counters at 0, so that the first event is an increase that
// increase() and rate() see: a series born at 1 shows none, and the shipped
// alert on policy_updates_total{result=~"malformed|invalid|persist_error"}
// could not fire for a one-off refusal. Here the refusal of one malformed
// record moves its series from 0 to 1, leaving the others at 0.
func TestCountersStartAtZero(t *testing.T) {
	fa := startFakeAllocator(t)
	doc := mustParse(t, apiPolicy)
	fa.publish(doc)
	reg := prometheus.NewRegistry()
	a := runAgent(t, newAgent(t, testConfig("eu", fa.addr), sharedRedis(t), agent.WithPolicy(doc, 1), agent.WithRegisterer(reg)))

	for _, c := range []struct {
		name   string
		labels []string // label name, then its values
		with   []string // fixed labels of the series
	}{
		{"allot_agent_policy_updates_total", []string{"result", "applied", "older", "malformed", "invalid", "persist_error", "diverged"}, nil},
		{"allot_agent_renewal_failures_total", []string{"reason", "unreachable", "refused", "malformed", "deposit", "deposit_unknown", "too_late"}, nil},
		{"allot_agent_starve_waits_total", []string{"result", "served", "timeout", "exhausted", "cut_off", "refused"}, nil},
		{"allot_agent_store_errors_total", []string{"op", "stats", "deposit", "exhaust", "withdraw"}, []string{"kind", "timeout"}},
		{"allot_agent_store_errors_total", []string{"op", "stats", "deposit", "exhaust", "withdraw"}, []string{"kind", "error"}},
		{"allot_agent_bad_requests_total", []string{"api", "connect", "grpc", "envoy", "connect-batch", "grpc-batch"}, []string{"code", "invalid_argument"}},
		{"allot_agent_bad_requests_total", []string{"code", "invalid_argument", "deadline_exceeded", "canceled", "unavailable", "internal"}, []string{"api", "envoy"}},
	} {
		for _, val := range c.labels[1:] {
			ls := append([]string{c.labels[0], val}, c.with...)
			if v, n := metricSeries(t, reg, c.name, ls...); n != 1 || v != 0 {
				t.Errorf("%s%v: %d series, value %v; want one, at 0", c.name, ls, n, v)
			}
		}
	}

	// One malformed record: its series goes from 0 to 1.
	fa.inject <- &allotv1.PolicyRecord{Version: 9, Document: []byte("not yaml: ["), Digest: "00"}
	waitFor(t, 10*time.Second, "the malformed record's refusal", func() bool {
		return metricValue(t, reg, "allot_agent_policy_updates_total", "result", "malformed") == 1
	})
	for _, r := range []string{"invalid", "persist_error", "diverged"} {
		if v, n := metricSeries(t, reg, "allot_agent_policy_updates_total", "result", r); n != 1 || v != 0 {
			t.Errorf("policy_updates_total{result=%s}: %d series at %v, want one at 0", r, n, v)
		}
	}
	if err := a.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
}
