package allocator

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
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
// the next endpoint. When every attempt fails, the error is the most
// informative answer (a live node's "no leader known" before a dead node's
// dial error), with its code and leader hint, followed by what the other
// endpoints said; see failures.
func call[T any](ctx context.Context, c *Client, r *route, fn func(ctx context.Context, addr string) (T, error)) (T, error) {
	var (
		zero  T
		fails failures
		pause = c.backoff
	)
	addr := r.first()
	next := slices.Index(r.endpoints, addr) + 1 // -1 (a hint) + 1: the first
	for attempt := 0; attempt < c.attempts; attempt++ {
		actx, cancel := context.WithTimeout(ctx, c.perTry)
		out, err := fn(actx, addr)
		cancel()
		if err != nil && ctx.Err() == nil && connect.CodeOf(err) == connect.CodeDeadlineExceeded {
			err = connect.NewError(connect.CodeUnavailable, &noAnswerError{addr: addr, within: c.perTry, err: err})
		}
		if err != nil && ctx.Err() != nil && len(fails.addrs) > 0 && cutShort(err) {
			// The caller's deadline cut this attempt short: what the
			// earlier ones said tells more than that.
			return zero, fails.ctxError(ctx.Err())
		}
		if err == nil || !retryable(err) {
			if err == nil {
				r.answered(addr)
			}
			return out, err
		}
		fails.add(addr, err)
		if hint := LeaderHintOf(err); r.hints && hint != "" && hint != addr {
			addr = hint
			continue // a hint is worth following at once
		}
		addr = r.endpoints[next%len(r.endpoints)]
		next++
		select {
		case <-ctx.Done():
			return zero, fails.ctxError(ctx.Err())
		case <-time.After(pause):
		}
		pause = min(2*pause, time.Second)
	}
	return zero, fails.err()
}

// cutShort reports whether err is no answer of a node: an attempt ended by
// its context, or one another node might have answered. A node's answer
// (NotFound, FailedPrecondition, ...) is returned as it came.
func cutShort(err error) bool {
	switch connect.CodeOf(err) {
	case connect.CodeDeadlineExceeded, connect.CodeCanceled:
		return true
	}
	return retryable(err)
}

// noAnswerError is the error of an attempt that timed out on its own: the
// endpoint took the call and did not answer within the attempt timeout.
type noAnswerError struct {
	addr   string
	within time.Duration
	err    error
}

func (e *noAnswerError) Error() string {
	return fmt.Sprintf("%s did not answer within %s: %v", e.addr, e.within, e.err)
}

func (e *noAnswerError) Unwrap() error { return e.err }

// failures keeps, for each endpoint a call tried, the most informative error
// it got there (the latest of those as informative).
type failures struct {
	addrs []string // in the order of their first failure
	errs  map[string]failure
	seq   int
}

type failure struct {
	err error
	seq int // when it was recorded
}

func (f *failures) add(addr string, err error) {
	if f.errs == nil {
		f.errs = map[string]failure{}
	}
	f.seq++
	prev, ok := f.errs[addr]
	if !ok {
		f.addrs = append(f.addrs, addr)
	}
	if !ok || informative(err) >= informative(prev.err) {
		f.errs[addr] = failure{err: err, seq: f.seq}
	}
}

// informative ranks the error of a failed attempt: 2 when the node answered
// (its own error, with a leader hint or "no leader known"), 1 when it took
// the call and did not answer in time, 0 when the call did not reach it (a
// dial error, a connection refused).
func informative(err error) int {
	var ce *connect.Error
	switch {
	case connect.IsWireError(err):
		return 2
	case errors.As(err, &ce) && len(ce.Details()) > 0: // gRPC route: a status with details came from a node
		return 2
	case errors.As(err, new(*noAnswerError)):
		return 1
	}
	return 0
}

// best returns the endpoint of the most informative error, the latest of
// those as informative.
func (f *failures) best() string {
	best := f.addrs[0]
	for _, a := range f.addrs[1:] {
		b, e := f.errs[best], f.errs[a]
		if r, rb := informative(e.err), informative(b.err); r > rb || r == rb && e.seq > b.seq {
			best = a
		}
	}
	return best
}

// summary describes the failures: the most informative error with its
// endpoint, then the others, endpoints with the same reason together, as
// in "no leader known: … (127.0.0.1:8001); 127.0.0.1:8002, 127.0.0.1:8003:
// connection refused". Errors that did not come from a node (rank 0) are
// all grouped by reason. With one endpoint, it is that endpoint's error.
func (f *failures) summary() string {
	best := f.best()
	be := f.errs[best].err
	if len(f.addrs) == 1 {
		return be.Error()
	}
	var parts, reasons []string
	byReason := map[string][]string{}
	for _, a := range f.addrs {
		if a == best && informative(be) > 0 {
			parts = append(parts, fmt.Sprintf("%s (%s)", message(be), a))
			continue
		}
		r := reason(f.errs[a].err)
		if byReason[r] == nil {
			reasons = append(reasons, r)
		}
		byReason[r] = append(byReason[r], a)
	}
	if len(parts) == 0 { // no node answered: the best reason first
		r := reason(be)
		reasons = slices.DeleteFunc(reasons, func(s string) bool { return s == r })
		reasons = append([]string{r}, reasons...)
	}
	for _, r := range reasons {
		parts = append(parts, strings.Join(byReason[r], ", ")+": "+r)
	}
	return strings.Join(parts, "; ")
}

// err is the error of a call whose every attempt failed: the most
// informative error's code, leader hint and metadata, with the summary
// of every endpoint's error as its message.
func (f *failures) err() error {
	best := f.best()
	be := f.errs[best].err
	if len(f.addrs) == 1 {
		return be
	}
	errs := make([]error, 0, len(f.addrs))
	errs = append(errs, be)
	for _, a := range f.addrs {
		if a != best {
			errs = append(errs, f.errs[a].err)
		}
	}
	out := connect.NewError(connect.CodeOf(be), &endpointsError{msg: f.summary(), errs: errs})
	var ce *connect.Error
	if errors.As(be, &ce) {
		for _, d := range ce.Details() {
			out.AddDetail(d)
		}
		for k, v := range ce.Meta() {
			out.Meta()[k] = append([]string(nil), v...)
		}
	}
	return out
}

// ctxError is the error of a call the caller's context ended (cause is its
// Err) after the failures: DeadlineExceeded or Canceled, wrapping cause and
// the failures' error.
func (f *failures) ctxError(cause error) error {
	code := connect.CodeDeadlineExceeded
	if errors.Is(cause, context.Canceled) {
		code = connect.CodeCanceled
	}
	if len(f.addrs) == 0 {
		return connect.NewError(code, cause)
	}
	label := "last error"
	if len(f.addrs) > 1 {
		label = "last errors"
	}
	return connect.NewError(code, fmt.Errorf("%w (%s: %w)", cause, label, f.err()))
}

// endpointsError is the message of failures.err, wrapping each endpoint's error.
type endpointsError struct {
	msg  string
	errs []error
}

func (e *endpointsError) Error() string   { return e.msg }
func (e *endpointsError) Unwrap() []error { return e.errs }

// message is err's message without its Connect code.
func message(err error) string {
	var ce *connect.Error
	if errors.As(err, &ce) {
		return ce.Message()
	}
	return err.Error()
}

// reason is a short form of err for the list of endpoints that failed:
// "connection refused" for a dial error, "did not answer within 2s" for
// an attempt timeout, else its message, cut at maxReason runes.
func reason(err error) string {
	var (
		na *noAnswerError
		op *net.OpError
		sc *os.SyscallError
	)
	var r string
	switch {
	case errors.As(err, &na):
		r = fmt.Sprintf("did not answer within %s", na.within)
	case errors.As(err, &sc):
		r = sc.Err.Error()
	case errors.As(err, &op) && op.Err != nil:
		r = op.Err.Error()
	default:
		r = message(err)
	}
	const maxReason = 120
	if rs := []rune(r); len(rs) > maxReason {
		r = string(rs[:maxReason-1]) + "…"
	}
	return r
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
