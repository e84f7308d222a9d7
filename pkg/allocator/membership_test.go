package allocator

import (
	"context"
	"errors"
	"net"
	"net/http"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// suffrageOf returns the suffrage of member id in n's configuration, or ""
// when id is no member.
func suffrageOf(t *testing.T, n *Node, id string) string {
	t.Helper()
	ms, err := n.Members()
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range ms {
		if m.ID == id {
			return m.Suffrage
		}
	}
	return ""
}

// TestAddUnreachableVoterKeepsLeader adds a member nothing answers for to a
// single-node cluster. Added as a voter at once, it made the quorum two of
// two, and the leader stepped down for good; it must be added as a
// non-voter, left so, and the call must say why it was not promoted.
func TestAddUnreachableVoterKeepsLeader(t *testing.T) {
	tc := newTestCluster(t, 1)
	l := tc.leader()
	c, err := NewClient(tc.addrs, WithAttempts(1), WithAttemptTimeout(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
	defer cancel()
	_, err = c.Operator().AddMember(ctx, &allotv1.AddMemberRequest{Id: "n2", RaftAddress: "n2.invalid:7002", ApiAddress: closedAddr(t)})
	if connect.CodeOf(err) != connect.CodeFailedPrecondition {
		t.Fatalf("AddMember of an unreachable node: %v (code %v), want FailedPrecondition", err, connect.CodeOf(err))
	}
	t.Logf("AddMember: %v", err)
	for _, want := range []string{"non-voter", "not promoted", "retrying AddMember promotes it"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("message %q does not say %q", err.Error(), want)
		}
	}
	time.Sleep(2 * time.Second)
	if !l.IsLeader() {
		t.Fatalf("n1 is %s 2s after the call, want still the leader", l.Raft().State())
	}
	if got := suffrageOf(t, l, "n2"); got != "Nonvoter" {
		t.Fatalf("n2 is %q, want Nonvoter", got)
	}
}

// TestAddMemberPromotesOnceCaughtUp adds a node before it runs (it stays a
// non-voter), then starts it: the retried AddMember promotes it once it has
// caught up. A further retry is a success that changes nothing; the same id
// at another Raft address, or another id at its Raft address, is refused.
func TestAddMemberPromotesOnceCaughtUp(t *testing.T) {
	tc := newTestCluster(t, 1)
	l := tc.leader()
	publishTest(t, tc.addrs, clusterPolicy, 1)
	c, err := NewClient(tc.addrs[:1], WithAttempts(1), WithAttemptTimeout(20*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	op := c.Operator()
	api := closedAddr(t)
	req := &allotv1.AddMemberRequest{Id: "n2", RaftAddress: "n2.test:7002", ApiAddress: api}

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	_, err = op.AddMember(ctx, req)
	cancel()
	if connect.CodeOf(err) != connect.CodeFailedPrecondition {
		t.Fatalf("AddMember before n2 runs: %v, want FailedPrecondition", err)
	}
	if got := suffrageOf(t, l, "n2"); got != "Nonvoter" {
		t.Fatalf("n2 is %q after the first call, want Nonvoter", got)
	}

	ln, err := net.Listen("tcp", api)
	if err != nil {
		t.Skipf("cannot listen on %s again: %v", api, err)
	}
	n2 := tc.addNode("n2", "n2.test:7002", ln)
	ctx, cancel = context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	resp, err := op.AddMember(ctx, req)
	if err != nil {
		t.Fatalf("AddMember once n2 runs: %v", err)
	}
	if !slices.ContainsFunc(resp.GetMembers(), func(m *allotv1.Member) bool { return m.GetId() == "n2" && m.GetSuffrage() == "Voter" }) {
		t.Fatalf("members %v, want n2 a voter", resp.GetMembers())
	}
	if p, ok := n2.FSM().Policy(); !ok || p.Version != 1 {
		t.Errorf("n2 was promoted before it applied the policy (%v, %v)", p.Version, ok)
	}
	if _, err := op.AddMember(ctx, req); err != nil {
		t.Errorf("AddMember of a voter at the same addresses: %v, want success", err)
	}
	for _, bad := range []*allotv1.AddMemberRequest{
		{Id: "n2", RaftAddress: "n2.test:7003", ApiAddress: api},
		{Id: "n3", RaftAddress: "n2.test:7002", ApiAddress: closedAddr(t)},
	} {
		if _, err := op.AddMember(ctx, bad); connect.CodeOf(err) != connect.CodeAlreadyExists {
			t.Errorf("AddMember(%v): %v, want AlreadyExists", bad, err)
		}
	}
	ms, err := l.Members()
	if err != nil {
		t.Fatal(err)
	}
	if len(ms) != 2 || !l.IsLeader() {
		t.Fatalf("members %+v (n1 leading: %v), want n1 and n2 with n1 leading", ms, l.IsLeader())
	}
	if a := l.FSM().Members()["n2"]; a != api {
		t.Errorf("member table holds %q for n2, want %q", a, api)
	}
}

// TestRemoveMemberKeepsQuorum cuts one follower of three off and asks to
// remove the other: the two voters left could not commit without the one
// cut off (no leader until it came back), so the call is refused, naming
// it, and the leader and the membership stay.
func TestRemoveMemberKeepsQuorum(t *testing.T) {
	tc := newTestCluster(t, 3)
	l := tc.leader()
	li := tc.index(l)
	cut, gone := tc.nodes[(li+1)%3], tc.nodes[(li+2)%3]
	tc.isolate(tc.index(cut))
	deadline := time.Now().Add(5 * time.Second)
	for id, _ := cut.Leader(); id == l.ID(); id, _ = cut.Leader() {
		if time.Now().After(deadline) {
			t.Fatalf("%s still follows %s 5s after it was cut off", cut.ID(), l.ID())
		}
		time.Sleep(10 * time.Millisecond)
	}
	c, err := NewClient([]string{tc.addrs[li]}, WithAttempts(1), WithAttemptTimeout(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = c.Operator().RemoveMember(ctx, &allotv1.RemoveMemberRequest{Id: gone.ID()})
	if connect.CodeOf(err) != connect.CodeFailedPrecondition {
		t.Fatalf("RemoveMember(%s) with %s cut off: %v (code %v), want FailedPrecondition", gone.ID(), cut.ID(), err, connect.CodeOf(err))
	}
	t.Logf("RemoveMember: %v", err)
	if !strings.Contains(err.Error(), cut.ID()+" (") {
		t.Errorf("message %q does not name %s", err.Error(), cut.ID())
	}
	time.Sleep(500 * time.Millisecond)
	if !l.IsLeader() {
		t.Fatalf("%s lost the leadership", l.ID())
	}
	if got := suffrageOf(t, l, gone.ID()); got != "Voter" {
		t.Fatalf("%s is %q, want still a voter", gone.ID(), got)
	}
}

// TestRemoveLeaderDropsItsMemberEntry removes the leader itself: it steps
// down before it can drop its own member table entry, and the next leader
// must drop it.
func TestRemoveLeaderDropsItsMemberEntry(t *testing.T) {
	tc := newTestCluster(t, 3)
	l := tc.leader()
	deadline := time.Now().Add(5 * time.Second)
	for len(l.FSM().Members()) < 3 {
		if time.Now().After(deadline) {
			t.Fatalf("member table %v, want 3 entries", l.FSM().Members())
		}
		time.Sleep(10 * time.Millisecond)
	}
	c, err := NewClient(tc.addrs, WithAttemptTimeout(10*time.Second))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := c.Operator().RemoveMember(ctx, &allotv1.RemoveMemberRequest{Id: l.ID()}); err != nil {
		t.Fatalf("remove the leader %s: %v", l.ID(), err)
	}
	deadline = time.Now().Add(5 * time.Second)
	for {
		stale := false
		for _, n := range tc.nodes {
			if n != l {
				_, has := n.FSM().Members()[l.ID()]
				stale = stale || has
			}
		}
		if !stale {
			break
		}
		if time.Now().After(deadline) {
			for _, n := range tc.nodes {
				t.Logf("%s: member table %v", n.ID(), n.FSM().Members())
			}
			t.Fatalf("the removed leader %s is still in the member table 5s later", l.ID())
		}
		time.Sleep(20 * time.Millisecond)
	}
	if nl := tc.leader(); nl == l {
		t.Fatalf("the removed %s leads", l.ID())
	}
}

// TestRemoveMemberRetryAfterLostAnswer removes a follower through a client
// that loses the first answer: the retry finds no such member, and the
// client reports the success the first attempt was.
func TestRemoveMemberRetryAfterLostAnswer(t *testing.T) {
	tc := newTestCluster(t, 3)
	l := tc.leader()
	f := tc.nodes[(tc.index(l)+1)%3]
	lossy := &lossyTransport{suffix: "/RemoveMember"}
	c, err := NewClient([]string{tc.addrs[tc.index(l)]}, WithHTTPClient(&http.Client{Transport: lossy}), WithBackoff(10*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := c.Operator().RemoveMember(ctx, &allotv1.RemoveMemberRequest{Id: f.ID()})
	if !lossy.lost.Load() {
		t.Fatal("the transport lost no answer: the test proved nothing")
	}
	if err != nil {
		t.Fatalf("RemoveMember whose answer was lost: %v, want success", err)
	}
	if len(resp.GetMembers()) != 2 || slices.ContainsFunc(resp.GetMembers(), func(m *allotv1.Member) bool { return m.GetId() == f.ID() }) {
		t.Errorf("members %v, want the two others", resp.GetMembers())
	}
	// A member that never was stays NotFound.
	if _, err := c.Operator().RemoveMember(ctx, &allotv1.RemoveMemberRequest{Id: "nobody"}); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("RemoveMember(nobody): %v, want NotFound", err)
	}
}

// undeliveredTransport fails the first request whose path ends in suffix
// without sending it, as an endpoint that refuses the connection: the client
// tries again, and the server never saw the first attempt.
type undeliveredTransport struct {
	suffix  string
	refused atomic.Bool
}

func (u *undeliveredTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	if strings.HasSuffix(r.URL.Path, u.suffix) && u.refused.CompareAndSwap(false, true) {
		if r.Body != nil {
			r.Body.Close()
		}
		return nil, errors.New("connection refused before the request was sent")
	}
	return http.DefaultTransport.RoundTrip(r)
}

// TestRemoveMemberNeverMemberStaysNotFound: removing an id that never was a
// member (a typo) is NotFound even when an earlier attempt reached no
// server: the first endpoint down, or the first attempt refused before it
// was sent. A retried NotFound used to be taken for the answer to an
// earlier attempt that committed, and the removal reported done.
func TestRemoveMemberNeverMemberStaysNotFound(t *testing.T) {
	tc := newTestCluster(t, 1)
	leader := tc.addrs[tc.index(tc.leader())]
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	remove := func(t *testing.T, c *Client) {
		t.Helper()
		defer c.Close()
		resp, err := c.Operator().RemoveMember(ctx, &allotv1.RemoveMemberRequest{Id: "n1-typo"})
		if connect.CodeOf(err) != connect.CodeNotFound {
			t.Errorf("RemoveMember(never a member): err %v, members %v; want NotFound", err, resp.GetMembers())
		}
	}
	t.Run("first endpoint down", func(t *testing.T) {
		c, err := NewClient([]string{closedAddr(t), leader}, WithBackoff(10*time.Millisecond))
		if err != nil {
			t.Fatal(err)
		}
		remove(t, c)
	})
	t.Run("first attempt undelivered", func(t *testing.T) {
		u := &undeliveredTransport{suffix: "/RemoveMember"}
		c, err := NewClient([]string{leader}, WithHTTPClient(&http.Client{Transport: u}), WithBackoff(10*time.Millisecond))
		if err != nil {
			t.Fatal(err)
		}
		remove(t, c)
		if !u.refused.Load() {
			t.Fatal("the transport refused no attempt: the test proved nothing")
		}
	})
}
