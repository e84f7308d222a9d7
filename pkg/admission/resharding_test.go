package admission_test

import (
	"context"
	"fmt"
	"net"
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

// halfMoved is a Redis Cluster slot caught halfway through a move from src
// to dst (redis-cli --cluster reshard does the same steps): the slot is
// MIGRATING on src and IMPORTING on dst, and one of a tenant's two keys has
// gone to dst. A call with both keys gets TRYAGAIN from src.
type halfMoved struct {
	src, dst     *redistest.Server
	srcID, dstID string
	slot         int64
	rest         string // the key still on src
}

func moveHalf(t *testing.T, cl *redistest.Cluster, keys []string) *halfMoved {
	t.Helper()
	ctx := context.Background()
	if len(keys) != 2 {
		t.Fatalf("keys %v: want the tenant's two windows", keys)
	}
	m := &halfMoved{rest: keys[0]}
	cc := cl.Client()
	defer cc.Close()
	var err error
	if m.slot, err = cc.ClusterKeySlot(ctx, keys[0]).Result(); err != nil {
		t.Fatal(err)
	}
	for _, n := range cl.Nodes {
		if _, err := run(n, "EXISTS", keys[0]); err == nil {
			m.src = n // the others answer MOVED
		}
	}
	if m.src == nil {
		t.Fatalf("no owner of slot %d among %v", m.slot, cl.Addrs())
	}
	for _, n := range cl.Nodes {
		if n != m.src {
			m.dst = n
			break
		}
	}
	m.srcID = m.do(t, m.src, "CLUSTER", "MYID").(string)
	m.dstID = m.do(t, m.dst, "CLUSTER", "MYID").(string)
	m.do(t, m.dst, "CLUSTER", "SETSLOT", m.slot, "IMPORTING", m.srcID)
	m.do(t, m.src, "CLUSTER", "SETSLOT", m.slot, "MIGRATING", m.dstID)
	if err := m.migrate(keys[1]); err != nil {
		t.Fatal(err)
	}
	return m
}

func (m *halfMoved) do(t *testing.T, s *redistest.Server, args ...any) any {
	t.Helper()
	v, err := run(s, args...)
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func run(s *redistest.Server, args ...any) (any, error) {
	c := s.Client()
	defer c.Close()
	v, err := c.Do(context.Background(), args...).Result()
	if err != nil {
		return nil, fmt.Errorf("%v on %s: %w", args, s.Addr(), err)
	}
	return v, nil
}

func (m *halfMoved) migrate(key string) error {
	host, port, _ := net.SplitHostPort(m.dst.Addr())
	_, err := run(m.src, "MIGRATE", host, port, key, 0, 5000)
	return err
}

// finish moves the rest and gives the slot to dst on both nodes.
func (m *halfMoved) finish() error {
	if err := m.migrate(m.rest); err != nil {
		return err
	}
	for _, n := range []*redistest.Server{m.dst, m.src} {
		if _, err := run(n, "CLUSTER", "SETSLOT", m.slot, "NODE", m.dstID); err != nil {
			return err
		}
	}
	return nil
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
		m := moveHalf(t, cl, h.keys(h.ns))

		moved := make(chan error, 1)
		go func() {
			// After the first refusal, during the store's pause.
			deadline := time.Now().Add(10 * time.Second)
			for time.Now().Before(deadline) {
				if n, _ := commandStat(m.src, "evalsha", "rejected_calls"); n > 0 {
					break
				}
				time.Sleep(2 * time.Millisecond)
			}
			moved <- m.finish()
		}()
		d := h.decide("tenant", "atlas", "user", "u1")
		if err := <-moved; err != nil {
			t.Fatal(err)
		}
		if !d.Allowed() || d.Remaining != 8 {
			t.Fatalf("decision during the move: %v by %q, %d remaining; want allowed with 8 (decided on the new node, one debit)", d.Outcome, d.Rule, d.Remaining)
		}
		if got := cmdStat(t, m.src, "evalsha", "rejected_calls"); got != 1 {
			t.Errorf("the old node refused %d EVALSHA; want 1 (TRYAGAIN)", got)
		}
		if got := cmdStat(t, m.dst, "eval", "calls"); got != 1 {
			t.Errorf("the new node ran %d EVAL; want 1 (the call sent again, with the script's source)", got)
		}
		dc := m.dst.Client()
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
		m := moveHalf(t, cl, h.keys(h.ns))
		sha0, src0 := cmdStat(t, m.src, "evalsha", "rejected_calls"), cmdStat(t, m.src, "eval", "rejected_calls")

		d := h.decide("tenant", "birch", "user", "u1")
		if d.Outcome != admission.Unavailable {
			t.Fatalf("decision while the slot stays split: %v by %q; want unavailable (fail mode closed)", d.Outcome, d.Rule)
		}
		sha, src := cmdStat(t, m.src, "evalsha", "rejected_calls")-sha0, cmdStat(t, m.src, "eval", "rejected_calls")-src0
		if sha != 1 || src != 2 {
			t.Errorf("the old node refused %d EVALSHA and %d EVAL; want 1 and 2 (the call, then two resends)", sha, src)
		}
		if st := h.e.Stats(); st.StoreErrors != 1 || st.FailClosed != 1 {
			t.Errorf("stats %+v: want one store error, decided by fail mode closed", st)
		}
		if err := m.finish(); err != nil {
			t.Fatal(err)
		}
		if d := h.decide("tenant", "birch", "user", "u1"); !d.Allowed() || d.Remaining != 8 {
			t.Errorf("after the move: %v, %d remaining; want allowed with 8 (the refused call debited nothing)", d.Outcome, d.Remaining)
		}
	})
}
