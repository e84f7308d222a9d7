package allocator

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"go.uber.org/zap/zaptest"

	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
	"github.com/allot-dev/allot/proto/allot/v1/allotv1connect"
)

// TestAddMemberRejectsBadInput sends AddMember calls whose id or addresses
// could never make a working voter: each is refused with InvalidArgument
// naming the field, and the single voter keeps its quorum of one.
func TestAddMemberRejectsBadInput(t *testing.T) {
	tc := newTestCluster(t, 1)
	l := tc.leader()
	c, err := NewClient(tc.addrs, WithAttempts(1))
	if err != nil {
		t.Fatal(err)
	}
	const raftOK, apiOK = "127.0.0.1:7004", "127.0.0.1:8004"
	tests := []struct {
		name          string
		id, raft, api string
		field         string
	}{
		{"raft address without port", "a4", "not an addr", apiOK, "raft_address"},
		{"api address without port", "a4", raftOK, "x y", "api_address"},
		{"raft address without host", "a4", ":7004", apiOK, "raft_address"},
		{"unspecified raft host", "a4", "0.0.0.0:7004", apiOK, "raft_address"},
		{"unspecified api host", "a4", raftOK, "[::]:8004", "api_address"},
		{"raft port zero", "a4", "127.0.0.1:0", apiOK, "raft_address"},
		{"raft port too large", "a4", "127.0.0.1:65536", apiOK, "raft_address"},
		{"named api port", "a4", raftOK, "127.0.0.1:http", "api_address"},
		{"api address with a path", "a4", raftOK, "127.0.0.1:8004/x", "api_address"},
		{"host with a space", "a4", "my host:7004", apiOK, "raft_address"},
		{"too long api address", "a4", raftOK, strings.Repeat("h", 300) + ":8004", "api_address"},
		{"id with a space", "a 4", raftOK, apiOK, "id"},
		{"id with =", "a=4", raftOK, apiOK, "id"},
		{"id with a control character", "a4\n", raftOK, apiOK, "id"},
		{"too long id", strings.Repeat("a", 300), raftOK, apiOK, "id"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_, err := c.Operator().AddMember(ctx, &allotv1.AddMemberRequest{Id: tt.id, RaftAddress: tt.raft, ApiAddress: tt.api})
			if connect.CodeOf(err) != connect.CodeInvalidArgument {
				t.Fatalf("got %v (code %v), want InvalidArgument", err, connect.CodeOf(err))
			}
			if !strings.Contains(err.Error(), tt.field+":") {
				t.Errorf("message %q does not name %s", err.Error(), tt.field)
			}
		})
	}
	members, err := l.Members()
	if err != nil {
		t.Fatal(err)
	}
	if len(members) != 1 || members[0].ID != "n1" || !l.IsLeader() {
		t.Fatalf("membership after refused calls: %+v (leader %v), want n1 alone and leading", members, l.IsLeader())
	}
	if m := l.FSM().Members(); len(m) > 1 {
		t.Fatalf("member table after refused calls: %v", m)
	}
}

// TestListPoliciesDigests publishes two documents: the history lists each
// version with the digest publish and get returned, not one digest for all.
func TestListPoliciesDigests(t *testing.T) {
	tc := newTestCluster(t, 1)
	tc.leader()
	c, err := NewClient(tc.addrs)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	op := c.Operator()
	var published []string
	for i, doc := range []string{clusterPolicy, strings.Replace(clusterPolicy, "limit: 1000", "limit: 900", 1)} {
		pub, err := op.PublishPolicy(ctx, &allotv1.PublishPolicyRequest{Document: []byte(doc), ExpectedVersion: uint64(i + 1), Author: "test", Reason: "test"})
		if err != nil {
			t.Fatal(err)
		}
		got, err := op.GetPolicy(ctx, &allotv1.GetPolicyRequest{Version: uint64(i + 1)})
		if err != nil {
			t.Fatal(err)
		}
		sum := sha256.Sum256(got.GetPolicy().GetDocument())
		if d := pub.GetPolicy().GetDigest(); d != got.GetPolicy().GetDigest() || d != hex.EncodeToString(sum[:]) {
			t.Fatalf("version %d: publish digest %s, get %s, sha256 of the document %x", i+1, d, got.GetPolicy().GetDigest(), sum)
		}
		published = append(published, pub.GetPolicy().GetDigest())
	}
	if published[0] == published[1] {
		t.Fatalf("two documents, one digest %s", published[0])
	}
	list, err := op.ListPolicies(ctx, &allotv1.ListPoliciesRequest{})
	if err != nil {
		t.Fatal(err)
	}
	ps := list.GetPolicies()
	if len(ps) != 2 {
		t.Fatalf("history of %d versions, want 2", len(ps))
	}
	for _, p := range ps { // newest first
		v := p.GetVersion()
		if v < 1 || v > 2 || p.GetDigest() != published[v-1] {
			t.Errorf("history version %d: digest %s, want %s", v, p.GetDigest(), published[min(max(v, 1), 2)-1])
		}
		if len(p.GetDocument()) != 0 {
			t.Errorf("history version %d carries its document", v)
		}
	}
}

// TestRunStopsWhenJoinIsRefused starts a node that asks to join with an id
// the cluster refuses: Run gives up at once with the reason instead of
// retrying until it is stopped.
func TestRunStopsWhenJoinIsRefused(t *testing.T) {
	tc := newTestCluster(t, 1)
	tc.leader()
	cfg := fastConfig("j 1", "127.0.0.1:0")
	cfg.RaftAddr, cfg.DataDir = "127.0.0.1:0", t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	start := time.Now()
	err := Run(ctx, cfg, RunOptions{Join: tc.addrs[0], ShutdownGrace: time.Second}, zaptest.NewLogger(t))
	if connect.CodeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), "id:") {
		t.Fatalf("Run() = %v, want the join's InvalidArgument naming id", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("Run took %s to give up", d)
	}
}

// TestLeaderReadsTakeBarrier: GetPolicy, ListPolicies and GetBound, like
// GetWindow, are answered by the leader after a Raft barrier (one entry in
// its log), so a leader newly elected, whose state machine may not have
// applied every committed entry yet, does not answer from behind.
func TestLeaderReadsTakeBarrier(t *testing.T) {
	tc := newTestCluster(t, 1)
	l := tc.leader()
	publishTest(t, tc.addrs, clusterPolicy, 1)
	deadline := time.Now().Add(5 * time.Second)
	for l.FSM().Members()[l.ID()] == "" { // the leader's own entries are written
		if time.Now().After(deadline) {
			t.Fatal("the leader never recorded its API address")
		}
		time.Sleep(10 * time.Millisecond)
	}
	c, err := NewClient(tc.addrs)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	op := c.Operator()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, tt := range []struct {
		name string
		call func() error
	}{
		{"GetPolicy", func() error { _, err := op.GetPolicy(ctx, &allotv1.GetPolicyRequest{}); return err }},
		{"ListPolicies", func() error { _, err := op.ListPolicies(ctx, &allotv1.ListPoliciesRequest{}); return err }},
		{"GetBound", func() error { _, err := op.GetBound(ctx, &allotv1.GetBoundRequest{}); return err }},
		{"GetWindow", func() error { _, err := op.GetWindow(ctx, &allotv1.GetWindowRequest{Quota: "atlas"}); return err }},
	} {
		before := l.Raft().LastIndex()
		if err := tt.call(); err != nil {
			t.Fatalf("%s: %v", tt.name, err)
		}
		if after := l.Raft().LastIndex(); after != before+1 {
			t.Errorf("%s: the leader's log went from %d to %d entries, want one barrier", tt.name, before, after)
		}
	}
}

// TestReleaseRequiresRequestID: a Release without a request id (a raw
// Connect or gRPC caller; the Go client always sends one) would credit its
// tokens again on every retry; it is refused, naming the field, and
// changes nothing.
func TestReleaseRequiresRequestID(t *testing.T) {
	tc := newTestCluster(t, 1)
	l := tc.leader()
	publishTest(t, tc.addrs, clusterPolicy, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	raw := allotv1connect.NewAllocatorServiceClient(NewHTTPClient(), "http://"+tc.addrs[0])
	acq, err := raw.Acquire(ctx, connect.NewRequest(&allotv1.AcquireRequest{Region: "eu", RequestId: "a", Wants: []*allotv1.Want{{Quota: "atlas", Tokens: 100}}}))
	if err != nil {
		t.Fatal(err)
	}
	g := acq.Msg.GetGrants()[0]
	_, err = raw.Release(ctx, connect.NewRequest(&allotv1.ReleaseRequest{Region: "eu", GrantId: g.GetGrantId(), Tokens: 30}))
	if connect.CodeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), "request_id:") {
		t.Fatalf("Release without request_id: %v, want InvalidArgument naming request_id", err)
	}
	if w := l.FSM().CurrentWindow("atlas", acq.Msg.GetLeaderNowUnixMs()); w.Released != 0 || w.Remaining != 900 {
		t.Fatalf("window after the refused release: released %d remaining %d, want 0 and 900", w.Released, w.Remaining)
	}
}

// TestAcquireStatesLeaseMargin: an Acquire answer carries the margin the
// stated bound assumes, so that an agent configured with a shorter one
// still ends its grants early enough for the bound to hold.
func TestAcquireStatesLeaseMargin(t *testing.T) {
	tc := newTestCluster(t, 1)
	publishTest(t, tc.addrs, clusterPolicy, 1)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	raw := allotv1connect.NewAllocatorServiceClient(NewHTTPClient(), "http://"+tc.addrs[0])
	acq, err := raw.Acquire(ctx, connect.NewRequest(&allotv1.AcquireRequest{Region: "eu", RequestId: "a", Wants: []*allotv1.Want{{Quota: "atlas", Tokens: 100}}}))
	if err != nil {
		t.Fatal(err)
	}
	want := tc.leader().Config().LeaseMargin.Milliseconds()
	if got := acq.Msg.GetLeaseMarginMs(); got != want || got <= 0 {
		t.Fatalf("lease_margin_ms %d, want the allocator's %d", got, want)
	}
}
