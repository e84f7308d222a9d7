package agent_test

import (
	"context"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/agent"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// TestEmbeddedStore runs an agent on the in-process store (WithStore, no
// Redis): it leases a global quota from the allocator into that store and
// spends it, frees concurrency slots through the engine, and on shutdown
// hands nothing back (it cannot withdraw from the store), without error.
func TestEmbeddedStore(t *testing.T) {
	ms, err := admission.NewMemoryStore(admission.DefaultMemoryConfig(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := agent.New(testConfig("eu"), sharedRedis(t), agent.WithStore(ms), agent.WithPolicy(mustParse(t, apiPolicy), 0)); err == nil {
		t.Fatal("New with both a Redis client and WithStore: nil error, want one")
	}
	if _, err := agent.New(testConfig("eu"), nil, agent.WithPolicy(mustParse(t, apiPolicy), 0)); err == nil {
		t.Fatal("New with no store: nil error, want one")
	}
	fa := startFakeAllocator(t)
	fa.publish(mustParse(t, apiPolicy))
	a := runAgent(t, newAgent(t, testConfig("eu", fa.addr), nil, agent.WithStore(ms)))
	waitFor(t, 5*time.Second, "the policy", a.Ready)
	s := serve(t, a.Agent)

	if r := check(t, s.connect, &allotv1.CheckRequest{Entries: entries("tenant", "pooled")}); !r.Allowed {
		t.Fatalf("leased pool on the embedded store: %+v, want allowed", r)
	}
	export := entries("tenant", "acme", "route", "POST /export")
	for _, id := range []string{"r1", "r2"} {
		if r := check(t, s.connect, &allotv1.CheckRequest{Entries: export, RequestId: id}); !r.Allowed {
			t.Fatalf("export %s: %+v, want allowed", id, r)
		}
	}
	if r := check(t, s.connect, &allotv1.CheckRequest{Entries: export, RequestId: "r3"}); r.Allowed || r.Rule != "exports" {
		t.Fatalf("third export: %+v, want a 429 by exports", r)
	}
	for i, want := range []int64{1, 0} { // idempotent
		resp, err := s.connect.ReleaseSlot(context.Background(), connect.NewRequest(&allotv1.ReleaseSlotRequest{Entries: export, RequestId: "r1"}))
		if err != nil || resp.Msg.Released != want {
			t.Fatalf("release %d: %v %v, want %d released", i, resp, err, want)
		}
	}
	if r := check(t, s.connect, &allotv1.CheckRequest{Entries: export, RequestId: "r3"}); !r.Allowed {
		t.Fatalf("export after the release: %+v, want allowed", r)
	}
	if err := a.stop(); err != nil {
		t.Fatalf("Run: %v", err)
	}
	if rel := fa.releaseLog(); len(rel) != 0 {
		t.Fatalf("releases on shutdown: %v, want none from the embedded store", rel)
	}
}
