package admission

import (
	"context"
	"testing"
	"time"

	"github.com/allot-dev/allot/internal/redistest"
)

// TestAnsweredCallsDoNotWaitForResends: of one pipeline's two calls, the one
// Redis Cluster refuses with TRYAGAIN (its pool's two keys split by a slot
// move) waits out the pause before its resend; the one answered at once is
// settled before that pause, and the refused one is answered once the move
// is done.
func TestAnsweredCallsDoNotWaitForResends(t *testing.T) {
	cl := redistest.NewCluster(t)
	client := cl.Client()
	t.Cleanup(func() { client.Close() })
	cfg := DefaultRedisConfig()
	cfg.PipelineTimeout = 20 * time.Second // longer than the pause below
	s, err := NewRedisStore(client, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { s.Close() })
	const pause = 3 * time.Second
	s.pause = pause

	ctx := context.Background()
	newOp := func(code byte, keys []string) *op {
		return &op{code: code, keys: keys, member: "g1", n1: 100, n2: 600000, done: make(chan struct{}, 1)}
	}
	pool := func(tenant string) []string {
		keys := []string{"{t:" + tenant + "}:z", "{t:" + tenant + "}:h"}
		o := newOp(opDeposit, keys)
		s.exec([]*op{o})
		if o.err != nil {
			t.Fatalf("deposit into %s: %v", tenant, o.err)
		}
		return keys
	}
	split, whole := pool("split"), pool("whole")
	m, err := cl.StartMove(ctx, split[0], split[1])
	if err != nil {
		t.Fatal(err)
	}

	refused, answered := newOp(opStats, split), newOp(opStats, whole)
	start := time.Now()
	go s.exec([]*op{refused, answered})
	select {
	case <-answered.done:
	case <-time.After(pause - 500*time.Millisecond):
		t.Fatalf("the answered call was not settled within %s: it waited for the other's resend", pause-500*time.Millisecond)
	}
	if answered.err != nil || len(answered.out) == 0 || answered.out[0] != 100 {
		t.Fatalf("answered call: %v %v; want the pool's 100 tokens", answered.out, answered.err)
	}
	select {
	case <-refused.done:
		t.Fatalf("the refused call settled after %s, before its resend: %v", time.Since(start), refused.err)
	default:
	}
	if err := m.Finish(ctx, split[0]); err != nil {
		t.Fatal(err)
	}
	select {
	case <-refused.done:
	case <-time.After(15 * time.Second):
		t.Fatal("the refused call never settled")
	}
	if refused.err != nil || len(refused.out) == 0 || refused.out[0] != 100 {
		t.Errorf("refused call after the move: %v %v; want the pool's 100 tokens, from the new node", refused.out, refused.err)
	}
}
