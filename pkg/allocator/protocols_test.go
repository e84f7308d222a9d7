package allocator

import (
	"context"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"connectrpc.com/connect"

	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
	"github.com/allot-dev/allot/proto/allot/v1/allotv1connect"
)

// TestProtocols calls one node with the Connect, gRPC and gRPC-Web protocols
// over h2c; each gets the same answers and the same error codes.
func TestProtocols(t *testing.T) {
	tc := newTestCluster(t, 1)
	tc.leader()
	publishTest(t, tc.addrs, clusterPolicy, 1)
	for _, tt := range []struct {
		name string
		opts []connect.ClientOption
	}{
		{"connect", nil},
		{"grpc", []connect.ClientOption{connect.WithGRPC()}},
		{"grpc-web", []connect.ClientOption{connect.WithGRPCWeb()}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c := allotv1connect.NewAllocatorServiceClient(NewHTTPClient(), "http://"+tc.addrs[0], tt.opts...)
			ctx := context.Background()
			resp, err := c.Acquire(ctx, connect.NewRequest(&allotv1.AcquireRequest{Region: "eu", RequestId: tt.name, Wants: []*allotv1.Want{{Quota: "atlas", Tokens: 10}}}))
			if err != nil {
				t.Fatal(err)
			}
			if got := resp.Msg.GetGrants()[0].GetTokens(); got != 10 {
				t.Errorf("granted %d, want 10", got)
			}
			_, err = c.Acquire(ctx, connect.NewRequest(&allotv1.AcquireRequest{Region: "eu", RequestId: tt.name + "-bad", Wants: []*allotv1.Want{{Quota: "missing"}}}))
			if connect.CodeOf(err) != connect.CodeNotFound {
				t.Errorf("unknown quota: got %v, want NotFound", err)
			}
		})
	}
}

// TestClientSkipsFrozenEndpoint puts a node that accepts calls and never
// answers (like a SIGSTOPped leader) first in the client's list: the call
// moves on after one attempt timeout and succeeds on the live node.
func TestClientSkipsFrozenEndpoint(t *testing.T) {
	tc := newTestCluster(t, 1)
	tc.leader()
	publishTest(t, tc.addrs, clusterPolicy, 1)
	thaw := make(chan struct{})
	frozen := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-thaw:
		}
	}))
	defer frozen.Close()
	defer close(thaw) // runs first: lets the handler end so Close can return
	c, err := NewClient([]string{frozen.URL, tc.addrs[0]}, WithAttemptTimeout(200*time.Millisecond), WithBackoff(10*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := c.Acquire(ctx, &allotv1.AcquireRequest{Region: "eu", RequestId: "frozen", Wants: []*allotv1.Want{{Quota: "atlas", Tokens: 1}}})
	if err != nil {
		t.Fatalf("the client did not move past the frozen endpoint: %v", err)
	}
	if resp.GetGrants()[0].GetTokens() != 1 {
		t.Errorf("granted %v", resp.GetGrants())
	}
}
