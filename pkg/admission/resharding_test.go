package admission_test

import (
	"context"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/allot-dev/allot/internal/redistest"
	"github.com/allot-dev/allot/pkg/admission"
)

const reshardPolicy = `
name: reshard
rules:
  - {name: tenant, scope: tenant, match: [{key: tenant}], kind: fixed_window, limit: 10, window: 1h, fail_mode: closed}
  - {name: user, scope: user, match: [{key: tenant}, {key: user}], kind: fixed_window, limit: 10, window: 1h, fail_mode: closed}
`

// moveHalf begins moving the slot of a tenant's two keys to another master
// and migrates one of them: a call with both keys then gets TRYAGAIN. The
// other key is the one Finish must still move.
func moveHalf(t *testing.T, cl *redistest.Cluster, keys []string) (*redistest.SlotMove, string) {
	t.Helper()
	if len(keys) != 2 {
		t.Fatalf("keys %v: want the tenant's two windows", keys)
	}
	m, err := cl.StartMove(context.Background(), keys[0], keys[1])
	if err != nil {
		t.Fatal(err)
	}
	return m, keys[0]
}

// TestTryAgainIsSentAgain: while Redis Cluster moves a tenant's slot, a
// decision whose keys are split between the two nodes is refused with
// TRYAGAIN before it runs. The store pauses and sends it again (go-redis
// would have retried it, had the store's calls allowed retries); once the
// move is done the call follows the slot to its new node and is decided
// there, debited once. While the slot stays split, the call goes three
// times and the rules' fail mode decides.
func TestTryAgainIsSentAgain(t *testing.T) {
	redistest.Require(t, shared.err)
	cl := redistest.NewCluster(t)
	client := cl.Client()
	t.Cleanup(func() { client.Close() })

	t.Run("moved meanwhile", func(t *testing.T) {
		// The pause is long enough for the test to finish the move after
		// the first refusal, on a loaded machine too.
		b := redisBackend("cluster", func(*testing.T) redis.UniversalClient { return client }, admission.WithResendPause(300*time.Millisecond))
		h := newHarness(t, b, parse(t, reshardPolicy), nil)
		wantAllowed(t, h.decide("tenant", "atlas", "user", "u1"), "before the move")
		m, rest := moveHalf(t, cl, h.keys(h.ns))

		moved := make(chan error, 1)
		go func() {
			// After the first refusal, during the store's pause.
			deadline := time.Now().Add(10 * time.Second)
			for time.Now().Before(deadline) {
				if n, _ := m.Src.CommandStat(context.Background(), "evalsha", "rejected_calls"); n > 0 {
					break
				}
				time.Sleep(2 * time.Millisecond)
			}
			moved <- m.Finish(context.Background(), rest)
		}()
		d := h.decide("tenant", "atlas", "user", "u1")
		if err := <-moved; err != nil {
			t.Fatal(err)
		}
		if !d.Allowed() || d.Remaining != 8 {
			t.Fatalf("decision during the move: %v by %q, %d remaining; want allowed with 8 (decided on the new node, one debit)", d.Outcome, d.Rule, d.Remaining)
		}
		if got := cmdStat(t, m.Src, "evalsha", "rejected_calls"); got != 1 {
			t.Errorf("the old node refused %d EVALSHA; want 1 (TRYAGAIN)", got)
		}
		if got := cmdStat(t, m.Dst, "eval", "calls"); got != 1 {
			t.Errorf("the new node ran %d EVAL; want 1 (the call sent again, with the script's source)", got)
		}
		dc := m.Dst.Client()
		defer dc.Close()
		if n, err := dc.Exists(context.Background(), h.keys(h.ns)...).Result(); err != nil || n != 2 {
			t.Errorf("the new node holds %d of the tenant's 2 keys (%v)", n, err)
		}
		if st := h.e.Stats(); st.StoreErrors != 0 || st.FailClosed != 0 {
			t.Errorf("stats %+v: want no store error and no fail-mode decision", st)
		}
		if d := h.decide("tenant", "atlas", "user", "u1"); !d.Allowed() || d.Remaining != 7 {
			t.Errorf("next decision: %v, %d remaining; want allowed with 7", d.Outcome, d.Remaining)
		}
	})

	t.Run("still split", func(t *testing.T) {
		b := redisBackend("cluster", func(*testing.T) redis.UniversalClient { return client })
		h := newHarness(t, b, parse(t, reshardPolicy), nil)
		wantAllowed(t, h.decide("tenant", "birch", "user", "u1"), "before the move")
		m, rest := moveHalf(t, cl, h.keys(h.ns))
		sha0, src0 := cmdStat(t, m.Src, "evalsha", "rejected_calls"), cmdStat(t, m.Src, "eval", "rejected_calls")

		d := h.decide("tenant", "birch", "user", "u1")
		if d.Outcome != admission.Unavailable {
			t.Fatalf("decision while the slot stays split: %v by %q; want unavailable (fail mode closed)", d.Outcome, d.Rule)
		}
		sha, src := cmdStat(t, m.Src, "evalsha", "rejected_calls")-sha0, cmdStat(t, m.Src, "eval", "rejected_calls")-src0
		if sha != 1 || src != 2 {
			t.Errorf("the old node refused %d EVALSHA and %d EVAL; want 1 and 2 (the call, then two resends)", sha, src)
		}
		if st := h.e.Stats(); st.StoreErrors != 1 || st.FailClosed != 1 {
			t.Errorf("stats %+v: want one store error, decided by fail mode closed", st)
		}
		if err := m.Finish(context.Background(), rest); err != nil {
			t.Fatal(err)
		}
		if d := h.decide("tenant", "birch", "user", "u1"); !d.Allowed() || d.Remaining != 8 {
			t.Errorf("after the move: %v, %d remaining; want allowed with 8 (the refused call debited nothing)", d.Outcome, d.Remaining)
		}
	})
}
