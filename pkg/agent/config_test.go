package agent_test

import (
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	"github.com/allot-dev/allot/fsm"
	"github.com/allot-dev/allot/internal/redistest"
	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/agent"
	"github.com/allot-dev/allot/pkg/policy"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

func TestConfigValidate(t *testing.T) {
	valid := agent.DefaultConfig()
	valid.Region = "eu"
	valid.AllocatorEndpoints = []string{"127.0.0.1:8001"}
	if err := valid.Validate(); err != nil {
		t.Fatalf("DefaultConfig with a region: %v", err)
	}
	tests := []struct {
		name string
		give func(*agent.Config)
		want string
	}{
		{"no region", func(c *agent.Config) { c.Region = "" }, "Region"},
		{"empty endpoint", func(c *agent.Config) { c.AllocatorEndpoints = []string{""} }, "AllocatorEndpoints[0]"},
		{"empty gRPC endpoint", func(c *agent.Config) { c.AllocatorGRPCEndpoints = []string{"127.0.0.1:9001", ""} }, "AllocatorGRPCEndpoints[1]"},
		{"gRPC endpoints alone", func(c *agent.Config) {
			c.AllocatorEndpoints, c.AllocatorGRPCEndpoints = nil, []string{"127.0.0.1:9001"}
		}, "AllocatorGRPCEndpoints needs AllocatorEndpoints"},
		{"state form", func(c *agent.Config) { c.Store.StateForm = "json" }, "StateForm"},
		{"engine", func(c *agent.Config) { c.Engine.StoreTimeout = 0 }, "StoreTimeout"},
		{"store", func(c *agent.Config) { c.Store.BatchSize = 0 }, "BatchSize"},
		{"tick", func(c *agent.Config) { c.Lease.Tick = 0 }, "Tick"},
		{"lead", func(c *agent.Config) { c.Lease.Lead = -time.Second }, "Lead"},
		{"margin", func(c *agent.Config) { c.Lease.Margin = -time.Millisecond }, "Margin"},
		{"deposit timeout", func(c *agent.Config) { c.Lease.DepositTimeout = 0 }, "DepositTimeout"},
		{"idle poll", func(c *agent.Config) { c.Lease.IdlePoll = time.Millisecond }, "IdlePoll"},
		{"wants per call", func(c *agent.Config) { c.Lease.MaxWantsPerCall = 0 }, "MaxWantsPerCall"},
		// More than any allocator takes: every call would be refused.
		{"wants per call over the allocator's", func(c *agent.Config) { c.Lease.MaxWantsPerCall = fsm.MaxWants + 1 }, "MaxWantsPerCall"},
		{"request bytes", func(c *agent.Config) { c.MaxRequestBytes = 10 }, "MaxRequestBytes"},
		{"starve wait", func(c *agent.Config) { c.StarveWait = time.Hour }, "StarveWait"},
		{"sample", func(c *agent.Config) { c.DecisionLogSample = 2 }, "DecisionLogSample"},
		{"watch backoff", func(c *agent.Config) { c.MaxWatchBackoff = time.Millisecond }, "WatchBackoff"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := valid
			tt.give(&c)
			err := c.Validate()
			if !errors.Is(err, agent.ErrConfig) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Validate: %v, want ErrConfig naming %s", err, tt.want)
			}
		})
	}
	// No allocator and no policy at all is refused by New.
	c := valid
	c.AllocatorEndpoints = nil
	if _, err := agent.New(c, sharedRedis(t)); !errors.Is(err, agent.ErrConfig) {
		t.Fatalf("New without allocator or policy: %v, want ErrConfig", err)
	}
}

// TestMetricsAndDecisionLogs: the metrics are exported, a store
// that stops answering shows up as store errors and fail-mode engagement,
// and decision logs are sampled with principals hashed.
func TestMetricsAndDecisionLogs(t *testing.T) {
	srv, err := redistest.StartServer(context.Background())
	redistest.Require(t, err)
	t.Cleanup(srv.Close)
	rdb := srv.Client()
	t.Cleanup(func() { rdb.Close() })
	cfg := testConfig("eu")
	cfg.Engine.StoreTimeout = 100 * time.Millisecond
	cfg.DecisionLogSample = 1
	cfg.LogSalt = "pepper"
	core, logs := observer.New(zap.InfoLevel)
	reg := prometheus.NewRegistry()
	a, err := agent.New(cfg, rdb, agent.WithPolicy(mustParse(t, apiPolicy), 0), agent.WithRegisterer(reg), agent.WithLogger(zap.New(core)))
	if err != nil {
		t.Fatal(err)
	}
	closeAtEnd(t, a)
	s := serve(t, a)
	ctx := context.Background()
	user := &agent.Input{Descriptors: []policy.Entry{{Key: "tenant", Value: "acme"}, {Key: "user", Value: "alice@example.com"}}}
	if v, err := a.Check(ctx, user); err != nil || !v.Allowed {
		t.Fatalf("check: %+v %v", v, err)
	}
	a.Renew(ctx) // reads the leased pool's counters
	if err := srv.Pause(); err != nil {
		t.Fatal(err)
	}
	v, err := a.Check(ctx, user)
	if rerr := srv.Resume(); rerr != nil {
		t.Fatal(rerr)
	}
	if err != nil || !v.Unavailable || v.Rule != "bucket" {
		t.Fatalf("check with the store paused: %+v %v, want unavailable by bucket (fail closed)", v, err)
	}
	check(t, s.connect, &allotv1.CheckRequest{Entries: entries("tenant", "acme", "user", "bob")})

	want := map[string]string{
		"allot_agent_decisions_total":                "verdict=unavailable",
		"allot_agent_fail_mode_total":                "mode=closed",
		"allot_admission_store_calls_total":          "result=error",
		"allot_agent_admission_duration_seconds":     "api=connect",
		"allot_agent_policy_version":                 "",
		"allot_agent_lease_tokens_held":              "quota=pool",
		"allot_agent_lease_tokens_consumed_total":    "quota=pool",
		"allot_agent_lease_tokens_expired_total":     "quota=pool",
		"allot_agent_lease_demand_tokens_per_second": "quota=pool",
		"allot_agent_pool_reads_total":               "",
		"allot_agent_renewal_duration_seconds":       "",
		"allot_agent_acquire_calls_total":            "",
		"allot_agent_allocator_cut_off":              "",
	}
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		label, ok := want[mf.GetName()]
		if !ok {
			continue
		}
		for _, m := range mf.GetMetric() {
			var ls []string
			for _, lp := range m.GetLabel() {
				ls = append(ls, lp.GetName()+"="+lp.GetValue())
			}
			if label == "" || strings.Contains(strings.Join(ls, ","), label) {
				delete(want, mf.GetName())
				break
			}
		}
	}
	if len(want) > 0 {
		t.Fatalf("metrics missing: %v", want)
	}

	entries := logs.FilterMessage("decision").All()
	if len(entries) < 3 {
		t.Fatalf("%d decision log entries with sample 1, want one per decision (3)", len(entries))
	}
	for _, e := range entries {
		ctx := e.ContextMap()
		d, _ := ctx["descriptors"].(map[string]any)
		if d == nil || d["tenant"] != "acme" {
			t.Fatalf("decision log %v: want the tenant in clear", ctx)
		}
		if u, ok := d["user"].(string); ok && (!strings.HasPrefix(u, "#") || strings.Contains(u, "alice")) {
			t.Fatalf("decision log user %q: want a salted hash, never the id", u)
		}
		if ctx["decision_id"] == "" || ctx["policy_version"] == nil {
			t.Fatalf("decision log %v: want the decision id and policy version", ctx)
		}
	}
}

// TestDecisionLogSalt: without LogSalt each agent hashes the principals in
// its decision logs with a random salt of its own, and says so once at
// start. (The salt used to be empty: a key everyone knows, so anyone could
// hash a suspected user, or every IPv4 address, and match the logs.) Agents
// given one salt hash alike.
func TestDecisionLogSalt(t *testing.T) {
	const ip = "203.0.113.7"
	// logged is the hash an agent with salt logs for ip, and how many times
	// it said at start that its salt is random.
	logged := func(t *testing.T, salt string) (string, int) {
		t.Helper()
		ms, err := admission.NewMemoryStore(admission.DefaultMemoryConfig(), nil)
		if err != nil {
			t.Fatal(err)
		}
		cfg := testConfig("eu")
		cfg.DecisionLogSample = 1
		cfg.LogSalt = salt
		core, logs := observer.New(zap.InfoLevel)
		a := newAgent(t, cfg, nil, agent.WithStore(ms), agent.WithPolicy(mustParse(t, apiPolicy), 0), agent.WithLogger(zap.New(core)))
		closeAtEnd(t, a)
		if v, err := a.Check(context.Background(), &agent.Input{Descriptors: []policy.Entry{{Key: "ip", Value: ip}}}); err != nil || !v.Allowed {
			t.Fatalf("check: %+v %v, want allowed", v, err)
		}
		decisions := logs.FilterMessage("decision").All()
		if len(decisions) != 1 {
			t.Fatalf("%d decision log entries, want 1", len(decisions))
		}
		d, _ := decisions[0].ContextMap()["descriptors"].(map[string]any)
		h, _ := d["ip"].(string)
		if !strings.HasPrefix(h, "#") {
			t.Fatalf("decision log descriptors %v: want the ip hashed", d)
		}
		return h, logs.FilterMessageSnippet("random salt").Len()
	}
	m := hmac.New(sha256.New, nil)
	m.Write([]byte("ip\x00" + ip))
	public := "#" + hex.EncodeToString(m.Sum(nil)[:8])

	a, na := logged(t, "")
	b, nb := logged(t, "")
	if a == b || a == public || b == public {
		t.Fatalf("hashes without a salt: %s and %s (empty key: %s), want two different ones, neither the empty key's", a, b, public)
	}
	if na != 1 || nb != 1 {
		t.Fatalf("random salt noted %d and %d times at start, want once each", na, nb)
	}
	c, nc := logged(t, "pepper")
	d, _ := logged(t, "pepper")
	if c != d || c == a || c == public {
		t.Fatalf("hashes with one salt: %s and %s, want the same, not the unsalted ones", c, d)
	}
	if nc != 0 {
		t.Fatalf("random salt noted %d times with LogSalt set, want never", nc)
	}
}

// TestKeySaltWarning: an agent on Redis without Engine.KeySalt warns once at
// start that the principals hashed into its key names can be recovered (an
// empty salt is a key everyone knows: an address is found again by hashing
// its /24), and says how to set one; it still starts, since setting a salt
// starts every counter afresh. With a salt, or on the embedded store (whose
// keys never leave the process), it says nothing.
func TestKeySaltWarning(t *testing.T) {
	rdb := sharedRedis(t)
	warnings := func(t *testing.T, salt string, rdb redis.UniversalClient, opts ...agent.Option) []observer.LoggedEntry {
		t.Helper()
		cfg := testConfig("eu")
		cfg.Engine.KeySalt = salt
		core, logs := observer.New(zap.WarnLevel)
		a, err := agent.New(cfg, rdb, append(opts, agent.WithPolicy(mustParse(t, apiPolicy), 0), agent.WithLogger(zap.New(core)))...)
		if err != nil {
			t.Fatalf("New with KeySalt %q: %v, want an agent", salt, err)
		}
		closeAtEnd(t, a)
		return logs.FilterMessageSnippet("without a secret salt").All()
	}
	es := warnings(t, "", rdb)
	if len(es) != 1 {
		t.Fatalf("%d warnings on Redis without a key salt (%v), want one", len(es), es)
	}
	if fix, _ := es[0].ContextMap()["fix"].(string); !strings.Contains(fix, "ALLOT_KEY_SALT") || !strings.Contains(fix, "admission.Config.KeySalt") ||
		!strings.Contains(fix, "every agent and gateway") {
		t.Fatalf("warning %q %v: want it to name $ALLOT_KEY_SALT, admission.Config.KeySalt and who must share it", es[0].Message, es[0].ContextMap())
	}
	rs, err := admission.NewRedisStore(rdb, agent.DefaultStoreConfig())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { rs.Close() })
	if es := warnings(t, "", nil, agent.WithStore(rs)); len(es) != 1 {
		t.Fatalf("%d warnings on a Redis store given WithStore without a key salt (%v), want one", len(es), es)
	}
	if es := warnings(t, "pepper", rdb); len(es) != 0 {
		t.Fatalf("warned with a key salt: %v", es)
	}
	ms, err := admission.NewMemoryStore(admission.DefaultMemoryConfig(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if es := warnings(t, "", nil, agent.WithStore(ms)); len(es) != 0 {
		t.Fatalf("warned on the embedded store: %v", es)
	}
}

// TestFailedNewLeavesNothingRunning: when New fails after it made its Redis
// store, its engine and its allocator client (here the metrics registry
// already holds another agent's), it closes them: no goroutine is left.
func TestFailedNewLeavesNothingRunning(t *testing.T) {
	rdb := sharedRedis(t) // its client's goroutines end with the test, later
	if err := rdb.Ping(context.Background()).Err(); err != nil {
		t.Fatal(err)
	}
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	reg := prometheus.NewRegistry()
	ms, err := admission.NewMemoryStore(admission.DefaultMemoryConfig(), nil)
	if err != nil {
		t.Fatal(err)
	}
	first, err := agent.New(testConfig("eu"), nil, agent.WithStore(ms), agent.WithRegisterer(reg), agent.WithPolicy(mustParse(t, apiPolicy), 0))
	if err != nil {
		t.Fatal(err)
	}
	defer first.Engine().Close()
	cfg := testConfig("eu", "127.0.0.1:1")
	cfg.AllocatorGRPCEndpoints = []string{"127.0.0.1:1"}
	_, err = agent.New(cfg, rdb, agent.WithRegisterer(reg), agent.WithPolicy(mustParse(t, apiPolicy), 0))
	if err == nil || !strings.Contains(err.Error(), "register metrics") {
		t.Fatalf("second agent on one registry: %v, want a registration error", err)
	}
}
