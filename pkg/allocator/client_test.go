package allocator

import (
	"context"
	"errors"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// quorumLost runs a 3-node cluster, stops two of its nodes (API server and
// Raft both, as stopped processes) and waits until the third knows no
// leader. It returns the live node's address and the dead nodes' addresses.
func quorumLost(t *testing.T) (live string, dead []string) {
	t.Helper()
	tc := newTestCluster(t, 3)
	l := tc.leader()
	publishTest(t, tc.addrs, clusterPolicy, 1)
	survivor := (tc.index(l) + 1) % 3 // a follower
	for i := range tc.nodes {
		if i == survivor {
			continue
		}
		_ = tc.servers[i].Close()
		_ = tc.nodes[i].Close()
		tc.nodes[i] = nil
		dead = append(dead, tc.addrs[i])
	}
	n := tc.nodes[survivor]
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if _, api := n.Leader(); api == "" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the surviving node still knows a leader after 5s")
		}
	}
	return tc.addrs[survivor], dead
}

// TestClientQuorumLossReportsLiveNode: with two of three nodes stopped, a
// call through every endpoint fails with what the live node said (no
// leader known), not with the dial error of the last dead node tried, and
// lists what the others said; the code stays Unavailable. The dead nodes
// come first in the list, so the last attempt goes to one of them.
func TestClientQuorumLossReportsLiveNode(t *testing.T) {
	live, dead := quorumLost(t)
	c, err := NewClient([]string{dead[0], dead[1], live}, WithAttemptTimeout(time.Second), WithBackoff(10*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	check := func(t *testing.T, err error) {
		t.Helper()
		if err == nil {
			t.Fatal("the call succeeded without a quorum")
		}
		msg := err.Error()
		if !strings.Contains(msg, "no leader known") || !strings.Contains(msg, "("+live+")") {
			t.Errorf("error %q does not report the live node's answer (no leader known, from %s)", msg, live)
		}
		if want := dead[0] + ", " + dead[1] + ": connection refused"; !strings.Contains(msg, want) {
			t.Errorf("error %q does not list the dead endpoints as %q", msg, want)
		}
		if strings.Index(msg, "no leader known") > strings.Index(msg, "connection refused") {
			t.Errorf("error %q: the live node's answer does not come first", msg)
		}
		if code := connect.CodeOf(err); code != connect.CodeUnavailable {
			t.Errorf("code %v, want unavailable", code)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	t.Run("bound", func(t *testing.T) {
		_, err := c.Operator().GetBound(ctx, &allotv1.GetBoundRequest{Quota: "atlas"})
		check(t, err)
	})
	t.Run("publish", func(t *testing.T) {
		_, err := c.Operator().PublishPolicy(ctx, &allotv1.PublishPolicyRequest{Document: []byte(clusterPolicy), ExpectedVersion: 2, Author: "a", Reason: "r"})
		check(t, err)
	})
}

// TestClientQuorumLossDeadline: a call that keeps failing until the
// caller's deadline says DeadlineExceeded (errors.Is and the code) and what
// the endpoints said, the live node's "no leader known" among it.
func TestClientQuorumLossDeadline(t *testing.T) {
	live, dead := quorumLost(t)
	c, err := NewClient([]string{dead[0], live, dead[1]}, WithAttempts(1000), WithAttemptTimeout(time.Second), WithBackoff(10*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 700*time.Millisecond)
	defer cancel()
	_, err = c.Operator().GetBound(ctx, &allotv1.GetBoundRequest{})
	if err == nil {
		t.Fatal("the call succeeded without a quorum")
	}
	if !errors.Is(err, context.DeadlineExceeded) || connect.CodeOf(err) != connect.CodeDeadlineExceeded {
		t.Errorf("error %q (code %v): want one that is context.DeadlineExceeded with code deadline_exceeded", err, connect.CodeOf(err))
	}
	if msg := err.Error(); !strings.Contains(msg, "no leader known") || !strings.Contains(msg, live) || !strings.Contains(msg, "connection refused") {
		t.Errorf("error %q does not report what the endpoints said", msg)
	}
}

// TestClientFailuresSummary: the error of a call that failed everywhere
// keeps the most informative error's code and leader hint, and lists the
// endpoints with the same reason together; with one endpoint it is that
// endpoint's error as it was.
func TestClientFailuresSummary(t *testing.T) {
	refused := func(addr string) error { // as the Connect client reports a dial error
		return connect.NewError(connect.CodeUnavailable, &net.OpError{Op: "dial", Net: "tcp", Addr: tcpAddr(t, addr),
			Err: &os.SyscallError{Syscall: "connect", Err: syscall.ECONNREFUSED}})
	}
	answered := connect.NewWireError(connect.CodeUnavailable, errors.New("forward to leader 10.0.0.2:8001: not the allocator leader"))
	d, err := connect.NewErrorDetail(&allotv1.LeaderHint{LeaderId: "n2", LeaderApiAddress: "10.0.0.2:8001"})
	if err != nil {
		t.Fatal(err)
	}
	answered.AddDetail(d)

	var f failures
	f.add("10.0.0.1:8001", answered)
	f.add("10.0.0.2:8001", refused("10.0.0.2:8001"))
	f.add("10.0.0.3:8001", refused("10.0.0.3:8001"))
	f.add("10.0.0.1:8001", refused("10.0.0.1:8001")) // less informative: kept the answer
	got := f.err()
	want := "unavailable: forward to leader 10.0.0.2:8001: not the allocator leader (10.0.0.1:8001); " +
		"10.0.0.2:8001, 10.0.0.3:8001: connection refused"
	if got.Error() != want {
		t.Errorf("got  %q\nwant %q", got, want)
	}
	if connect.CodeOf(got) != connect.CodeUnavailable || LeaderHintOf(got) != "10.0.0.2:8001" {
		t.Errorf("code %v, hint %q: want unavailable and the answer's hint", connect.CodeOf(got), LeaderHintOf(got))
	}
	if !errors.Is(got, answered) {
		t.Error("the error does not wrap the answer")
	}

	var one failures
	one.add("10.0.0.1:8001", refused("10.0.0.1:8001"))
	one.add("10.0.0.1:8001", answered)
	if got := one.err(); got != answered {
		t.Errorf("one endpoint: got %v, want its answer as is", got)
	}
}

func tcpAddr(t *testing.T, addr string) *net.TCPAddr {
	t.Helper()
	a, err := net.ResolveTCPAddr("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	return a
}
