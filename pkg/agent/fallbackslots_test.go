package agent_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/redis/go-redis/v9"

	"github.com/allot-dev/allot/internal/redistest"
	"github.com/allot-dev/allot/pkg/agent"
	"github.com/allot-dev/allot/pkg/policy"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
	"github.com/allot-dev/allot/proto/allot/v1/allotv1connect"
)

const fallbackSlotsPolicy = `
name: fallback-slots
regions: [eu]
rules:
  - name: exports
    scope: route
    match: [{key: tenant}, {key: route, value: POST /export}]
    kind: concurrency
    max_in_flight: 2
    slot_ttl: 1h
    fail_mode: fallback
`

// redisDownAgent returns an agent on fallbackSlotsPolicy whose Redis cannot
// be reached (nothing listens on its address).
func redisDownAgent(t *testing.T) (*agent.Agent, *served) {
	t.Helper()
	addr, err := redistest.ClosedAddr()
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: addr, DialTimeout: 100 * time.Millisecond, MaxRetries: -1, DialerRetries: 1})
	t.Cleanup(func() { rdb.Close() })
	cfg := testConfig("eu")
	cfg.Engine.StoreTimeout = 100 * time.Millisecond
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(mustParse(t, fallbackSlotsPolicy), 0))).Agent
	return a, serve(t, a)
}

// TestReleaseSlotFreesFallbackSlotsWhileRedisIsDown: while the region's
// Redis cannot be reached, a concurrency rule in fallback mode takes slots
// in this process. ReleaseSlot must free them although it cannot reach the
// store (and say Unavailable for the store's part): they have no TTL, and it
// used to return at the store's error, so two exports filled the fallback
// for the rest of the outage.
func TestReleaseSlotFreesFallbackSlotsWhileRedisIsDown(t *testing.T) {
	_, s := redisDownAgent(t)
	export := entries("tenant", "acme", "route", "POST /export")
	for _, id := range []string{"r1", "r2"} {
		if r := check(t, s.connect, &allotv1.CheckRequest{Entries: export, RequestId: id}); !r.Allowed {
			t.Fatalf("export %s in the outage: %+v, want allowed by the fallback", id, r)
		}
	}
	if r := check(t, s.connect, &allotv1.CheckRequest{Entries: export, RequestId: "r3"}); r.Allowed || r.Rule != "exports" {
		t.Fatalf("third export: %+v, want denied by the fallback's two slots", r)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err := s.connect.ReleaseSlot(ctx, connect.NewRequest(&allotv1.ReleaseSlotRequest{Entries: export, RequestId: "r1"}))
	if connect.CodeOf(err) != connect.CodeUnavailable {
		t.Fatalf("ReleaseSlot with the store down: %v, want Unavailable (the store's part failed)", err)
	}
	if r := check(t, s.connect, &allotv1.CheckRequest{Entries: export, RequestId: "r3"}); !r.Allowed {
		t.Fatalf("export after r1's release: %+v, want allowed: r1's fallback slot is free", r)
	}
}

// TestFallbackSlotReleaseIsPerTenant: fallback slots are remembered under
// the tenant that took them: a ReleaseSlot from another tenant carrying the
// same request id frees nothing of them (it used to free acme's slot).
func TestFallbackSlotReleaseIsPerTenant(t *testing.T) {
	a, s := redisDownAgent(t)
	acme := entries("tenant", "acme", "route", "POST /export")
	for _, id := range []string{"r1", "r2"} {
		if r := check(t, s.connect, &allotv1.CheckRequest{Entries: acme, RequestId: id}); !r.Allowed {
			t.Fatalf("acme export %s in the outage: %+v, want allowed by the fallback", id, r)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	beta := []policy.Entry{{Key: "tenant", Value: "beta"}, {Key: "route", Value: "POST /export"}}
	if n, _ := a.ReleaseSlot(ctx, beta, "r1"); n != 0 {
		t.Fatalf("beta's release of r1 freed %d slots, want 0: r1's slot is acme's", n)
	}
	if r := check(t, s.connect, &allotv1.CheckRequest{Entries: acme, RequestId: "r3"}); r.Allowed || r.Rule != "exports" {
		t.Fatalf("acme's third export after beta's release: %+v, want denied: acme still holds two slots", r)
	}
	acmeEntries := []policy.Entry{{Key: "tenant", Value: "acme"}, {Key: "route", Value: "POST /export"}}
	if n, _ := a.ReleaseSlot(ctx, acmeEntries, "r1"); n != 1 {
		t.Fatalf("acme's release of r1 freed %d slots, want 1", n)
	}
	if r := check(t, s.connect, &allotv1.CheckRequest{Entries: acme, RequestId: "r3"}); !r.Allowed {
		t.Fatalf("acme's export after its own release: %+v, want allowed", r)
	}
}

// TestRetriedRequestIDFreesEveryFallbackSlot: with the store down nothing
// makes a retry idempotent, so each check of one request id takes a
// fallback slot of its own; ReleaseSlot of that id frees them all (a retry
// used to replace the first decision, whose slot was then never freed).
func TestRetriedRequestIDFreesEveryFallbackSlot(t *testing.T) {
	a, s := redisDownAgent(t)
	export := entries("tenant", "acme", "route", "POST /export")
	for i := range 2 {
		if r := check(t, s.connect, &allotv1.CheckRequest{Entries: export, RequestId: "r1"}); !r.Allowed {
			t.Fatalf("attempt %d of r1 in the outage: %+v, want allowed by the fallback", i, r)
		}
	}
	if r := check(t, s.connect, &allotv1.CheckRequest{Entries: export, RequestId: "r2"}); r.Allowed {
		t.Fatalf("r2 after two attempts of r1: %+v, want denied: r1 holds both slots", r)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	acme := []policy.Entry{{Key: "tenant", Value: "acme"}, {Key: "route", Value: "POST /export"}}
	if n, _ := a.ReleaseSlot(ctx, acme, "r1"); n != 2 {
		t.Fatalf("release of r1 freed %d slots, want 2 (one per attempt)", n)
	}
	for _, id := range []string{"r2", "r3"} {
		if r := check(t, s.connect, &allotv1.CheckRequest{Entries: export, RequestId: id}); !r.Allowed {
			t.Fatalf("export %s after r1's release: %+v, want allowed: both slots are free", id, r)
		}
	}
}

// TestReleaseSlotUnavailableKeepsStoreDetailsInside: a ReleaseSlot that
// cannot reach the store says so plainly; the store's address and the
// dialer's error stay in the agent's log, and the message does not speak of
// a decision.
func TestReleaseSlotUnavailableKeepsStoreDetailsInside(t *testing.T) {
	_, s := redisDownAgent(t)
	export := entries("tenant", "acme", "route", "POST /export")
	check(t, s.connect, &allotv1.CheckRequest{Entries: export, RequestId: "r1"})
	for name, c := range map[string]allotv1connect.AdmissionServiceClient{"connect": s.connect, "grpc": s.grpc} {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_, err := c.ReleaseSlot(ctx, connect.NewRequest(&allotv1.ReleaseSlotRequest{Entries: export, RequestId: "r1"}))
		cancel()
		if connect.CodeOf(err) != connect.CodeUnavailable {
			t.Fatalf("%s: ReleaseSlot with the store down: %v, want Unavailable", name, err)
		}
		msg := err.Error()
		for _, leak := range []string{"127.0.0.1", "dial", "tcp", "refused", "cannot decide"} {
			if strings.Contains(msg, leak) {
				t.Errorf("%s: ReleaseSlot error %q contains %q", name, msg, leak)
			}
		}
		if !strings.Contains(msg, "r1") || !strings.Contains(msg, "store is unavailable") {
			t.Errorf("%s: ReleaseSlot error %q, want it to name r1 and say the store is unavailable", name, msg)
		}
	}
}
