package allocator

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/allot-dev/allot/fsm"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

const clusterPolicy = `
name: cluster-test
regions: [eu, us]
rules:
  - name: atlas
    scope: tenant
    match: [{key: tenant, value: atlas}]
    kind: global_quota
    limit: 1000
    window: 1h
    lease: {chunk: 100, ttl: 15s, clamp: true}
`

func publishTest(t *testing.T, addrs []string, doc string, version uint64) {
	t.Helper()
	c, err := NewClient(addrs)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := c.Operator().PublishPolicy(ctx, &allotv1.PublishPolicyRequest{Document: []byte(doc), ExpectedVersion: version, Author: "test", Reason: "test"}); err != nil {
		t.Fatalf("publish: %v", err)
	}
}

func acquireOn(t *testing.T, n *Node, region, id string, tokens int64) *fsm.AcquireResult {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	out, err := n.Apply(ctx, fsm.Command{Type: fsm.CmdAcquire, Acquire: &fsm.Acquire{Region: region, RequestID: id, Wants: []fsm.Want{{Quota: "atlas", Tokens: tokens}}}})
	if err != nil {
		t.Fatalf("acquire %s on %s: %v", id, n.ID(), err)
	}
	return out.(*fsm.AcquireResult)
}

// TestClusterForwardsAndReplicates sends every call to a follower: it must be
// forwarded to the leader and the state replicated byte for byte.
func TestClusterForwardsAndReplicates(t *testing.T) {
	tc := newTestCluster(t, 3)
	l := tc.leader()
	follower := tc.addrs[(tc.index(l)+1)%3]
	publishTest(t, []string{follower}, clusterPolicy, 1)

	c, err := NewClient([]string{follower}, WithAttempts(1))
	if err != nil {
		t.Fatal(err)
	}
	f := tc.nodes[(tc.index(l)+1)%3]
	fwd0, fgrants0, lgrants0, ltokens0 := testutil.ToFloat64(f.metrics.Forwarded), testutil.ToFloat64(f.metrics.Grants),
		testutil.ToFloat64(l.metrics.Grants), testutil.ToFloat64(l.metrics.TokensGranted)
	ctx := context.Background()
	resp, err := c.Acquire(ctx, &allotv1.AcquireRequest{Region: "eu", RequestId: "r1", Wants: []*allotv1.Want{{Quota: "atlas", Tokens: 100}}})
	if err != nil {
		t.Fatalf("acquire through a follower: %v", err)
	}
	if g := resp.GetGrants()[0]; g.GetTokens() != 100 || g.GetGrantId() == "" || g.GetExpiresUnixMs() > g.GetWindowEndUnixMs() {
		t.Fatalf("unexpected grant %v", g)
	}
	// The follower forwarded the call once and granted nothing itself; the
	// leader answered it: one grant of 100 tokens.
	if got := testutil.ToFloat64(f.metrics.Forwarded) - fwd0; got != 1 {
		t.Errorf("follower %s forwarded %v calls, want 1", f.ID(), got)
	}
	if got := testutil.ToFloat64(f.metrics.Grants) - fgrants0; got != 0 {
		t.Errorf("follower %s counted %v grants, want 0 (the leader grants)", f.ID(), got)
	}
	if got := testutil.ToFloat64(l.metrics.Grants) - lgrants0; got != 1 {
		t.Errorf("leader %s counted %v grants, want 1", l.ID(), got)
	}
	if got := testutil.ToFloat64(l.metrics.TokensGranted) - ltokens0; got != 100 {
		t.Errorf("leader %s counted %v tokens granted, want 100", l.ID(), got)
	}
	tc.waitSame()
	for _, n := range tc.nodes {
		w := n.FSM().CurrentWindow("atlas", resp.GetLeaderNowUnixMs())
		if w.Granted != 100 || w.Remaining != 900 {
			t.Errorf("%s: granted %d remaining %d, want 100 and 900", n.ID(), w.Granted, w.Remaining)
		}
	}
}

// TestClusterLeaderLossKeepsAcknowledgedGrants crashes the leader (no
// leadership transfer) and checks a new leader is elected that holds every
// grant the old one acknowledged.
func TestClusterLeaderLossKeepsAcknowledgedGrants(t *testing.T) {
	tc := newTestCluster(t, 3)
	publishTest(t, tc.addrs, clusterPolicy, 1)
	l := tc.leader()
	var ids []string
	for i := 0; i < 5; i++ {
		res := acquireOn(t, l, "eu", fmt.Sprintf("r%d", i), 100)
		ids = append(ids, res.Grants[0].GrantID)
	}
	i := tc.index(l)
	tc.isolate(i)
	if err := l.raft.Shutdown().Error(); err != nil { // a crash: no transfer
		t.Fatal(err)
	}
	tc.nodes[i] = nil
	start := time.Now()
	nl := tc.leader()
	t.Logf("new leader %s after %s", nl.ID(), time.Since(start).Round(time.Millisecond))
	if err := nl.Barrier(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		if g, ok := nl.FSM().Grant(id); !ok || g.Tokens != 100 {
			t.Errorf("grant %s lost in failover (found %v)", id, ok)
		}
	}
	// A retry of an acknowledged request on the new leader grants nothing new.
	res := acquireOn(t, nl, "eu", "r0", 100)
	if !res.Replayed || res.Grants[0].GrantID != ids[0] {
		t.Errorf("retry after failover: replayed=%v grant=%s, want replay of %s", res.Replayed, res.Grants[0].GrantID, ids[0])
	}
	// Only 500 of 1000 were granted, so 500 remain: the pool was not reset.
	res = acquireOn(t, nl, "us", "r-new", 1000)
	if res.Grants[0].Tokens != 500 {
		t.Errorf("after failover granted %d, want the 500 that remain", res.Grants[0].Tokens)
	}
}

// TestClusterPartitionedLeaderCannotGrant isolates the leader: it cannot
// commit, the majority elects a new leader and keeps granting, and after the
// partition heals every node converges on the majority's state.
func TestClusterPartitionedLeaderCannotGrant(t *testing.T) {
	tc := newTestCluster(t, 3)
	publishTest(t, tc.addrs, clusterPolicy, 1)
	old := tc.leader()
	before := acquireOn(t, old, "eu", "before", 100)
	tc.isolate(tc.index(old))

	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	_, err := old.Apply(ctx, fsm.Command{Type: fsm.CmdAcquire, Acquire: &fsm.Acquire{Region: "eu", RequestID: "minority", Wants: []fsm.Want{{Quota: "atlas", Tokens: 100}}}})
	cancel()
	if err == nil {
		t.Fatal("an isolated leader committed a grant")
	}
	var nl *Node
	deadline := time.Now().Add(5 * time.Second)
	for nl == nil && time.Now().Before(deadline) {
		for _, n := range tc.nodes {
			if n != old && n.IsLeader() {
				nl = n
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	if nl == nil {
		t.Fatal("majority elected no leader")
	}
	majority := acquireOn(t, nl, "us", "majority", 300)
	tc.heal()
	tc.waitSame()
	// FSM.Grant takes grant ids, and the minority's never got one: every
	// node holds exactly the two committed grants, so none holds a record
	// of the minority's uncommitted entry.
	for _, n := range tc.nodes {
		for _, g := range []fsm.GrantResult{before.Grants[0], majority.Grants[0]} {
			if v, ok := n.FSM().Grant(g.GrantID); !ok || v.Tokens != g.Tokens {
				t.Errorf("%s: committed grant %s = %+v, %v; want %d tokens", n.ID(), g.GrantID, v, ok, g.Tokens)
			}
		}
		if got := n.FSM().Stats().Grants; got != 2 {
			t.Errorf("%s holds %d grant records, want the 2 committed (the minority's uncommitted grant kept?)", n.ID(), got)
		}
		w := n.FSM().CurrentWindow("atlas", n.FSM().Now())
		if w.Granted != 400 {
			t.Errorf("%s: granted %d, want 400 (100 before + 300 on the majority)", n.ID(), w.Granted)
		}
	}
	// Nor does the cluster remember the minority's request id: its retry
	// is a new request, granted afresh, not a replay.
	if res := acquireOn(t, tc.leader(), "eu", "minority", 100); res.Replayed || res.Grants[0].Tokens != 100 {
		t.Errorf("retry of the minority's request: replayed %v, granted %d; want a new grant of 100", res.Replayed, res.Grants[0].Tokens)
	}
}

// TestClusterSnapshotInstall lets a follower fall behind a compacted log, so
// it can only catch up by installing the leader's snapshot.
func TestClusterSnapshotInstall(t *testing.T) {
	tc := newTestCluster(t, 3)
	publishTest(t, tc.addrs, clusterPolicy, 1)
	l := tc.leader()
	lagger := (tc.index(l) + 1) % 3
	tc.isolate(lagger)
	// The isolated node may have been... only the majority matters now.
	l = tc.leader()
	for i := 0; i < 9; i++ {
		acquireOn(t, l, []string{"eu", "us"}[i%2], fmt.Sprintf("r%d", i), 100)
	}
	// Compact the log of every node of the majority, so that whichever of
	// them leads when the follower is back (a busy machine may move the
	// leadership) cannot send it entries.
	majority := make([]*Node, 0, 2)
	for i, n := range tc.nodes {
		if i != lagger {
			majority = append(majority, n)
		}
	}
	for _, n := range majority {
		rc := n.raft.ReloadableConfig()
		rc.TrailingLogs = 1
		rc.SnapshotThreshold = 1
		if err := n.raft.ReloadConfig(rc); err != nil {
			t.Fatal(err)
		}
	}
	acquireOn(t, tc.leader(), "eu", "r-last", 50)
	for _, n := range majority {
		if err := n.raft.Snapshot().Error(); err != nil {
			t.Fatalf("snapshot on %s: %v", n.ID(), err)
		}
	}
	tc.heal()
	tc.waitSame()
	if got := tc.nodes[lagger].raft.Stats()["last_snapshot_index"]; got == "0" {
		t.Errorf("the lagging follower caught up without installing a snapshot")
	}
	if w := tc.nodes[lagger].FSM().CurrentWindow("atlas", tc.nodes[lagger].FSM().Now()); w.Granted != 950 {
		t.Errorf("lagging follower after snapshot install: granted %d, want 950", w.Granted)
	}
}

// TestWatchPolicyStreamsNewVersions watches from a follower and receives
// every version published after the watch's starting point, in order.
func TestWatchPolicyStreamsNewVersions(t *testing.T) {
	tc := newTestCluster(t, 3)
	l := tc.leader()
	publishTest(t, tc.addrs, clusterPolicy, 1)
	follower := tc.addrs[(tc.index(l)+1)%3]
	c, err := NewClient([]string{follower})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	stream, err := c.Operator().WatchPolicy(ctx, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	publishTest(t, tc.addrs, strings.Replace(clusterPolicy, "limit: 1000", "limit: 900", 1), 2)
	publishTest(t, tc.addrs, strings.Replace(clusterPolicy, "limit: 1000", "limit: 800", 1), 3)
	var got []uint64
	for len(got) < 3 && stream.Receive() {
		got = append(got, stream.Msg().GetPolicy().GetVersion())
	}
	if err := stream.Err(); err != nil && len(got) < 3 {
		t.Fatalf("stream: %v", err)
	}
	if !slices.Equal(got, []uint64{1, 2, 3}) {
		t.Fatalf("watch delivered versions %v, want [1 2 3]", got)
	}
	// A watch after version 3 delivers nothing until a newer one exists.
	// (Headers travel with the first message, so opening may itself wait
	// until the deadline: that too means nothing was delivered.)
	wctx, wcancel := context.WithTimeout(ctx, 500*time.Millisecond)
	defer wcancel()
	s2, err := c.Operator().WatchPolicy(wctx, 3)
	if connect.CodeOf(err) == connect.CodeDeadlineExceeded {
		return
	}
	if err != nil {
		t.Fatal(err)
	}
	if s2.Receive() {
		t.Errorf("watch after the current version delivered version %d", s2.Msg().GetPolicy().GetVersion())
	}
}

// TestReleaseRetryIsIdempotent releases part of a grant, then retries the
// same call (as after a lost answer): the tokens go back once.
func TestReleaseRetryIsIdempotent(t *testing.T) {
	tc := newTestCluster(t, 1)
	tc.leader()
	publishTest(t, tc.addrs, clusterPolicy, 1)
	c, err := NewClient(tc.addrs)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	acq, err := c.Acquire(ctx, &allotv1.AcquireRequest{Region: "eu", RequestId: "a", Wants: []*allotv1.Want{{Quota: "atlas", Tokens: 100}}})
	if err != nil {
		t.Fatal(err)
	}
	rel := &allotv1.ReleaseRequest{Region: "eu", GrantId: acq.GetGrants()[0].GetGrantId(), Tokens: 30, RequestId: "rel-1"}
	first, err := c.Release(ctx, rel)
	if err != nil {
		t.Fatal(err)
	}
	again, err := c.Release(ctx, rel)
	if err != nil {
		t.Fatal(err)
	}
	if first.GetReturned() != 30 || first.GetReplayed() || !again.GetReplayed() || again.GetReturned() != 30 {
		t.Errorf("first %+v, retry %+v: want 30 returned once, the retry replayed", first, again)
	}
	w, err := c.Operator().GetWindow(ctx, &allotv1.GetWindowRequest{Quota: "atlas"})
	if err != nil {
		t.Fatal(err)
	}
	if w.GetReleased() != 30 || w.GetRemaining() != 930 {
		t.Errorf("ledger: released %d remaining %d, want 30 and 930", w.GetReleased(), w.GetRemaining())
	}
}

// TestPublishedHeldCapIsEnforced: a policy's lease.max_held_per_region
// reaches the state machine through the allocator, so the bound that GetBound
// states with it holds: a region at its cap is granted nothing more, and
// another region is not held back.
func TestPublishedHeldCapIsEnforced(t *testing.T) {
	tc := newTestCluster(t, 1)
	publishTest(t, tc.addrs, strings.Replace(clusterPolicy, "lease: {chunk: 100, ttl: 15s, clamp: true}",
		"lease: {chunk: 100, ttl: 15s, clamp: false, max_held_per_region: 150}", 1), 1)
	c, err := NewClient(tc.addrs)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, tt := range []struct {
		region, id string
		want       int64
	}{{"eu", "r1", 100}, {"eu", "r2", 50}, {"eu", "r3", 0}, {"us", "r4", 100}} {
		resp, err := c.Acquire(ctx, &allotv1.AcquireRequest{Region: tt.region, RequestId: tt.id, Wants: []*allotv1.Want{{Quota: "atlas", Tokens: 100}}})
		if err != nil {
			t.Fatal(err)
		}
		if got := resp.GetGrants()[0].GetTokens(); got != tt.want {
			t.Errorf("%s %s: granted %d, want %d (cap 150 per region)", tt.region, tt.id, got, tt.want)
		}
	}
	b, err := c.Operator().GetBound(ctx, &allotv1.GetBoundRequest{Quota: "atlas"})
	if err != nil {
		t.Fatal(err)
	}
	// Clamp off: carry-over is what two regions can hold, 2 x 150.
	found := false
	for _, term := range b.GetBounds()[0].GetTerms() {
		if term.GetName() == "carry_over" {
			found = true
			if term.GetTokens() != 300 {
				t.Errorf("carry_over %d, want 300: %s", term.GetTokens(), term.GetAssumption())
			}
		}
	}
	if !found {
		t.Errorf("the bound has no carry_over term: %v", b.GetBounds()[0].GetTerms())
	}
}
