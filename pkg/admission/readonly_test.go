package admission_test

import (
	"context"
	"net"
	"sync/atomic"
	"testing"

	"github.com/redis/go-redis/v9"

	"github.com/allot-dev/allot/internal/redistest"
	"github.com/allot-dev/allot/pkg/admission"
)

// demotedPrimary is a client whose pooled connection reaches a node that a
// failover has just made a replica, as a gateway's does between the
// failover and its next dial: the name it dials (a DNS name, or what a
// Sentinel answers) already points at the new primary when moved is set.
type demotedPrimary struct {
	client  *redis.Client
	replica *redistest.Server
	primary *redistest.Server
	moved   atomic.Bool
}

func newDemotedPrimary(t *testing.T) *demotedPrimary {
	t.Helper()
	redistest.Require(t, shared.err)
	f := &demotedPrimary{primary: redistest.NewServer(t)}
	f.replica = redistest.NewServerWith(t, redistest.ServerOptions{ReplicaOf: f.primary.Addr()})
	f.client = redis.NewClient(&redis.Options{
		Addr: "redis-primary.example:6379",
		Dialer: func(ctx context.Context, network, _ string) (net.Conn, error) {
			addr := f.replica.Addr()
			if f.moved.Load() {
				addr = f.primary.Addr()
			}
			var d net.Dialer
			return d.DialContext(ctx, network, addr)
		},
		ContextTimeoutEnabled: true,
	})
	t.Cleanup(func() { f.client.Close() })
	// The connection the store's pipelines will take reaches the demoted
	// node (go-redis keeps pipelines' connections in a pool of their own),
	// which has the script, loaded before the failover: its calls fail on
	// their first write, not with NOSCRIPT.
	if _, err := f.client.Pipelined(context.Background(), func(p redis.Pipeliner) error {
		return p.ScriptLoad(context.Background(), admission.ScriptSource()).Err()
	}); err != nil {
		t.Fatal(err)
	}
	return f
}

// cmdStat returns one figure of s's INFO commandstats for cmd.
func cmdStat(t *testing.T, s *redistest.Server, cmd, field string) int64 {
	t.Helper()
	n, err := s.CommandStat(context.Background(), cmd, field)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// scriptCalls returns how many EVALSHA and EVAL calls s has run.
func scriptCalls(t *testing.T, s *redistest.Server) (evalsha, eval int64) {
	t.Helper()
	return cmdStat(t, s, "evalsha", "calls"), cmdStat(t, s, "eval", "calls")
}

func (f *demotedPrimary) backend() backend {
	return redisBackend("demoted", func(*testing.T) redis.UniversalClient { return f.client })
}

const readOnlyPolicy = `
name: readonly
rules:
  - {name: tenant, scope: tenant, match: [{key: tenant}], kind: fixed_window, limit: 10, window: 1h, fail_mode: closed}
`

// TestReadOnlyIsSentAgain: a call that meets a node a failover demoted is
// refused with READONLY before the script wrote anything, so the store
// sends it again (go-redis closed that connection, and would have retried
// it had the store's calls allowed retries). The new connection reaches the
// new primary, the decision is made there, and it is debited once.
func TestReadOnlyIsSentAgain(t *testing.T) {
	f := newDemotedPrimary(t)
	h := newHarness(t, f.backend(), parse(t, readOnlyPolicy), nil)
	f.moved.Store(true)

	d := h.decide("tenant", "atlas")
	if !d.Allowed() || d.Remaining != 9 {
		t.Fatalf("first decision after the failover: %v by %q, %d remaining; want allowed with 9 (decided by the new primary)", d.Outcome, d.Rule, d.Remaining)
	}
	if sha, src := scriptCalls(t, f.replica); sha != 1 || src != 0 {
		t.Errorf("the demoted node got %d EVALSHA and %d EVAL; want 1 and 0 (refused once)", sha, src)
	}
	if sha, src := scriptCalls(t, f.primary); sha != 0 || src != 1 {
		t.Errorf("the new primary got %d EVALSHA and %d EVAL; want 0 and 1 (the call sent again, with the script's source)", sha, src)
	}
	if d := h.decide("tenant", "atlas"); !d.Allowed() || d.Remaining != 8 {
		t.Errorf("second decision: %v, %d remaining; want allowed with 8 (one debit each)", d.Outcome, d.Remaining)
	}
	if st := h.e.Stats(); st.StoreErrors != 0 || st.FailClosed != 0 {
		t.Errorf("stats %+v: want no store error and no fail-mode decision", st)
	}
	pc := f.primary.Client()
	defer pc.Close()
	if keys := scanKeys(t, pc, h.ns+":*"); len(keys) != 1 {
		t.Errorf("the new primary holds %v; want the tenant's one window", keys)
	}
}

// TestReadOnlyResendsAreBounded: a node that keeps refusing writes (the
// name still reaches the demoted node) gets the call three times in all,
// and then the rule's fail mode decides; nothing waits past that.
func TestReadOnlyResendsAreBounded(t *testing.T) {
	f := newDemotedPrimary(t)
	h := newHarness(t, f.backend(), parse(t, readOnlyPolicy), nil)

	d := h.decide("tenant", "atlas")
	if d.Outcome != admission.Unavailable {
		t.Fatalf("decision against a replica: %v by %q; want unavailable (fail mode closed)", d.Outcome, d.Rule)
	}
	if sha, src := scriptCalls(t, f.replica); sha != 1 || src != 2 {
		t.Errorf("the demoted node got %d EVALSHA and %d EVAL; want 1 and 2 (the call, then two resends)", sha, src)
	}
	if st := h.e.Stats(); st.StoreErrors != 1 || st.FailClosed != 1 {
		t.Errorf("stats %+v: want one store error, decided by fail mode closed", st)
	}
}
