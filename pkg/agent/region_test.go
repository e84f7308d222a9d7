package agent_test

import (
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/allot-dev/allot/pkg/agent"
)

// TestRegionNotInThePolicy: an agent whose region is none of the policy's
// regions (a wrong -region) says so. Its leased quotas' requests are
// answered unavailable at once and counted as
// fail_mode_total{mode="refused"}, not as a cut-off (the allocator answers,
// and allocator_cut_off stays 0); an error log names the quotas not leased
// to it, once for each policy version put in force; and it is not ready,
// /readyz answering 503 with the reason. It used to be ready, silent, and
// count the 503s as cut_off.
func TestRegionNotInThePolicy(t *testing.T) {
	rdb, fa, doc, cfg := threeQuotasAgent(t) // regions [eu, us]
	cfg.Region = "ap"
	cfg.StarveWait = 5 * time.Second // a wait, were there one, would be plain
	core, logs := observer.New(zap.WarnLevel)
	reg := prometheus.NewRegistry()
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1), agent.WithRegisterer(reg), agent.WithLogger(zap.New(core))))

	t0 := time.Now()
	v := mustCheck(t, a.Agent, tenant("a"))
	if took := time.Since(t0); took > cfg.StarveWait/2 {
		t.Fatalf("check took %s: want an answer at once, not a wait for a renewal that cannot come", took)
	}
	if v.Allowed || !v.Unavailable || v.Rule != "q-a" {
		t.Fatalf("check: %+v, want unavailable by q-a", v)
	}
	if got := metricValue(t, reg, "allot_agent_fail_mode_total", "rule", "q-a", "mode", "refused"); got != 1 {
		t.Errorf("fail_mode_total{rule=q-a,mode=refused} = %v, want 1", got)
	}
	if got := metricValue(t, reg, "allot_agent_fail_mode_total", "mode", "cut_off"); got != 0 {
		t.Errorf("fail_mode_total{mode=cut_off} = %v, want 0: the allocator is not cut off", got)
	}
	if a.CutOff() || metricValue(t, reg, "allot_agent_allocator_cut_off") != 0 {
		t.Error("the agent reports being cut off")
	}

	notLeased := func() []observer.LoggedEntry {
		return logs.FilterMessageSnippet("not one of the policy's regions").All()
	}
	if es := notLeased(); len(es) != 1 || es[0].Level != zap.ErrorLevel {
		t.Errorf("%d logs saying the region is not the policy's (%v), want one error", len(es), es)
	} else if f := es[0].ContextMap(); !slices.Equal(anyStrings(f["quotas"]), []string{"q-a", "q-b", "q-c"}) || f["version"] != uint64(1) ||
		!strings.Contains(es[0].Message, "-region") {
		t.Errorf("log %q %v: want the quotas not leased, the version and a hint at -region", es[0].Message, f)
	}

	if a.Ready() {
		t.Error("Ready: true, want false")
	}
	s := serve(t, a.Agent)
	resp, err := http.Get("http://" + s.addr + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable || !strings.Contains(string(body), `"ap"`) || !strings.Contains(string(body), "eu us") {
		t.Fatalf("/readyz: %d %q, want 503 naming the region and the policy's regions", resp.StatusCode, body)
	}

	// A new version is logged again; the same version from the allocator
	// (already in force) is not.
	fa.publish(doc)
	waitFor(t, 10*time.Second, "policy v2", func() bool { return a.PolicyVersion() == 2 })
	if es := notLeased(); len(es) != 2 || es[1].ContextMap()["version"] != uint64(2) {
		t.Fatalf("after v2: %d logs (%v), want one per version", len(es), es)
	}

	// The same policy on an agent of one of its regions: ready.
	b := newAgent(t, testConfig("eu"), rdb, agent.WithPolicy(doc, 1))
	closeAtEnd(t, b)
	if !b.Ready() {
		t.Fatal("agent of region eu: not ready")
	}
}

// anyStrings converts a logged string slice (as the observer keeps it).
func anyStrings(v any) []string {
	switch v := v.(type) {
	case []string:
		return v
	case []any:
		out := make([]string, 0, len(v))
		for _, e := range v {
			s, _ := e.(string)
			out = append(out, s)
		}
		return out
	}
	return nil
}

// metricValue sums the samples of metric name (a counter or a gauge) whose
// labels include the given name, value pairs.
func metricValue(t testing.TB, reg *prometheus.Registry, name string, labels ...string) float64 {
	t.Helper()
	v, _ := metricSeries(t, reg, name, labels...)
	return v
}

// metricSeries is metricValue and how many series it summed.
func metricSeries(t testing.TB, reg *prometheus.Registry, name string, labels ...string) (float64, int) {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum, n := 0.0, 0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	series:
		for _, m := range mf.GetMetric() {
			have := map[string]string{}
			for _, lp := range m.GetLabel() {
				have[lp.GetName()] = lp.GetValue()
			}
			for i := 0; i+1 < len(labels); i += 2 {
				if have[labels[i]] != labels[i+1] {
					continue series
				}
			}
			n++
			sum += m.GetCounter().GetValue() + m.GetGauge().GetValue()
		}
	}
	return sum, n
}
