package agent_test

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/allot-dev/allot/pkg/agent"
	"github.com/allot-dev/allot/pkg/policy"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// basePolicy has one leased tenant quota and one per-user window; its
// user limit is the placeholder LIMIT.
const basePolicy = `
name: test
regions: [eu, us]
rules:
  - name: pool
    scope: tenant
    match: [{key: tenant, value: acme}]
    kind: global_quota
    limit: 100
    window: 1m
    lease: {chunk: 10, ttl: 30s}
  - name: per-user
    scope: user
    match: [{key: tenant}, {key: user}]
    kind: fixed_window
    limit: LIMIT
    window: 24h
`

func userPolicy(t testing.TB, limit string) *policy.Document {
	clearOfDailyTurn(t)
	return mustParse(t, strings.ReplaceAll(basePolicy, "LIMIT", limit))
}

func TestPolicyWatchAppliesNewerRejectsOlderAndMalformedKeepsLastKnownGood(t *testing.T) {
	rdb := sharedRedis(t)
	fa := startFakeAllocator(t)
	fa.publish(userPolicy(t, "5"))
	dir := t.TempDir()
	cfg := testConfig("eu", fa.addr)
	cfg.DataDir = dir
	reg := prometheus.NewRegistry()
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithRegisterer(reg)))
	s := serve(t, a.Agent)
	waitFor(t, 10*time.Second, "policy v1", func() bool { return a.PolicyVersion() == 1 })

	req := &allotv1.CheckRequest{Entries: entries("tenant", "beta", "user", "u1")}
	if r := check(t, s.connect, req); !r.Allowed || r.PolicyVersion != 1 || r.Remaining != 4 {
		t.Fatalf("under v1: %+v, want allowed, version 1, remaining 4", r)
	}

	// A newer version is applied atomically; decisions record it.
	v2 := userPolicy(t, "50")
	fa.publish(v2)
	waitFor(t, 10*time.Second, "policy v2", func() bool { return a.PolicyVersion() == 2 })
	if r := check(t, s.connect, req); r.PolicyVersion != 2 || r.Remaining != 48 {
		t.Fatalf("under v2: %+v, want version 2 and the counter carried over (remaining 48)", r)
	}

	// Older, malformed and tampered records are rejected; v2 stays.
	v1doc := canonical(t, userPolicy(t, "5"))
	bad := []*allotv1.PolicyRecord{
		{Version: 1, Document: v1doc, Digest: digestOf(v1doc)},                                   // older
		{Version: 3, Document: []byte("rules: [oops"), Digest: digestOf([]byte("rules: [oops"))}, // malformed
		{Version: 3, Document: v1doc, Digest: digestOf([]byte("something else"))},                // digest mismatch
		{Version: 3, Document: []byte(`{"name":"x","rules":[{"name":"r","scope":"tenant","match":[{"key":"tenant"}],"kind":"token_bucket","capacity":1,"refill_per_second":"1","cost":5,"fail_mode":"closed"}]}`)},
	}
	bad[3].Digest = digestOf(bad[3].Document) // cost above capacity: invalid
	for _, r := range bad {
		fa.inject <- r
	}
	waitFor(t, 10*time.Second, "the bad records to be seen", func() bool {
		return testutil.ToFloat64(counterVec(t, reg, "allot_agent_policy_updates_total", "older"))+
			testutil.ToFloat64(counterVec(t, reg, "allot_agent_policy_updates_total", "malformed")) >= 4
	})
	if got := testutil.ToFloat64(counterVec(t, reg, "allot_agent_policy_updates_total", "older")); got != 1 {
		t.Errorf("older records rejected = %v, want 1", got)
	}
	if got := testutil.ToFloat64(counterVec(t, reg, "allot_agent_policy_updates_total", "malformed")); got != 3 {
		t.Errorf("malformed records rejected = %v, want 3", got)
	}
	if v := a.PolicyVersion(); v != 2 {
		t.Fatalf("version in force after bad records = %d, want 2", v)
	}
	if r := check(t, s.connect, req); r.PolicyVersion != 2 {
		t.Fatalf("decision after bad records made under v%d, want v2", r.PolicyVersion)
	}

	// The last-known-good version survives a restart without the allocator.
	if err := a.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if _, err := os.Stat(filepath.Join(dir, "policy.json")); err != nil {
		t.Fatalf("last-known-good file: %v", err)
	}
	cfg2 := cfg
	cfg2.AllocatorEndpoints = []string{"127.0.0.1:1"} // nothing listens there
	b := newAgent(t, cfg2, rdb)
	if !b.Ready() || b.PolicyVersion() != 2 {
		t.Fatalf("restarted agent: ready %v version %d, want ready under v2 before any allocator contact", b.Ready(), b.PolicyVersion())
	}
	rb := runAgent(t, b)
	sb := serve(t, rb.Agent)
	if r := check(t, sb.connect, req); !r.Allowed || r.PolicyVersion != 2 || r.Remaining != 46 {
		t.Fatalf("restarted agent decided %+v, want allowed under v2 with remaining 46", r)
	}
}

func TestDamagedLastKnownGoodIsIgnored(t *testing.T) {
	rdb := sharedRedis(t)
	dir := t.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "policy.json"), []byte(`{"version":7,"digest":"00","document":{}}`), 0o644); err != nil {
		t.Fatal(err)
	}
	cfg := testConfig("eu", "127.0.0.1:1")
	cfg.DataDir = dir
	a := newAgent(t, cfg, rdb)
	if a.Ready() {
		t.Fatalf("agent with a damaged last-known-good file is ready under v%d; want not ready", a.PolicyVersion())
	}
	_, err := a.Check(context.Background(), &agent.Input{})
	if err == nil || !strings.Contains(err.Error(), "no policy") {
		t.Fatalf("Check before any policy: %v, want ErrNotReady", err)
	}
}

func TestShadowRuleReportsWouldDenyWithoutDebitingLiveKeys(t *testing.T) {
	rdb := sharedRedis(t)
	clearOfDailyTurn(t)
	doc := mustParse(t, `
name: shadow
rules:
  - name: live
    scope: tenant
    match: [{key: tenant}]
    kind: fixed_window
    limit: 10
    window: 24h
  - name: stricter
    scope: tenant
    match: [{key: tenant}]
    kind: fixed_window
    limit: 1
    window: 24h
    shadow: true
`)
	cfg := testConfig("eu")
	// Running, so that the test's end closes its store's pipeline workers.
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(doc, 0))).Agent
	ctx := context.Background()
	in := &agent.Input{Descriptors: []policy.Entry{{Key: "tenant", Value: "acme"}}}
	for i, want := range []struct {
		remaining int64
		wouldDeny bool
	}{{9, false}, {8, true}, {7, true}} {
		v, err := a.Check(ctx, in)
		if err != nil {
			t.Fatal(err)
		}
		if !v.Allowed || v.Remaining != want.remaining || (len(v.WouldDeny) > 0) != want.wouldDeny {
			t.Fatalf("check %d: %+v, want allowed, remaining %d (the live rule alone), would_deny %v", i, v, want.remaining, want.wouldDeny)
		}
		if want.wouldDeny && v.WouldDeny[0] != "stricter" {
			t.Fatalf("would_deny = %v, want [stricter]", v.WouldDeny)
		}
	}
}

// counterVec returns the child of a registered counter vector by label value.
func counterVec(t testing.TB, reg *prometheus.Registry, name, label string) prometheus.Collector {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	v := 0.0
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, lp := range m.GetLabel() {
				if lp.GetValue() == label {
					v += m.GetCounter().GetValue()
				}
			}
		}
	}
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: "snapshot"})
	c.Add(v)
	return c
}

// TestRebuiltAllocatorHistoryIsAdopted: an agent whose last-known-good
// policy came from an allocator cluster that was since rebuilt (its state
// lost, policies published again from v1) adopts the rebuilt allocator's
// current record when it connects, with an error logged, and follows the
// allocator from there. It used to reject the allocator's versions up to
// its own as older and never see the one sharing its number: it went on
// deciding under the lost cluster's document while reporting the
// allocator's version.
func TestRebuiltAllocatorHistoryIsAdopted(t *testing.T) {
	rdb := sharedRedis(t)
	for _, tt := range []struct {
		name string
		// publish fills the rebuilt allocator before the agent connects,
		// and returns the version and limit the agent must end under.
		publish func(fb *fakeAllocator) (uint64, int64)
		// later publishes once the agent runs (nil: nothing).
		later func(fb *fakeAllocator) (uint64, int64)
	}{
		{name: "same version, another digest", publish: func(fb *fakeAllocator) (uint64, int64) {
			fb.publish(userPolicy(t, "7"))
			return fb.publish(userPolicy(t, "20000")), 20000
		}},
		{name: "an older version", publish: func(fb *fakeAllocator) (uint64, int64) {
			return fb.publish(userPolicy(t, "20000")), 20000
		}},
		{name: "nothing published yet", publish: func(*fakeAllocator) (uint64, int64) { return 2, 100000 },
			later: func(fb *fakeAllocator) (uint64, int64) { return fb.publish(userPolicy(t, "30000")), 30000 }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			// Cluster A: v2 has a user limit of 100000, saved as
			// last-known-good.
			fa := startFakeAllocator(t)
			fa.publish(userPolicy(t, "5"))
			fa.publish(userPolicy(t, "100000"))
			cfg := testConfig("eu", fa.addr)
			cfg.DataDir = dir
			a := runAgent(t, newAgent(t, cfg, rdb))
			waitFor(t, 10*time.Second, "policy v2 of cluster A", func() bool { return a.PolicyVersion() == 2 })
			if err := a.stop(); err != nil {
				t.Fatal(err)
			}

			// Cluster B, rebuilt.
			fb := startFakeAllocator(t)
			version, limit := tt.publish(fb)
			core, logs := observer.New(zapcore.InfoLevel)
			reg := prometheus.NewRegistry()
			cfg.AllocatorEndpoints = []string{fb.addr}
			b := newAgent(t, cfg, rdb, agent.WithLogger(zap.New(core)), agent.WithRegisterer(reg))
			if v := b.PolicyVersion(); v != 2 {
				t.Fatalf("restarted agent starts under v%d, want the last-known-good v2", v)
			}
			rb := runAgent(t, b)
			s := serve(t, rb.Agent)
			diverged := func() float64 {
				return testutil.ToFloat64(counterVec(t, reg, "allot_agent_policy_updates_total", "diverged"))
			}
			if tt.later != nil {
				waitFor(t, 10*time.Second, "the error saying the allocator has none", func() bool {
					return logs.FilterLevelExact(zapcore.ErrorLevel).FilterMessageSnippet("history differs").Len() > 0
				})
				if b.PolicyVersion() != 2 || diverged() != 0 {
					t.Fatalf("before the rebuilt allocator publishes: v%d, %v adopted; want v2 kept", b.PolicyVersion(), diverged())
				}
				version, limit = tt.later(fb)
			}
			// The allocator's current record is in force, and saved as
			// last-known-good.
			want := fb.current(t)
			waitFor(t, 10*time.Second, fmt.Sprintf("the allocator's v%d %.12s in force", want.GetVersion(), want.GetDigest()), func() bool {
				v, d := savedLKG(t, dir)
				return v == want.GetVersion() && d == want.GetDigest() && b.PolicyVersion() == want.GetVersion()
			})
			if want.GetVersion() != version {
				t.Fatalf("the allocator is at v%d, want v%d", want.GetVersion(), version)
			}
			req := &allotv1.CheckRequest{Entries: entries("tenant", "beta", "user", "u-"+namespace())}
			if r := check(t, s.connect, req); !r.Allowed || r.PolicyVersion != version || r.Remaining != limit-1 {
				t.Fatalf("decided %+v, want allowed under v%d with the allocator's limit (remaining %d)", r, version, limit-1)
			}
			if n := logs.FilterLevelExact(zapcore.ErrorLevel).FilterMessageSnippet("history differs").Len(); n == 0 {
				t.Errorf("no error logged about the allocator's history: %v", logs.All())
			}
			if got := diverged(); got != 1 {
				t.Errorf("policy_updates_total{result=\"diverged\"} = %v, want 1", got)
			}
			if _, err := reg.Gather(); err != nil {
				t.Fatalf("metrics after the engine was replaced: %v", err)
			}

			// The agent follows the allocator from there.
			next := fb.publish(userPolicy(t, "40000"))
			waitFor(t, 10*time.Second, "the next version", func() bool { return b.PolicyVersion() == next })
			if r := check(t, s.connect, req); r.PolicyVersion != next || r.Remaining != 40000-2 {
				t.Fatalf("decided %+v, want v%d with remaining %d", r, next, 40000-2)
			}
		})
	}
}

// savedLKG returns the version and digest of the last-known-good file in
// dir (0 and "" when there is none).
func savedLKG(t testing.TB, dir string) (uint64, string) {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "policy.json"))
	if os.IsNotExist(err) {
		return 0, ""
	}
	if err != nil {
		t.Fatal(err)
	}
	var saved struct {
		Version uint64 `json:"version"`
		Digest  string `json:"digest"`
	}
	if err := json.Unmarshal(b, &saved); err != nil {
		t.Fatal(err)
	}
	return saved.Version, saved.Digest
}
