package admission_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap/zaptest"

	"github.com/allot-dev/allot/examples"
	"github.com/allot-dev/allot/internal/redistest"
	"github.com/allot-dev/allot/internal/testclock"
	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/policy"
)

// t0 is a wall time aligned to 10 s and to 1 min: window boundaries fall on
// round offsets from it.
var t0 = time.UnixMilli(1_700_000_040_000)

// fakeClock is a manual clock shared by the engine and the store.
type fakeClock struct{ *testclock.Manual }

func newFakeClock(t time.Time) *fakeClock { return &fakeClock{testclock.New(t)} }

// Set moves the clock to t0 + offset.
func (c *fakeClock) Set(offset time.Duration) { c.Manual.Set(t0.Add(offset)) }

// backend makes stores of one kind.
type backend struct {
	name string
	// store returns a store reading time from clock (memory only; Redis
	// stores get time from the engine in tests) and a function listing the
	// keys under namespace ns.
	store func(t *testing.T, clock admission.Clock) (admission.Store, func(ns string) []string)
	redis func(t *testing.T) redis.UniversalClient // nil for memory
}

var nsSeq atomic.Int64

// namespace returns a key namespace no other test uses.
func namespace() string { return fmt.Sprintf("t%d", nsSeq.Add(1)) }

func memoryBackend() backend {
	return backend{
		name: "memory",
		store: func(t *testing.T, clock admission.Clock) (admission.Store, func(string) []string) {
			s, err := admission.NewMemoryStore(admission.DefaultMemoryConfig(), clock)
			if err != nil {
				t.Fatal(err)
			}
			return s, func(ns string) []string {
				var out []string
				for _, k := range s.Keys() {
					if strings.HasPrefix(k, ns+":") {
						out = append(out, k)
					}
				}
				return out
			}
		},
	}
}

func redisBackend(name string, client func(t *testing.T) redis.UniversalClient, opts ...admission.RedisOption) backend {
	return backend{
		name:  name,
		redis: client,
		store: func(t *testing.T, _ admission.Clock) (admission.Store, func(string) []string) {
			c := client(t)
			s, err := admission.NewRedisStore(c, admission.DefaultRedisConfig(), opts...)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { s.Close() })
			return s, func(ns string) []string { return scanKeys(t, c, ns+":*") }
		},
	}
}

func standaloneClient(t *testing.T) redis.UniversalClient {
	t.Helper()
	redistest.Require(t, shared.err)
	c := redis.NewClient(&redis.Options{Addr: shared.redis.Addr()})
	t.Cleanup(func() { c.Close() })
	return c
}

func clusterClient(t *testing.T) redis.UniversalClient {
	t.Helper()
	redistest.Require(t, shared.err)
	c := redis.NewClusterClient(&redis.ClusterOptions{Addrs: shared.cluster.Addrs()})
	t.Cleanup(func() { c.Close() })
	return c
}

// backends are the three stores the conformance suite runs on.
func backends() []backend {
	return []backend{
		memoryBackend(),
		redisBackend("redis", standaloneClient),
		redisBackend("cluster", clusterClient),
	}
}

func scanKeys(t *testing.T, c redis.UniversalClient, match string) []string {
	t.Helper()
	ctx := context.Background()
	var (
		mu  sync.Mutex
		out []string
	)
	scan := func(ctx context.Context, n *redis.Client) error {
		it := n.Scan(ctx, 0, match, 1000).Iterator()
		for it.Next(ctx) {
			mu.Lock()
			out = append(out, it.Val())
			mu.Unlock()
		}
		return it.Err()
	}
	var err error
	switch cc := c.(type) {
	case *redis.ClusterClient:
		err = cc.ForEachMaster(ctx, scan)
	case *redis.Client:
		err = scan(ctx, cc)
	}
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(out)
	return out
}

// harness is one engine on one backend with a fake clock.
type harness struct {
	t      *testing.T
	e      *admission.Engine
	clock  *fakeClock
	ns     string
	keys   func(ns string) []string
	doc    *policy.Document
	client redis.UniversalClient
}

func northstar(t testing.TB) *policy.Document {
	t.Helper()
	doc, err := policy.Parse(examples.Northstar)
	if err != nil {
		t.Fatal(err)
	}
	return doc
}

func parse(t testing.TB, yaml string) *policy.Document {
	t.Helper()
	doc, err := policy.Parse([]byte(yaml))
	if err != nil {
		t.Fatal(err)
	}
	return doc
}

// newHarness starts an engine on b with doc as version 1. mutate may change
// the config; the negative cache is off unless mutate turns it on.
func newHarness(t *testing.T, b backend, doc *policy.Document, mutate func(*admission.Config)) *harness {
	t.Helper()
	clock := newFakeClock(t0)
	store, keys := b.store(t, clock)
	cfg := admission.DefaultConfig()
	cfg.NegativeCacheTTL = 0
	cfg.Namespace = namespace()
	cfg.StoreTimeout = 2 * time.Second // a loaded CI machine must not trip fail modes here
	if mutate != nil {
		mutate(&cfg)
	}
	e, err := admission.New(cfg, store, doc, 1, admission.WithClock(clock), admission.WithLogger(zaptest.NewLogger(t)))
	if err != nil {
		t.Fatal(err)
	}
	admission.UseStoreClock(e)
	t.Cleanup(func() { e.Close() })
	h := &harness{t: t, e: e, clock: clock, ns: cfg.Namespace, keys: keys, doc: doc}
	if b.redis != nil {
		h.client = b.redis(t)
	}
	return h
}

func entries(kv ...string) []policy.Entry {
	out := make([]policy.Entry, 0, len(kv)/2)
	for i := 0; i+1 < len(kv); i += 2 {
		out = append(out, policy.Entry{Key: kv[i], Value: kv[i+1]})
	}
	return out
}

func (h *harness) decide(kv ...string) *admission.Decision {
	h.t.Helper()
	return h.decideReq(&admission.Request{Descriptors: entries(kv...)})
}

func (h *harness) decideReq(req *admission.Request) *admission.Decision {
	h.t.Helper()
	d, err := h.e.Decide(context.Background(), req)
	if err != nil {
		h.t.Fatalf("Decide: %v", err)
	}
	return d
}

// fund deposits tokens into a quota's pool for an hour.
func (h *harness) fund(quota string, tokens int64) {
	h.t.Helper()
	ok, err := h.e.DepositChunk(context.Background(), quota, fmt.Sprintf("g-%s-%d-%d", quota, tokens, nsSeq.Add(1)), tokens, time.Hour)
	if err != nil || !ok {
		h.t.Fatalf("DepositChunk(%s, %d) = %v, %v", quota, tokens, ok, err)
	}
}

func (h *harness) stats(quota string) admission.PoolStats {
	h.t.Helper()
	s, err := h.e.PoolStats(context.Background(), quota)
	if err != nil {
		h.t.Fatal(err)
	}
	return s
}

// rule returns the result of rule name in d.
func rule(t testing.TB, d *admission.Decision, name string) admission.RuleResult {
	t.Helper()
	for _, r := range d.Rules {
		if r.Rule == name {
			return r
		}
	}
	t.Fatalf("rule %s not in decision (rules %v)", name, d.Rules)
	return admission.RuleResult{}
}

// wantAllowed fails unless d allowed the request.
func wantAllowed(t testing.TB, d *admission.Decision, what string) {
	t.Helper()
	if !d.Allowed() {
		t.Fatalf("%s: %s by %s (%s), retry %d; want allowed", what, d.Outcome, d.Rule, d.Scope, d.RetryAfter)
	}
}

// wantDenied fails unless d denied the request with rule and retry.
func wantDenied(t testing.TB, d *admission.Decision, what, ruleName string, scope policy.Scope, retry int64) {
	t.Helper()
	if d.Outcome != admission.Deny || d.Rule != ruleName || d.Scope != scope || d.RetryAfter != retry {
		t.Fatalf("%s: got %s by %q (%s) retry %d; want deny by %q (%s) retry %d",
			what, d.Outcome, d.Rule, d.Scope, d.RetryAfter, ruleName, scope, retry)
	}
}

// Descriptors of the Northstar requests. Tenant cedar has no tenant quota,
// so its requests meet only the per-user and per-route rules.
func catalog(tenant, user string) []string {
	return []string{"route", "GET /catalog", "tenant", tenant, "user", user, "auth", "token"}
}

func export(tenant string) []string {
	return []string{"route", "POST /reports/export", "tenant", tenant, "auth", "token"}
}

func anon(ip string) []string {
	return []string{"auth", "anonymous", "ip", ip}
}
