package allocator

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/proto"

	"github.com/allot-dev/allot/pkg/policy"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
	"github.com/allot-dev/allot/proto/allot/v1/allotv1connect"
)

// Client calls an allocator cluster through any of its nodes. It follows the
// leader hint of Unavailable errors and fails over across endpoints, retrying
// the same request (so an Acquire retry keeps its request id and is
// idempotent). It is safe for concurrent use.
type Client struct {
	http     *http.Client
	api      *route // the Connect API endpoints
	attempts int
	backoff  time.Duration
	perTry   time.Duration

	peers *peerClients

	// With WithGRPCEndpoints: Acquire and Release go to AllocatorService's
	// gRPC listeners over grpc-go instead.
	fast  *route
	grpc  map[string]allotv1.AllocatorServiceClient
	conns []*grpc.ClientConn
}

// route is a set of endpoints one call may try, and the one that answered
// last, which the next call tries first.
type route struct {
	endpoints []string
	hints     bool // follow leader hints (they name Connect API addresses)

	mu        sync.Mutex
	preferred string
}

func newRoute(endpoints []string, hints bool) *route {
	return &route{endpoints: append([]string(nil), endpoints...), hints: hints, preferred: endpoints[0]}
}

func (r *route) first() string {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.preferred
}

func (r *route) answered(addr string) {
	r.mu.Lock()
	r.preferred = addr
	r.mu.Unlock()
}

// Close closes the client's idle connections. A client made for a few
// calls (a probe, a poll) must be closed: its HTTP/2 connections would
// otherwise stay open, pinging their server, until they idle out.
func (c *Client) Close() {
	c.http.CloseIdleConnections()
	for _, cc := range c.conns {
		_ = cc.Close()
	}
}

// ClientOption customises a Client.
type ClientOption func(*Client)

// WithHTTPClient sets the HTTP client (default: NewHTTPClient, HTTP/2 only).
func WithHTTPClient(h *http.Client) ClientOption { return func(c *Client) { c.http = h } }

// WithAttempts sets how many endpoints or leader hints one call tries (default 6).
func WithAttempts(n int) ClientOption { return func(c *Client) { c.attempts = max(1, n) } }

// WithAttemptTimeout bounds each attempt (default 2s), so a frozen node (for
// example a SIGSTOPped leader) costs one attempt, not the caller's deadline.
func WithAttemptTimeout(d time.Duration) ClientOption { return func(c *Client) { c.perTry = d } }

// WithBackoff sets the pause between attempts (default 100ms, doubling, capped at 1s).
func WithBackoff(d time.Duration) ClientOption { return func(c *Client) { c.backoff = d } }

// WithGRPCEndpoints sends Acquire and Release to the nodes' AllocatorService
// gRPC listeners ("host:port", RunOptions.GRPCAddr) over grpc-go, which
// costs both ends about half the CPU of a Connect call on net/http. A node
// that is not the leader forwards the call, so leader hints are not
// followed on this route; failover rotates over these endpoints. The other
// calls keep using the Connect endpoints.
func WithGRPCEndpoints(addrs ...string) ClientOption {
	return func(c *Client) {
		c.fast = nil
		if len(addrs) > 0 {
			c.fast = newRoute(addrs, false)
		}
	}
}

// NewClient returns a client for the given API addresses ("host:port" or URLs).
func NewClient(endpoints []string, opts ...ClientOption) (*Client, error) {
	if len(endpoints) == 0 {
		return nil, errors.New("allocator client: no endpoints")
	}
	c := &Client{
		http: NewHTTPClient(), api: newRoute(endpoints, true),
		attempts: 6, backoff: 100 * time.Millisecond, perTry: 2 * time.Second,
	}
	for _, o := range opts {
		o(c)
	}
	c.peers = &peerClients{http: c.http, m: map[string]*peerClient{}}
	if c.fast != nil {
		c.grpc = make(map[string]allotv1.AllocatorServiceClient, len(c.fast.endpoints))
		for _, addr := range c.fast.endpoints {
			if _, ok := c.grpc[addr]; ok {
				continue
			}
			cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()), grpc.WithKeepaliveParams(grpcKeepalive))
			if err != nil {
				c.Close()
				return nil, fmt.Errorf("allocator client: gRPC endpoint %q: %w", addr, err)
			}
			c.conns = append(c.conns, cc)
			c.grpc[addr] = allotv1.NewAllocatorServiceClient(cc)
		}
	}
	return c, nil
}

func (c *Client) peer(addr string) *peerClient { return c.peers.get(addr) }

// retryable reports whether another node may answer where this one could not.
func retryable(err error) bool {
	switch connect.CodeOf(err) {
	case connect.CodeUnavailable, connect.CodeUnknown, connect.CodeAborted:
		return true
	}
	return false
}

// call runs fn against r's preferred endpoint, then leader hints and r's
// other endpoints, until it gets an answer that is not Unavailable. An
// attempt that times out on its own (not the caller's deadline) moves to
// the next endpoint.
func call[T any](ctx context.Context, c *Client, r *route, fn func(ctx context.Context, addr string) (T, error)) (T, error) {
	var (
		zero    T
		lastErr error
		pause   = c.backoff
	)
	addr := r.first()
	next := 0
	for attempt := 0; attempt < c.attempts; attempt++ {
		actx, cancel := context.WithTimeout(ctx, c.perTry)
		out, err := fn(actx, addr)
		cancel()
		if err != nil && ctx.Err() == nil && connect.CodeOf(err) == connect.CodeDeadlineExceeded {
			err = connect.NewError(connect.CodeUnavailable, fmt.Errorf("%s did not answer within %s: %w", addr, c.perTry, err))
		}
		if err == nil || !retryable(err) {
			if err == nil {
				r.answered(addr)
			}
			return out, err
		}
		lastErr = err
		if hint := LeaderHintOf(err); r.hints && hint != "" && hint != addr {
			addr = hint
			continue // a hint is worth following at once
		}
		addr = r.endpoints[next%len(r.endpoints)]
		next++
		select {
		case <-ctx.Done():
			return zero, fmt.Errorf("%w (last error: %v)", ctx.Err(), lastErr)
		case <-time.After(pause):
		}
		pause = min(2*pause, time.Second)
	}
	return zero, lastErr
}

// Acquire calls AllocatorService.Acquire.
func (c *Client) Acquire(ctx context.Context, req *allotv1.AcquireRequest) (*allotv1.AcquireResponse, error) {
	if c.fast != nil {
		return call(ctx, c, c.fast, func(ctx context.Context, addr string) (*allotv1.AcquireResponse, error) {
			r, err := c.grpc[addr].Acquire(ctx, req)
			if err != nil {
				return nil, connectError(err)
			}
			return r, nil
		})
	}
	return call(ctx, c, c.api, func(ctx context.Context, addr string) (*allotv1.AcquireResponse, error) {
		r, err := c.peer(addr).alloc.Acquire(ctx, connect.NewRequest(req))
		if err != nil {
			return nil, err
		}
		return r.Msg, nil
	})
}

// Release calls AllocatorService.Release. A request without a request_id is
// given one, so that the client's retries cannot credit the tokens twice.
func (c *Client) Release(ctx context.Context, req *allotv1.ReleaseRequest) (*allotv1.ReleaseResponse, error) {
	if req.GetRequestId() == "" {
		// The client retries a call whose answer was lost, and a Release
		// without an id would credit its tokens again on each retry (the
		// pool could then grant what the region still holds). One id for
		// every attempt makes the retries replays.
		req = proto.Clone(req).(*allotv1.ReleaseRequest)
		req.RequestId = newReleaseID()
	}
	if c.fast != nil {
		return call(ctx, c, c.fast, func(ctx context.Context, addr string) (*allotv1.ReleaseResponse, error) {
			r, err := c.grpc[addr].Release(ctx, req)
			if err != nil {
				return nil, connectError(err)
			}
			return r, nil
		})
	}
	return call(ctx, c, c.api, func(ctx context.Context, addr string) (*allotv1.ReleaseResponse, error) {
		r, err := c.peer(addr).alloc.Release(ctx, connect.NewRequest(req))
		if err != nil {
			return nil, err
		}
		return r.Msg, nil
	})
}

// Operator returns an OperatorService client bound to this client's failover
// rules: each unary method retries like Acquire does.
func (c *Client) Operator() *OperatorClient { return &OperatorClient{c: c} }

// OperatorClient calls OperatorService with failover.
type OperatorClient struct{ c *Client }

func opCall[Req, Resp any](ctx context.Context, c *Client, req *Req,
	m func(allotv1connect.OperatorServiceClient) func(context.Context, *connect.Request[Req]) (*connect.Response[Resp], error),
) (*Resp, error) {
	return call(ctx, c, c.api, func(ctx context.Context, addr string) (*Resp, error) {
		r, err := m(c.peer(addr).op)(ctx, connect.NewRequest(req))
		if err != nil {
			return nil, err
		}
		return r.Msg, nil
	})
}

// PublishPolicy calls OperatorService.PublishPolicy.
//
// The client retries a call whose answer was lost, and a conditional
// publish (expected_version set) whose first attempt committed is then
// refused as stale (FailedPrecondition) although it took effect. When a
// retried publish is refused so, PublishPolicy reads the expected version:
// when it holds this request's document (by digest), author and reason, the
// publish is reported as the success it was. A refusal at the first attempt
// stays a refusal.
func (o *OperatorClient) PublishPolicy(ctx context.Context, req *allotv1.PublishPolicyRequest) (*allotv1.PublishPolicyResponse, error) {
	var attempts atomic.Int32
	resp, err := opCall(ctx, o.c, req, func(s allotv1connect.OperatorServiceClient) func(context.Context, *connect.Request[allotv1.PublishPolicyRequest]) (*connect.Response[allotv1.PublishPolicyResponse], error) {
		attempts.Add(1)
		return s.PublishPolicy
	})
	if err == nil || attempts.Load() < 2 || req.GetExpectedVersion() == 0 || connect.CodeOf(err) != connect.CodeFailedPrecondition {
		return resp, err
	}
	if rec := o.committed(ctx, req); rec != nil {
		return &allotv1.PublishPolicyResponse{Policy: rec}, nil
	}
	return resp, err
}

// committed returns the record at req's expected version when it is req's
// own publication (the same document, author and reason), else nil.
func (o *OperatorClient) committed(ctx context.Context, req *allotv1.PublishPolicyRequest) *allotv1.PolicyRecord {
	doc, err := policy.Parse(req.GetDocument())
	if err != nil {
		return nil
	}
	got, err := o.GetPolicy(ctx, &allotv1.GetPolicyRequest{Version: req.GetExpectedVersion()})
	if err != nil {
		return nil
	}
	rec := got.GetPolicy()
	if rec.GetDigest() != policy.Digest(doc) || rec.GetAuthor() != req.GetAuthor() || rec.GetReason() != req.GetReason() {
		return nil
	}
	return rec
}

// GetPolicy calls OperatorService.GetPolicy.
func (o *OperatorClient) GetPolicy(ctx context.Context, req *allotv1.GetPolicyRequest) (*allotv1.GetPolicyResponse, error) {
	return opCall(ctx, o.c, req, func(s allotv1connect.OperatorServiceClient) func(context.Context, *connect.Request[allotv1.GetPolicyRequest]) (*connect.Response[allotv1.GetPolicyResponse], error) {
		return s.GetPolicy
	})
}

// ListPolicies calls OperatorService.ListPolicies.
func (o *OperatorClient) ListPolicies(ctx context.Context, req *allotv1.ListPoliciesRequest) (*allotv1.ListPoliciesResponse, error) {
	return opCall(ctx, o.c, req, func(s allotv1connect.OperatorServiceClient) func(context.Context, *connect.Request[allotv1.ListPoliciesRequest]) (*connect.Response[allotv1.ListPoliciesResponse], error) {
		return s.ListPolicies
	})
}

// GetBound calls OperatorService.GetBound.
func (o *OperatorClient) GetBound(ctx context.Context, req *allotv1.GetBoundRequest) (*allotv1.GetBoundResponse, error) {
	return opCall(ctx, o.c, req, func(s allotv1connect.OperatorServiceClient) func(context.Context, *connect.Request[allotv1.GetBoundRequest]) (*connect.Response[allotv1.GetBoundResponse], error) {
		return s.GetBound
	})
}

// GetWindow calls OperatorService.GetWindow.
func (o *OperatorClient) GetWindow(ctx context.Context, req *allotv1.GetWindowRequest) (*allotv1.GetWindowResponse, error) {
	return opCall(ctx, o.c, req, func(s allotv1connect.OperatorServiceClient) func(context.Context, *connect.Request[allotv1.GetWindowRequest]) (*connect.Response[allotv1.GetWindowResponse], error) {
		return s.GetWindow
	})
}

// GetCluster calls OperatorService.GetCluster.
func (o *OperatorClient) GetCluster(ctx context.Context, req *allotv1.GetClusterRequest) (*allotv1.GetClusterResponse, error) {
	return opCall(ctx, o.c, req, func(s allotv1connect.OperatorServiceClient) func(context.Context, *connect.Request[allotv1.GetClusterRequest]) (*connect.Response[allotv1.GetClusterResponse], error) {
		return s.GetCluster
	})
}

// AddMember calls OperatorService.AddMember.
func (o *OperatorClient) AddMember(ctx context.Context, req *allotv1.AddMemberRequest) (*allotv1.AddMemberResponse, error) {
	return opCall(ctx, o.c, req, func(s allotv1connect.OperatorServiceClient) func(context.Context, *connect.Request[allotv1.AddMemberRequest]) (*connect.Response[allotv1.AddMemberResponse], error) {
		return s.AddMember
	})
}

// RemoveMember calls OperatorService.RemoveMember.
//
// The client retries a call whose answer was lost, and a removal whose
// first attempt committed is then answered NotFound although it took
// effect. RemoveMember reads the membership (GetCluster) before the first
// attempt; when a retried removal is answered NotFound, the id was a member
// at that read and the cluster no longer lists it, RemoveMember reports the
// success it was, with that membership. A NotFound stays one at the first
// attempt, for an id that was no member at the first read, and when that
// read failed: an earlier attempt may have reached no server (an endpoint
// down, a hop to the leader), so a retry alone does not make a NotFound the
// answer to a removal of ours.
func (o *OperatorClient) RemoveMember(ctx context.Context, req *allotv1.RemoveMemberRequest) (*allotv1.RemoveMemberResponse, error) {
	before, berr := o.GetCluster(ctx, &allotv1.GetClusterRequest{})
	wasMember := berr == nil && isMember(before.GetMembers(), req.GetId())
	var attempts atomic.Int32
	resp, err := opCall(ctx, o.c, req, func(s allotv1connect.OperatorServiceClient) func(context.Context, *connect.Request[allotv1.RemoveMemberRequest]) (*connect.Response[allotv1.RemoveMemberResponse], error) {
		attempts.Add(1)
		return s.RemoveMember
	})
	if err == nil || !wasMember || attempts.Load() < 2 || connect.CodeOf(err) != connect.CodeNotFound {
		return resp, err
	}
	cl, cerr := o.GetCluster(ctx, &allotv1.GetClusterRequest{})
	if cerr != nil || isMember(cl.GetMembers(), req.GetId()) {
		return resp, err
	}
	return &allotv1.RemoveMemberResponse{Members: cl.GetMembers()}, nil
}

// isMember reports whether members lists id.
func isMember(members []*allotv1.Member, id string) bool {
	return slices.ContainsFunc(members, func(m *allotv1.Member) bool { return m.GetId() == id })
}

// WatchPolicy opens a policy watch stream on the preferred endpoint. Callers
// reconnect (through another endpoint) when the stream ends.
func (o *OperatorClient) WatchPolicy(ctx context.Context, afterVersion uint64) (*connect.ServerStreamForClient[allotv1.WatchPolicyResponse], error) {
	return o.c.peer(o.c.api.first()).op.WatchPolicy(ctx, connect.NewRequest(&allotv1.WatchPolicyRequest{AfterVersion: afterVersion}))
}

// Endpoints returns the configured endpoints.
func (c *Client) Endpoints() []string { return append([]string(nil), c.api.endpoints...) }

// newReleaseID returns a request id for a Release that came without one.
func newReleaseID() string {
	var b [12]byte
	_, _ = rand.Read(b[:]) // crypto/rand.Read never fails (Go 1.24+)
	return "release-" + hex.EncodeToString(b[:])
}
