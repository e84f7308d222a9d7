package admission

import (
	"context"
	"fmt"
	"slices"
	"testing"

	"github.com/allot-dev/allot/pkg/policy"
)

// heldRefundStore decides on a MemoryStore but answers every refund with a
// timeout and keeps the refund, as a RedisStore does with a call still
// waiting in its batcher when the caller gives up.
type heldRefundStore struct {
	mem  *MemoryStore
	held []*op
	keys [][]string // each held refund's keys when it was handed over
}

func (s *heldRefundStore) shard(string) int { return 0 }

func (s *heldRefundStore) run(ctx context.Context, o *op) error {
	if o.code == opRefund {
		s.held = append(s.held, o)
		s.keys = append(s.keys, slices.Clone(o.keys))
		return fmt.Errorf("held: %w", context.DeadlineExceeded)
	}
	return s.mem.run(ctx, o)
}

// TestRecycledOpsNeverChangeACallInFlight: decisions reuse their store
// calls, but a refund the store may still send keeps the keys it was given
// however many decisions follow.
func TestRecycledOpsNeverChangeACallInFlight(t *testing.T) {
	doc, err := policy.Parse([]byte(`
name: recycle
rules:
  - {name: per-ip, scope: ip, match: [{key: ip}], kind: fixed_window, limit: 1000, window: 1m}
  - {name: per-tenant, scope: tenant, match: [{key: tenant}], kind: fixed_window, limit: 1, window: 1m}
`))
	if err != nil {
		t.Fatal(err)
	}
	mem, err := NewMemoryStore(DefaultMemoryConfig(), SystemClock{})
	if err != nil {
		t.Fatal(err)
	}
	st := &heldRefundStore{mem: mem}
	e, err := New(DefaultConfig(), st, doc, 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	ctx := context.Background()
	decide := func(tenant, ip string) *Decision {
		t.Helper()
		d, err := e.Decide(ctx, &Request{Descriptors: []policy.Entry{{Key: "tenant", Value: tenant}, {Key: "ip", Value: ip}}})
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	// The ip's group (evaluated first) allows, the tenant's denies: the
	// ip's debit is refunded, and the store holds that refund.
	for i := range 2 {
		if d := decide("atlas", "10.0.0.1"); d.Allowed() != (i == 0) {
			t.Fatalf("decision %d: %v", i, d.Outcome)
		}
	}
	if len(st.held) != 1 {
		t.Fatalf("%d refunds held, want 1", len(st.held))
	}
	for i := range 50 {
		if d := decide(fmt.Sprintf("birch-%d", i), fmt.Sprintf("10.0.1.%d", i)); !d.Allowed() {
			t.Fatalf("birch %d: %v", i, d.Outcome)
		}
	}
	if got, want := st.held[0].keys, st.keys[0]; !slices.Equal(got, want) {
		t.Fatalf("the held refund's keys changed under it:\n got %q\nwant %q", got, want)
	}
}
