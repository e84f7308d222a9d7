package allocator

import (
	"context"
	"errors"
	"io"
	"math"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// TestGRPCListener sends Acquire and Release to a follower's gRPC listener
// through a Client with WithGRPCEndpoints: the follower forwards to the
// leader, a retry with the same request id is replayed (granted once), and
// bad input gets the same codes and messages as on the Connect API.
func TestGRPCListener(t *testing.T) {
	tc := newTestCluster(t, 3)
	l := tc.leader()
	follower := (tc.index(l) + 1) % 3
	publishTest(t, tc.addrs, clusterPolicy, 1)
	c, err := NewClient(tc.addrs, WithGRPCEndpoints(tc.gaddrs[follower]), WithAttempts(1))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req := &allotv1.AcquireRequest{Region: "eu", RequestId: "g1", Wants: []*allotv1.Want{{Quota: "atlas", Tokens: 100}}}
	first, err := c.Acquire(ctx, req)
	if err != nil {
		t.Fatalf("acquire through a follower's gRPC listener: %v", err)
	}
	g := first.GetGrants()[0]
	if g.GetTokens() != 100 || g.GetGrantId() == "" || first.GetReplayed() {
		t.Fatalf("first answer %v", first)
	}
	again, err := c.Acquire(ctx, req)
	if err != nil {
		t.Fatal(err)
	}
	if !again.GetReplayed() || again.GetGrants()[0].GetGrantId() != g.GetGrantId() {
		t.Fatalf("retry: %v, want the first answer replayed", again)
	}
	if _, err := c.Release(ctx, &allotv1.ReleaseRequest{Region: "eu", GrantId: g.GetGrantId(), Tokens: 30, RequestId: "rel1"}); err != nil {
		t.Fatalf("release: %v", err)
	}
	tc.waitSame()
	if w := l.FSM().CurrentWindow("atlas", first.GetLeaderNowUnixMs()); w.Granted != 100 || w.Released != 30 {
		t.Fatalf("window granted %d released %d, want 100 and 30", w.Granted, w.Released)
	}

	for _, tt := range []struct {
		name string
		req  *allotv1.AcquireRequest
		code connect.Code
		msg  string
	}{
		{"empty region", &allotv1.AcquireRequest{RequestId: "b1", Wants: []*allotv1.Want{{Quota: "atlas", Tokens: 1}}}, connect.CodeInvalidArgument, "region: must not be empty"},
		{"unknown quota", &allotv1.AcquireRequest{Region: "eu", RequestId: "b2", Wants: []*allotv1.Want{{Quota: "nope", Tokens: 1}}}, connect.CodeNotFound, "nope"},
		{"negative tokens", &allotv1.AcquireRequest{Region: "eu", RequestId: "b3", Wants: []*allotv1.Want{{Quota: "atlas", Tokens: -5}}}, connect.CodeInvalidArgument, "tokens"},
		// A NaN cannot be encoded into a Raft entry: it used to fail as
		// Internal, with every call batched into the same entry.
		{"NaN demand", &allotv1.AcquireRequest{Region: "eu", RequestId: "b4", Wants: []*allotv1.Want{{Quota: "atlas", Tokens: 1, DemandPerSecond: math.NaN()}}}, connect.CodeInvalidArgument, "wants[0].demand_per_second"},
		{"infinite demand", &allotv1.AcquireRequest{Region: "eu", RequestId: "b5", Wants: []*allotv1.Want{{Quota: "atlas", Tokens: 1}, {Quota: "atlas", DemandPerSecond: math.Inf(1)}}}, connect.CodeInvalidArgument, "wants[1].demand_per_second"},
	} {
		_, err := c.Acquire(ctx, tt.req)
		if connect.CodeOf(err) != tt.code || !strings.Contains(err.Error(), tt.msg) {
			t.Errorf("%s: %v; want %s naming %q", tt.name, err, tt.code, tt.msg)
		}
	}

	// A message over MaxBodyBytes is refused before any handler runs.
	cc, err := grpc.NewClient(tc.gaddrs[follower], grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	huge := &allotv1.AcquireRequest{Region: strings.Repeat("x", DefaultConfig().MaxBodyBytes), RequestId: "huge", Wants: req.Wants}
	if _, err := allotv1.NewAllocatorServiceClient(cc).Acquire(ctx, huge); connect.CodeOf(connectError(err)) != connect.CodeResourceExhausted {
		t.Errorf("oversized message: %v, want ResourceExhausted", err)
	}
}

// TestGRPCClientFailsOver puts a gRPC endpoint where nothing listens first:
// the call moves on to the next endpoint and succeeds there.
func TestGRPCClientFailsOver(t *testing.T) {
	tc := newTestCluster(t, 1)
	tc.leader()
	publishTest(t, tc.addrs, clusterPolicy, 1)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	ln.Close()
	c, err := NewClient(tc.addrs, WithGRPCEndpoints(dead, tc.gaddrs[0]), WithAttemptTimeout(500*time.Millisecond), WithBackoff(10*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := c.Acquire(ctx, &allotv1.AcquireRequest{Region: "eu", RequestId: "fo", Wants: []*allotv1.Want{{Quota: "atlas", Tokens: 1}}})
	if err != nil {
		t.Fatalf("the client did not move past the dead endpoint: %v", err)
	}
	if resp.GetGrants()[0].GetTokens() != 1 {
		t.Errorf("granted %v", resp.GetGrants())
	}
}

// TestGRPCErrorKeepsLeaderHint: an Unavailable error crosses gRPC with its
// code, message and leader hint, so callers read it as a Connect error.
func TestGRPCErrorKeepsLeaderHint(t *testing.T) {
	in := connect.NewError(connect.CodeUnavailable, errors.New("not the leader"))
	d, err := connect.NewErrorDetail(&allotv1.LeaderHint{LeaderId: "n2", LeaderApiAddress: "127.0.0.1:8002"})
	if err != nil {
		t.Fatal(err)
	}
	in.AddDetail(d)
	out := connectError(grpcError(in))
	if connect.CodeOf(out) != connect.CodeUnavailable || !strings.Contains(out.Error(), "not the leader") {
		t.Fatalf("got %v", out)
	}
	if h := LeaderHintOf(out); h != "127.0.0.1:8002" {
		t.Fatalf("leader hint %q, want 127.0.0.1:8002", h)
	}
	if got := connectError(grpcError(errors.New("plain"))); connect.CodeOf(got) != connect.CodeInternal {
		t.Fatalf("a non-Connect error: %v, want Internal", got)
	}
}

// lossyTransport delivers the first request whose path ends in suffix and
// then loses its answer, as a connection that breaks after the server
// committed: the client sees an error and tries again.
type lossyTransport struct {
	suffix string
	lost   atomic.Bool
}

func (l *lossyTransport) RoundTrip(r *http.Request) (*http.Response, error) {
	resp, err := http.DefaultTransport.RoundTrip(r)
	if err == nil && strings.HasSuffix(r.URL.Path, l.suffix) && l.lost.CompareAndSwap(false, true) {
		_, _ = io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		return nil, errors.New("connection reset after the request was delivered")
	}
	return resp, err
}

// lossyCluster starts a one-node cluster with clusterPolicy published and a
// client whose transport loses the first answer to a call ending in suffix.
func lossyCluster(t *testing.T, suffix string) (*Node, *Client, *lossyTransport) {
	t.Helper()
	tc := newTestCluster(t, 1)
	l := tc.leader()
	publishTest(t, tc.addrs, clusterPolicy, 1)
	lossy := &lossyTransport{suffix: suffix}
	c, err := NewClient(tc.addrs, WithHTTPClient(&http.Client{Transport: lossy}), WithBackoff(10*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	return l, c, lossy
}

// TestReleaseWithoutIDIsCreditedOnce: a Release that carries no request id
// and whose answer is lost is retried by the client; the tokens are given
// back once. Without an id the retry credited them again, and the pool could
// grant tokens the region still held.
func TestReleaseWithoutIDIsCreditedOnce(t *testing.T) {
	l, c, lossy := lossyCluster(t, "/Release")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	first, err := c.Acquire(ctx, &allotv1.AcquireRequest{Region: "eu", RequestId: "a1", Wants: []*allotv1.Want{{Quota: "atlas", Tokens: 100}}})
	if err != nil {
		t.Fatal(err)
	}
	g := first.GetGrants()[0]
	if _, err := c.Release(ctx, &allotv1.ReleaseRequest{Region: "eu", GrantId: g.GetGrantId(), Tokens: 30}); err != nil {
		t.Fatalf("release: %v", err)
	}
	if !lossy.lost.Load() {
		t.Fatal("the transport lost no answer: the test proved nothing")
	}
	if w := l.FSM().CurrentWindow("atlas", first.GetLeaderNowUnixMs()); w.Granted != 100 || w.Released != 30 {
		t.Fatalf("window granted %d released %d, want 100 and 30 (the retried release credited once)", w.Granted, w.Released)
	}
}

// TestConditionalPublishWhoseAnswerIsLost: a conditional publish commits,
// its answer is lost, and the client's retry is refused as stale. The
// client reports the success it was (the record at the expected version is
// this request's), while a stale publish of someone else's stays refused.
func TestConditionalPublishWhoseAnswerIsLost(t *testing.T) {
	_, c, lossy := lossyCluster(t, "/PublishPolicy")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := c.Operator().PublishPolicy(ctx, &allotv1.PublishPolicyRequest{Document: []byte(clusterPolicy), ExpectedVersion: 2, Author: "alice", Reason: "retune"})
	if !lossy.lost.Load() {
		t.Fatal("the transport lost no answer: the test proved nothing")
	}
	if err != nil || resp.GetPolicy().GetVersion() != 2 || resp.GetPolicy().GetAuthor() != "alice" {
		t.Fatalf("publish whose answer was lost: %v, %v; want version 2 by alice", resp, err)
	}
	_, err = c.Operator().PublishPolicy(ctx, &allotv1.PublishPolicyRequest{Document: []byte(clusterPolicy), ExpectedVersion: 2, Author: "bob", Reason: "another change"})
	if connect.CodeOf(err) != connect.CodeFailedPrecondition {
		t.Fatalf("bob's stale publish: %v, want FailedPrecondition", err)
	}
}
