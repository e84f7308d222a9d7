package agent_test

import (
	"context"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/redis/go-redis/v9"

	"github.com/allot-dev/allot/internal/redistest"
	"github.com/allot-dev/allot/pkg/agent"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
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

// TestReleaseSlotFreesFallbackSlotsWhileRedisIsDown: while the region's
// Redis cannot be reached, a concurrency rule in fallback mode takes slots
// in this process. ReleaseSlot must free them although it cannot reach the
// store (and say Unavailable for the store's part): they have no TTL, and it
// used to return at the store's error, so two exports filled the fallback
// for the rest of the outage.
func TestReleaseSlotFreesFallbackSlotsWhileRedisIsDown(t *testing.T) {
	addr, err := redistest.ClosedAddr()
	if err != nil {
		t.Fatal(err)
	}
	rdb := redis.NewClient(&redis.Options{Addr: addr, DialTimeout: 100 * time.Millisecond, MaxRetries: -1, DialerRetries: 1})
	t.Cleanup(func() { rdb.Close() })
	cfg := testConfig("eu")
	cfg.Engine.StoreTimeout = 100 * time.Millisecond
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(mustParse(t, fallbackSlotsPolicy), 0))).Agent
	s := serve(t, a)

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
	_, err = s.connect.ReleaseSlot(ctx, connect.NewRequest(&allotv1.ReleaseSlotRequest{Entries: export, RequestId: "r1"}))
	if connect.CodeOf(err) != connect.CodeUnavailable {
		t.Fatalf("ReleaseSlot with the store down: %v, want Unavailable (the store's part failed)", err)
	}
	if r := check(t, s.connect, &allotv1.CheckRequest{Entries: export, RequestId: "r3"}); !r.Allowed {
		t.Fatalf("export after r1's release: %+v, want allowed: r1's fallback slot is free", r)
	}
}
