package agent_test

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/allot-dev/allot/pkg/agent"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// TestTimedOutDepositNeverOutlivesTheLease: Redis stops taking writes right
// after a grant, for longer than a deposit attempt waits but less than two
// attempts do. The attempt that timed out is still queued and lands when
// Redis resumes, counting its relative TTL from its late arrival: a second
// attempt (which the store ignores, the grant being there) must not be
// taken for the deposit, whose chunk would then outlive the lease by the
// delay. The grant must be withdrawn (its tokens 0 in the store) or expire
// by the lease's expiry minus the margin, by Redis's clock; and a deposit
// the journal calls made must be bounded by the lease.
func TestTimedOutDepositNeverOutlivesTheLease(t *testing.T) {
	rdb, fa, doc, cfg := quotasAgent(t, "10", "30s")
	cfg.StarveWait = 0
	cfg.Lease.DepositTimeout = 50 * time.Millisecond
	const pause = 75 * time.Millisecond // in (bound, 2 x bound): a retry would succeed
	var once sync.Once
	unpaused := make(chan struct{})
	fa.setHook(func(ctx context.Context, _ *allotv1.AcquireRequest, commit func() (*allotv1.AcquireResponse, error)) (*allotv1.AcquireResponse, error) {
		resp, err := commit()
		once.Do(func() {
			if e := rdb.Do(ctx, "CLIENT", "PAUSE", "2000", "WRITE").Err(); e != nil {
				t.Errorf("CLIENT PAUSE: %v", e)
			}
			time.AfterFunc(pause, func() {
				_ = rdb.Do(context.Background(), "CLIENT", "UNPAUSE").Err()
				close(unpaused)
			})
		})
		return resp, err
	})
	var (
		mu   sync.Mutex
		deps []agent.LeaseEvent
	)
	a := newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1), agent.WithLeaseObserver(func(ev agent.LeaseEvent) {
		if ev.Kind == agent.LeaseEventDeposit {
			mu.Lock()
			deps = append(deps, ev)
			mu.Unlock()
		}
	}))
	closeAtEnd(t, a)
	mustCheck(t, a, tenant("a"))
	a.Renew(context.Background())
	<-unpaused
	time.Sleep(100 * time.Millisecond) // a copy still queued has landed by now

	ctx := context.Background()
	base := cfg.Engine.Namespace + ":{t:" + doc.Rule("q-a").Match[0].Value + "}:pool:q-a"
	zs, err := rdb.ZRangeWithScores(ctx, base+":z", 0, -1).Result()
	if err != nil {
		t.Fatal(err)
	}
	if len(zs) != 1 {
		t.Fatalf("%d grants in the store, want the one deposited (or its tombstone)", len(zs))
	}
	id := zs[0].Member.(string)
	g, ok := fa.grant(id)
	if !ok {
		t.Fatalf("grant %s unknown to the allocator", id)
	}
	held, err := rdb.HGet(ctx, base+":h", "g:"+id).Int64()
	if err != nil {
		t.Fatal(err)
	}
	limit := g.ExpiresUnixMs - cfg.Lease.Margin.Milliseconds()
	if expiry := int64(zs[0].Score); held > 0 && expiry > limit {
		t.Errorf("grant %s: %d tokens spendable until %d by Redis's clock, %d ms past the lease's expiry minus the margin (%d)",
			id, held, expiry, expiry-limit, limit)
	}
	var released int64
	for _, r := range fa.releaseLog() {
		if r.GrantId == id {
			released += r.Tokens
		}
	}
	if held+released > g.Tokens {
		t.Errorf("grant %s of %d tokens: %d spendable in the store and %d handed back", id, g.Tokens, held, released)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(deps) != 1 {
		t.Fatalf("journal: %d deposit events, want 1", len(deps))
	}
	t.Logf("deposit: %s (%s), %d ms after its send; store: %d tokens held, %d handed back", deps[0].Outcome, deps[0].Err,
		(deps[0].At-deps[0].Sent)/int64(time.Millisecond), held, released)
	if d := deps[0]; d.Outcome == agent.LeaseOK && d.At+d.TTLMs*int64(time.Millisecond) > limit*int64(time.Millisecond) {
		t.Errorf("journal: deposit made, expiring by %d ns (At + TTL), after the lease's expiry minus the margin (%d ms)",
			d.At+d.TTLMs*int64(time.Millisecond), limit)
	}
}

// TestReplayedAnswerKeepsTheClockOffset: an Acquire whose answer is lost for
// over a second is retried with its request id and answered with the
// recorded result, stamped with the leader's clock when it committed. That
// stamp is not a measure of the leader's clock now: the agent's estimate of
// the offset (same machine: 0) must stay within a round trip, not move by
// the time the answer was lost.
func TestReplayedAnswerKeepsTheClockOffset(t *testing.T) {
	rdb, fa, doc, cfg := threeQuotasAgent(t)
	cfg.StarveWait = 0
	cfg.Lease.AcquireTimeout = 300 * time.Millisecond
	const lost = 1200 * time.Millisecond
	var first atomic.Int64 // the first commit, Unix ns
	fa.setHook(func(_ context.Context, _ *allotv1.AcquireRequest, commit func() (*allotv1.AcquireResponse, error)) (*allotv1.AcquireResponse, error) {
		resp, err := commit()
		first.CompareAndSwap(0, time.Now().UnixNano())
		if time.Since(time.Unix(0, first.Load())) < lost {
			return nil, connect.NewError(connect.CodeUnavailable, errors.New("test: answer lost"))
		}
		return resp, err
	})
	a := newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1))
	closeAtEnd(t, a)
	mustCheck(t, a, tenant("a"))
	waitFor(t, 10*time.Second, "the replayed grant's deposit", func() bool {
		a.Renew(context.Background())
		return a.Leases()[0].Deposits > 0
	})
	acq := fa.acquireLog()
	if len(acq) < 2 || acq[len(acq)-1].GetRequestId() != acq[0].GetRequestId() {
		t.Fatalf("%d Acquire calls, want the first and its retries with one request id", len(acq))
	}
	off, rtt := a.ClockOffset()
	if off < -rtt.Milliseconds()-1 || off > rtt.Milliseconds()+1 {
		t.Fatalf("leader clock offset %d ms after an answer lost for %s, want within the round trip %s of 0 (same machine)", off, lost, rtt)
	}
}

// TestTooLargeAcquireIsSplit: an allocator that takes fewer wants per call
// than the agent's MaxWantsPerCall refuses the batched Acquire for its size.
// That is no fault of its quotas: the agent asks again in calls the
// allocator takes, and every starved quota gets its deposit within a few
// rounds (not a quarantine, and the same call rebuilt, for good).
func TestTooLargeAcquireIsSplit(t *testing.T) {
	const limit = 2
	rdb, fa, doc, cfg := threeQuotasAgent(t)
	cfg.StarveWait = 0
	fa.setHook(func(_ context.Context, req *allotv1.AcquireRequest, commit func() (*allotv1.AcquireResponse, error)) (*allotv1.AcquireResponse, error) {
		if n := len(req.GetWants()); n > limit { // as pkg/allocator's check words it
			return nil, connect.NewError(connect.CodeInvalidArgument, fmt.Errorf("wants: %d exceeds the maximum of %d per call", n, limit))
		}
		return commit()
	})
	a := newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1))
	closeAtEnd(t, a)
	for _, ten := range []string{"a", "b", "c"} {
		mustCheck(t, a, tenant(ten))
	}
	deposited := func() bool {
		for _, s := range a.Leases() {
			if s.Deposits == 0 {
				return false
			}
		}
		return true
	}
	for i := 0; i < 4 && !deposited(); i++ {
		a.Renew(context.Background())
	}
	for _, s := range a.Leases() {
		if s.Deposits != 1 || s.Granted != 10 {
			t.Errorf("%s: %d deposits of %d tokens, want one of 10", s.Quota, s.Deposits, s.Granted)
		}
	}
	over := 0
	for _, r := range fa.acquireLog() {
		if len(r.GetWants()) > limit {
			over++
		}
	}
	if over != 1 {
		t.Errorf("%d Acquire calls over the allocator's limit, want only the first", over)
	}
}
