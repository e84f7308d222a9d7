package agent

import (
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/allocator"
	"github.com/allot-dev/allot/pkg/policy"
)

const clampPolicy = `
name: clamp
regions: [eu]
rules:
  - name: q
    scope: tenant
    match: [{key: tenant, value: a}]
    kind: global_quota
    limit: 100000
    window: 1h
    lease: {chunk: 1000, ttl: 30s, clamp: true}
`

// TestPregrantCoversTheTurnGap: a pre-grant asks for a chunk plus the
// demand of the lease margin, the gap before the window's start in which
// the current window's tokens are past their deadline and requests queue
// for the pre-grant. It asked for a chunk only: at the turn the queue took
// part of it, and the pool started the window short of its renewal lead
// (the chaos suite's Birch requests waited out the starve wait at turns).
func TestPregrantCoversTheTurnGap(t *testing.T) {
	doc, err := policy.Parse([]byte(clampPolicy))
	if err != nil {
		t.Fatal(err)
	}
	st, err := admission.NewMemoryStore(admission.DefaultMemoryConfig(), nil)
	if err != nil {
		t.Fatal(err)
	}
	eng, err := admission.New(admission.DefaultConfig(), st, doc, 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { eng.Close() })
	client, err := allocator.NewClient([]string{"127.0.0.1:1"}) // never called
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(client.Close)
	cfg := DefaultLeaseConfig() // 250 ms margin
	l := newLeases(cfg, "eu", client, admission.SystemClock{}, zap.NewNop(), newMetrics(), "test", newWithdrawer(nil, "clamp"), time.Second)
	l.setPolicy(doc, eng)
	l.mu.Lock()
	defer l.mu.Unlock()
	q := l.quotas["q"]
	q.demand = 40
	end := time.Now().Truncate(time.Hour).Add(time.Hour)
	w := l.pregrant(q, end.Add(-100*time.Millisecond))
	if w == nil || !w.NextWindow {
		t.Fatalf("100 ms before the window's end at 40/s: want %+v, want a pre-grant", w)
	}
	chunk := l.sizing(q).Chunk(40)
	if want := chunk + 10; w.Tokens != want { // 40/s x 250 ms
		t.Fatalf("pre-grant of %d tokens, want a chunk (%d) plus the margin's demand (10): %d", w.Tokens, chunk, want)
	}
}
