package allocator

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode"
	"unicode/utf8"

	"connectrpc.com/connect"
	"github.com/hashicorp/raft"
	"go.uber.org/zap"

	"github.com/allot-dev/allot/fsm"
	"github.com/allot-dev/allot/pkg/lease"
	"github.com/allot-dev/allot/pkg/policy"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
	"github.com/allot-dev/allot/proto/allot/v1/allotv1connect"
)

const (
	// headerForwarded marks a call a follower forwarded, so it is never forwarded twice.
	headerForwarded = "Allot-Forwarded"
	// headerLeader carries the leader's API address on Unavailable errors.
	headerLeader = "Allot-Leader"
	// maxAddressLen bounds a member's addresses (the member table's bound).
	maxAddressLen = fsm.MaxAPIAddressBytes
)

// Server implements the Connect services of one allocator node. Any node
// accepts any call: writes (and linearizable reads) are forwarded to the leader.
type Server struct {
	node    *Node
	log     *zap.Logger
	metrics *Metrics
	now     func() time.Time
	peers   *peerClients
	// watchPoll is how often a WatchPolicy stream looks for a new version.
	watchPoll time.Duration
	// closing is closed by Shutdown: open WatchPolicy streams end.
	closing   chan struct{}
	closeOnce sync.Once
	// watches counts the open WatchPolicy streams (Config.MaxWatchStreams).
	watches atomic.Int64
}

var (
	_ allotv1connect.AllocatorServiceHandler = (*Server)(nil)
	_ allotv1connect.OperatorServiceHandler  = (*Server)(nil)
)

// NewServer creates the Connect handlers of node.
func NewServer(node *Node, log *zap.Logger, m *Metrics) *Server {
	if log == nil {
		log = zap.NewNop()
	}
	return &Server{
		node: node, log: log.Named("api"), metrics: m, now: node.now,
		peers: newPeerClients(), watchPoll: 100 * time.Millisecond,
		closing: make(chan struct{}),
	}
}

// Shutdown ends the open WatchPolicy streams (their clients reconnect
// through another node) and makes new ones end at once. An HTTP server's
// graceful Shutdown waits for every handler to return, and a watch returns
// only when its client goes away: register Shutdown with the HTTP server's
// RegisterOnShutdown (as Run does), or call it before. It is idempotent.
func (s *Server) Shutdown() { s.closeOnce.Do(func() { close(s.closing) }) }

// Handler returns an http.Handler serving both services (Connect, gRPC and
// gRPC-Web protocols) with the body size limit of the node's config.
func (s *Server) Handler() http.Handler {
	mux := http.NewServeMux()
	// Small messages are not worth compressing: gzip would cost more CPU
	// than the bytes it saves on a LAN (it was ~10% of the leader's CPU).
	opts := []connect.HandlerOption{connect.WithReadMaxBytes(s.node.cfg.MaxBodyBytes), connect.WithCompressMinBytes(4096)}
	mux.Handle(allotv1connect.NewAllocatorServiceHandler(s, opts...))
	path, op := allotv1connect.NewOperatorServiceHandler(s, opts...)
	mux.Handle(path, op)
	// WatchPolicy bounds each send with a write deadline (watchSend).
	mux.Handle(allotv1connect.OperatorServiceWatchPolicyProcedure, withResponseController(op))
	return mux
}

// responseControllerKey carries, in a request's context, the
// http.ResponseController of its response.
type responseControllerKey struct{}

// withResponseController hands h's handlers the ResponseController of the
// response in the request's context: a Connect handler sees only its stream.
func withResponseController(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		rc := http.NewResponseController(w)
		h.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), responseControllerKey{}, rc)))
	})
}

// forward sends a call to the leader when this node is not the leader. It
// returns handled=false when this node should answer itself.
func forward[Req, Resp any](ctx context.Context, s *Server, req *connect.Request[Req],
	call func(c *peerClient) func(context.Context, *connect.Request[Req]) (*connect.Response[Resp], error),
) (resp *connect.Response[Resp], handled bool, err error) {
	if s.node.IsLeader() {
		return nil, false, nil
	}
	if req.Header().Get(headerForwarded) != "" {
		return nil, true, ErrNotLeader
	}
	_, api := s.node.Leader()
	if api == "" || api == s.node.cfg.APIAddr {
		return nil, true, fmt.Errorf("no leader known: %w", ErrNotLeader)
	}
	out := connect.NewRequest(req.Msg)
	out.Header().Set(headerForwarded, s.node.cfg.NodeID)
	s.metrics.Forwarded.Inc()
	resp, err = call(s.peers.get(api))(ctx, out)
	if err != nil {
		var ce *connect.Error
		if errors.As(err, &ce) && ce.Code() != connect.CodeUnavailable && ce.Code() != connect.CodeUnknown {
			return nil, true, err
		}
		return nil, true, fmt.Errorf("forward to leader %s: %w (%v)", api, ErrNotLeader, err)
	}
	return resp, true, nil
}

// leaderRead is forward for a read that must see every acknowledged write:
// on the leader it returns handled=false only after a Raft barrier, so
// the state machine has applied every entry committed before the call (a
// new leader may not have yet).
func leaderRead[Req, Resp any](ctx context.Context, s *Server, req *connect.Request[Req],
	call func(c *peerClient) func(context.Context, *connect.Request[Req]) (*connect.Response[Resp], error),
) (resp *connect.Response[Resp], handled bool, err error) {
	if resp, handled, err := forward(ctx, s, req, call); handled {
		return resp, true, err
	}
	if err := s.node.Barrier(ctx); err != nil {
		return nil, true, err
	}
	return nil, false, nil
}

// checkField refuses a string field of a command that is empty or longer
// than maxBytes, the state machine's bound of that field (an fsm.Max*
// constant), with the state machine's own wording. The handlers check every
// bound the state machine would, before proposing: a command refused only
// once applied has already been appended to the Raft log (with the other
// callers' commands group-committed into the same entry) and replicated.
func checkField(field, v string, maxBytes int) error {
	switch {
	case v == "":
		return fmt.Errorf("%s: must not be empty: %w", field, errInvalid)
	case len(v) > maxBytes:
		return fmt.Errorf("%s: %d bytes, at most %d: %w", field, len(v), maxBytes, errInvalid)
	}
	return nil
}

// validateAcquire checks what the state machine checks of an Acquire
// without its state (the quotas' specs): the errors read as the state
// machine's, prefixed with the command ("acquire: ").
func validateAcquire(m *allotv1.AcquireRequest, maxWants int) error {
	if err := checkAcquire(m, maxWants); err != nil {
		return fmt.Errorf("%s: %w", fsm.CmdAcquire, err)
	}
	return nil
}

// checkAcquire is validateAcquire without the command's prefix.
func checkAcquire(m *allotv1.AcquireRequest, maxWants int) error {
	if err := checkField("region", m.GetRegion(), fsm.MaxRegionBytes); err != nil {
		return err
	}
	if err := checkField("request_id", m.GetRequestId(), fsm.MaxRequestIDBytes); err != nil {
		return err
	}
	switch wants := m.GetWants(); {
	case len(wants) == 0:
		return fmt.Errorf("wants: must not be empty: %w", errInvalid)
	case len(wants) > maxWants:
		return fmt.Errorf("wants: %d exceeds the maximum of %d per call: %w", len(wants), maxWants, errInvalid)
	}
	for i, w := range m.GetWants() {
		if err := checkField(fmt.Sprintf("wants[%d].quota", i), w.GetQuota(), fsm.MaxQuotaNameBytes); err != nil {
			return err
		}
		// No quota's limit exceeds fsm.MaxLimit, which bounds every want.
		if t := w.GetTokens(); t < 0 || t > fsm.MaxLimit {
			return fmt.Errorf("wants[%d].tokens %d: must be in [0, %d], and at most the quota's limit: %w", i, t, int64(fsm.MaxLimit), errInvalid)
		}
		// A NaN or an infinity could not even be encoded into the Raft
		// entry, which may carry other callers' commands (group commit).
		if d := w.GetDemandPerSecond(); !(d >= 0) || math.IsInf(d, 1) {
			return fmt.Errorf("wants[%d].demand_per_second %v: must be finite and >= 0: %w", i, d, errInvalid)
		}
	}
	return checkDistinctQuotas(m.GetWants())
}

// checkDistinctQuotas refuses a quota named by two wants, as the state
// machine does. Most Acquires carry a few wants: those are compared pairwise
// rather than through a map.
func checkDistinctQuotas(wants []*allotv1.Want) error {
	const pairwise = 16
	if len(wants) <= pairwise {
		for i := 1; i < len(wants); i++ {
			for j := range i {
				if wants[i].GetQuota() == wants[j].GetQuota() {
					return fmt.Errorf("wants[%d].quota %q: duplicate of wants[%d]: %w", i, wants[i].GetQuota(), j, errInvalid)
				}
			}
		}
		return nil
	}
	seen := make(map[string]int, len(wants))
	for i, w := range wants {
		if j, dup := seen[w.GetQuota()]; dup {
			return fmt.Errorf("wants[%d].quota %q: duplicate of wants[%d]: %w", i, w.GetQuota(), j, errInvalid)
		}
		seen[w.GetQuota()] = i
	}
	return nil
}

// Acquire implements AllocatorService.Acquire.
func (s *Server) Acquire(ctx context.Context, req *connect.Request[allotv1.AcquireRequest]) (*connect.Response[allotv1.AcquireResponse], error) {
	const method = "Acquire"
	if err := validateAcquire(req.Msg, s.node.cfg.MaxWantsPerCall); err != nil {
		return nil, s.toConnect(method, err)
	}
	if resp, handled, err := forward(ctx, s, req, func(c *peerClient) func(context.Context, *connect.Request[allotv1.AcquireRequest]) (*connect.Response[allotv1.AcquireResponse], error) {
		return c.alloc.Acquire
	}); handled {
		if err != nil {
			return nil, s.toConnect(method, err)
		}
		return resp, nil
	}
	out, err := s.node.Apply(ctx, fsm.Command{Type: fsm.CmdAcquire, Acquire: AcquireCommand(req.Msg)})
	if err != nil {
		return nil, s.toConnect(method, err)
	}
	res, ok := out.(*fsm.AcquireResult)
	if !ok {
		return nil, s.toConnect(method, fmt.Errorf("acquire: unexpected result %T", out))
	}
	resp := AcquireAnswer(res)
	resp.LeaseMarginMs = s.node.cfg.LeaseMargin.Milliseconds()
	for _, g := range res.Grants {
		if !res.Replayed {
			if g.Tokens > 0 {
				s.metrics.Grants.Inc()
				s.metrics.TokensGranted.Add(float64(g.Tokens))
			}
			if g.PoolExhausted {
				s.metrics.PoolExhausted.Inc()
			}
		}
	}
	s.metrics.Requests.WithLabelValues(method, "ok").Inc()
	return connect.NewResponse(resp), nil
}

// AcquireCommand is the state machine's command for an Acquire request.
func AcquireCommand(m *allotv1.AcquireRequest) *fsm.Acquire {
	cmd := &fsm.Acquire{Region: m.GetRegion(), RequestID: m.GetRequestId(), Wants: make([]fsm.Want, len(m.GetWants()))}
	for i, w := range m.GetWants() {
		cmd.Wants[i] = fsm.Want{Quota: w.GetQuota(), Tokens: w.GetTokens(), DemandPerSecond: w.GetDemandPerSecond(), Next: w.GetNextWindow()}
	}
	return cmd
}

// AcquireAnswer is the API's answer for the state machine's result.
func AcquireAnswer(res *fsm.AcquireResult) *allotv1.AcquireResponse {
	resp := &allotv1.AcquireResponse{LeaderNowUnixMs: res.NowUnixMs, Replayed: res.Replayed, Grants: make([]*allotv1.Grant, len(res.Grants))}
	for i, g := range res.Grants {
		resp.Grants[i] = &allotv1.Grant{
			Quota: g.Quota, GrantId: g.GrantID, Tokens: g.Tokens, WindowIndex: g.WindowIndex,
			WindowEndUnixMs: g.WindowEndUnixMs, ExpiresUnixMs: g.ExpiresUnixMs, TtlMs: g.TTLMs, PoolExhausted: g.PoolExhausted,
			NotBeforeUnixMs: g.NotBeforeUnixMs,
		}
	}
	return resp
}

// Release implements AllocatorService.Release.
func (s *Server) Release(ctx context.Context, req *connect.Request[allotv1.ReleaseRequest]) (*connect.Response[allotv1.ReleaseResponse], error) {
	const method = "Release"
	m := req.Msg
	if err := validateRelease(m); err != nil {
		return nil, s.toConnect(method, fmt.Errorf("%s: %w", fsm.CmdRelease, err))
	}
	if resp, handled, err := forward(ctx, s, req, func(c *peerClient) func(context.Context, *connect.Request[allotv1.ReleaseRequest]) (*connect.Response[allotv1.ReleaseResponse], error) {
		return c.alloc.Release
	}); handled {
		if err != nil {
			return nil, s.toConnect(method, err)
		}
		return resp, nil
	}
	out, err := s.node.Apply(ctx, fsm.Command{Type: fsm.CmdRelease, Release: &fsm.Release{
		Region: m.GetRegion(), GrantID: m.GetGrantId(), Tokens: m.GetTokens(), RequestID: m.GetRequestId(),
	}})
	if err != nil {
		return nil, s.toConnect(method, err)
	}
	res, ok := out.(*fsm.ReleaseResult)
	if !ok {
		return nil, s.toConnect(method, fmt.Errorf("release: unexpected result %T", out))
	}
	if !res.Replayed {
		s.metrics.TokensReleased.Add(float64(res.Returned))
	}
	s.metrics.Requests.WithLabelValues(method, "ok").Inc()
	return connect.NewResponse(&allotv1.ReleaseResponse{Returned: res.Returned, PoolRemaining: res.PoolRemaining, Replayed: res.Replayed}), nil
}

// validateRelease checks what the state machine checks of a Release without
// its state (the grant), and that it has a request id.
func validateRelease(m *allotv1.ReleaseRequest) error {
	if err := checkField("region", m.GetRegion(), fsm.MaxRegionBytes); err != nil {
		return err
	}
	if err := checkField("grant_id", m.GetGrantId(), fsm.MaxGrantIDBytes); err != nil {
		return err
	}
	if m.GetTokens() <= 0 {
		return fmt.Errorf("tokens: %d must be positive: %w", m.GetTokens(), errInvalid)
	}
	if m.GetRequestId() == "" {
		// A retry of a call whose answer was lost must be a replay, not a
		// second credit (the pool could then grant what a region holds).
		return fmt.Errorf("request_id: must not be empty (it makes a retried Release a replay): %w", errInvalid)
	}
	return checkField("request_id", m.GetRequestId(), fsm.MaxRequestIDBytes)
}

// PublishPolicy implements OperatorService.PublishPolicy.
func (s *Server) PublishPolicy(ctx context.Context, req *connect.Request[allotv1.PublishPolicyRequest]) (*connect.Response[allotv1.PublishPolicyResponse], error) {
	const method = "PublishPolicy"
	m := req.Msg
	if err := validatePublish(m); err != nil {
		return nil, s.toConnect(method, fmt.Errorf("%s: %w", fsm.CmdPublishPolicy, err))
	}
	doc, err := policy.Parse(m.GetDocument())
	if err != nil {
		return nil, s.toConnect(method, fmt.Errorf("document: %w", err))
	}
	canonical, err := policy.Canonical(doc)
	if err != nil {
		return nil, s.toConnect(method, fmt.Errorf("document: %w", err))
	}
	if len(canonical) > fsm.MaxDocumentBytes {
		// policy.Validate bounds the canonical form tighter already.
		return nil, s.toConnect(method, fmt.Errorf("%s: document: canonical form of %d bytes, at most %d: %w",
			fsm.CmdPublishPolicy, len(canonical), fsm.MaxDocumentBytes, errInvalid))
	}
	if resp, handled, err := forward(ctx, s, req, func(c *peerClient) func(context.Context, *connect.Request[allotv1.PublishPolicyRequest]) (*connect.Response[allotv1.PublishPolicyResponse], error) {
		return c.op.PublishPolicy
	}); handled {
		if err != nil {
			return nil, s.toConnect(method, err)
		}
		return resp, nil
	}
	cmd := &fsm.Publish{ExpectedVersion: m.GetExpectedVersion(), Author: m.GetAuthor(), Reason: m.GetReason(), Document: canonical, Quotas: QuotaSpecs(doc)}
	out, err := s.node.Apply(ctx, fsm.Command{Type: fsm.CmdPublishPolicy, Publish: cmd})
	if err != nil {
		return nil, s.toConnect(method, err)
	}
	res, ok := out.(*fsm.PublishResult)
	if !ok {
		return nil, s.toConnect(method, fmt.Errorf("publish: unexpected result %T", out))
	}
	s.log.Info("policy published", zap.Uint64("version", res.Policy.Version), zap.String("author", res.Policy.Author), zap.String("reason", res.Policy.Reason))
	s.metrics.Requests.WithLabelValues(method, "ok").Inc()
	return connect.NewResponse(&allotv1.PublishPolicyResponse{Policy: recordToProto(res.Policy, true)}), nil
}

// validatePublish checks the audit fields of a PublishPolicy as the state
// machine bounds them, and that the call is conditional.
func validatePublish(m *allotv1.PublishPolicyRequest) error {
	switch {
	case m.GetAuthor() == "":
		return fmt.Errorf("author: must not be empty (the audit history records who): %w", errInvalid)
	case len(m.GetAuthor()) > fsm.MaxAuthorBytes:
		return fmt.Errorf("author: %d bytes, at most %d: %w", len(m.GetAuthor()), fsm.MaxAuthorBytes, errInvalid)
	case m.GetReason() == "":
		return fmt.Errorf("reason: must not be empty (the audit history records why): %w", errInvalid)
	case len(m.GetReason()) > fsm.MaxReasonBytes:
		return fmt.Errorf("reason: %d bytes, at most %d: %w", len(m.GetReason()), fsm.MaxReasonBytes, errInvalid)
	case m.GetExpectedVersion() == 0:
		return fmt.Errorf("expected_version: must be the current version + 1: %w", errInvalid)
	}
	return nil
}

// QuotaSpecs derives the FSM's quota specs from a policy's global quotas:
// one per single pool, and one per template (TemplateKeys set), whose
// instances the state machine creates as regions acquire them.
func QuotaSpecs(doc *policy.Document) []fsm.QuotaSpec {
	gq := doc.GlobalQuotas()
	out := make([]fsm.QuotaSpec, len(gq))
	for i, q := range gq {
		out[i] = fsm.QuotaSpec{
			Name: q.Name, Limit: q.Limit, WindowMs: q.Window.Milliseconds(), ChunkTokens: q.Chunk,
			TTLMs: q.TTL.Milliseconds(), Clamp: q.Clamp, Strategy: fsm.Strategy(q.Strategy),
			FallbackPerRegion: q.FallbackPerRegion, MaxHeldPerRegion: q.MaxHeldPerRegion, Regions: append([]string(nil), q.Regions...),
			TemplateKeys: len(q.TemplateKeys),
		}
	}
	return out
}

// recordToProto converts r; the digest is the state machine's, so a record
// copied without its document (PolicyHistory) still names the right one.
func recordToProto(r fsm.PolicyRecord, withDoc bool) *allotv1.PolicyRecord {
	p := &allotv1.PolicyRecord{
		Version: r.Version, Author: r.Author, Reason: r.Reason, PublishedUnixMs: r.PublishedUnixMs,
		Digest: r.Digest,
	}
	if withDoc {
		p.Document = r.Document
	}
	return p
}

// GetPolicy implements OperatorService.GetPolicy. It is answered by the
// leader after a Raft barrier, so an operator reads what they just published.
func (s *Server) GetPolicy(ctx context.Context, req *connect.Request[allotv1.GetPolicyRequest]) (*connect.Response[allotv1.GetPolicyResponse], error) {
	const method = "GetPolicy"
	if resp, handled, err := leaderRead(ctx, s, req, func(c *peerClient) func(context.Context, *connect.Request[allotv1.GetPolicyRequest]) (*connect.Response[allotv1.GetPolicyResponse], error) {
		return c.op.GetPolicy
	}); handled {
		if err != nil {
			return nil, s.toConnect(method, err)
		}
		return resp, nil
	}
	var (
		rec fsm.PolicyRecord
		ok  bool
	)
	if v := req.Msg.GetVersion(); v == 0 {
		rec, ok = s.node.fsm.Policy()
		if !ok {
			return nil, s.toConnect(method, fmt.Errorf("no policy has been published yet: %w", errNotFound))
		}
	} else if rec, ok = s.node.fsm.PolicyVersion(v); !ok {
		return nil, s.toConnect(method, fmt.Errorf("version: %d is not retained: %w", v, errNotFound))
	}
	s.metrics.Requests.WithLabelValues(method, "ok").Inc()
	return connect.NewResponse(&allotv1.GetPolicyResponse{Policy: recordToProto(rec, true)}), nil
}

// ListPolicies implements OperatorService.ListPolicies (answered by the
// leader after a Raft barrier).
func (s *Server) ListPolicies(ctx context.Context, req *connect.Request[allotv1.ListPoliciesRequest]) (*connect.Response[allotv1.ListPoliciesResponse], error) {
	if resp, handled, err := leaderRead(ctx, s, req, func(c *peerClient) func(context.Context, *connect.Request[allotv1.ListPoliciesRequest]) (*connect.Response[allotv1.ListPoliciesResponse], error) {
		return c.op.ListPolicies
	}); handled {
		if err != nil {
			return nil, s.toConnect("ListPolicies", err)
		}
		return resp, nil
	}
	hist := s.node.fsm.PolicyHistory()
	out := &allotv1.ListPoliciesResponse{}
	for i := len(hist) - 1; i >= 0; i-- {
		out.Policies = append(out.Policies, recordToProto(hist[i], false))
	}
	s.metrics.Requests.WithLabelValues("ListPolicies", "ok").Inc()
	return connect.NewResponse(out), nil
}

// WatchPolicy implements OperatorService.WatchPolicy: it sends every retained
// version newer than the last one sent, then waits for more until the client
// goes away or the server shuts down (Shutdown), when it ends with
// Unavailable so the client reconnects through another node. A node serves
// at most Config.MaxWatchStreams streams at once (ResourceExhausted beyond),
// and ends a stream whose client does not take a version within
// Config.WatchSendTimeout.
func (s *Server) WatchPolicy(ctx context.Context, req *connect.Request[allotv1.WatchPolicyRequest], stream *connect.ServerStream[allotv1.WatchPolicyResponse]) error {
	const method = "WatchPolicy"
	limit := int64(s.node.cfg.MaxWatchStreams)
	if s.watches.Add(1) > limit {
		s.watches.Add(-1)
		return s.toConnect(method, connect.NewError(connect.CodeResourceExhausted, fmt.Errorf(
			"this node already serves %d WatchPolicy streams, its limit (MaxWatchStreams): retry later, or watch through another node", limit)))
	}
	s.metrics.WatchStreams.Inc()
	defer func() {
		s.watches.Add(-1)
		s.metrics.WatchStreams.Dec()
	}()
	last := req.Msg.GetAfterVersion()
	t := time.NewTicker(s.watchPoll)
	defer t.Stop()
	for {
		if cur, ok := s.node.fsm.Policy(); ok && cur.Version > last {
			for _, h := range s.node.fsm.PolicyHistory() {
				if h.Version <= last {
					continue
				}
				rec, ok := s.node.fsm.PolicyVersion(h.Version)
				if !ok {
					continue
				}
				if err := s.watchSend(ctx, stream, &allotv1.WatchPolicyResponse{Policy: recordToProto(rec, true)}); err != nil {
					return err
				}
				last = h.Version
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case <-s.closing:
			return connect.NewError(connect.CodeUnavailable, errors.New("allocator node shutting down: watch through another node"))
		case <-t.C:
		}
	}
}

// watchSend sends msg on a WatchPolicy stream within
// Config.WatchSendTimeout: past it the write fails and the stream is reset
// (HTTP/2) or its connection closed (HTTP/1.1). Without a
// ResponseController in ctx (the handler not served through Handler) it
// sends without a deadline.
func (s *Server) watchSend(ctx context.Context, stream *connect.ServerStream[allotv1.WatchPolicyResponse], msg *allotv1.WatchPolicyResponse) error {
	rc, _ := ctx.Value(responseControllerKey{}).(*http.ResponseController)
	if rc != nil && rc.SetWriteDeadline(time.Now().Add(s.node.cfg.WatchSendTimeout)) != nil {
		rc = nil // the writer does not support deadlines
	}
	if err := stream.Send(msg); err != nil {
		return err // the stream is broken: nothing more reaches the client
	}
	if rc != nil {
		// A stream waits idle for the next version as long as it takes.
		_ = rc.SetWriteDeadline(time.Time{})
	}
	return nil
}

// GetWindow implements OperatorService.GetWindow. It is answered by the leader
// after a Raft barrier, so the ledger includes every acknowledged grant.
func (s *Server) GetWindow(ctx context.Context, req *connect.Request[allotv1.GetWindowRequest]) (*connect.Response[allotv1.GetWindowResponse], error) {
	const method = "GetWindow"
	// No quota's name is longer (an instance's included): refusing a longer
	// one here keeps it out of the NotFound message.
	if err := checkField("quota", req.Msg.GetQuota(), fsm.MaxQuotaNameBytes); err != nil {
		return nil, s.toConnect(method, err)
	}
	if resp, handled, err := leaderRead(ctx, s, req, func(c *peerClient) func(context.Context, *connect.Request[allotv1.GetWindowRequest]) (*connect.Response[allotv1.GetWindowResponse], error) {
		return c.op.GetWindow
	}); handled {
		if err != nil {
			return nil, s.toConnect(method, err)
		}
		return resp, nil
	}
	spec, ok := s.node.fsm.Quota(req.Msg.GetQuota())
	if !ok {
		return nil, s.toConnect(method, fmt.Errorf("quota %q: %w", req.Msg.GetQuota(), fsm.ErrUnknownQuota))
	}
	if spec.TemplateKeys > 0 {
		return nil, s.toConnect(method, fmt.Errorf("quota %q: a template has no window of its own; name one of its instances, %s/<value>: %w",
			spec.Name, spec.Name, errInvalid))
	}
	now := max(s.now().UnixMilli(), s.node.fsm.Now())
	idx := req.Msg.GetWindowIndex()
	var w fsm.WindowView
	if idx == 0 || idx == lease.WindowIndex(now, spec.WindowMs) {
		w = s.node.fsm.CurrentWindow(spec.Name, now)
	} else if w, ok = s.node.fsm.Window(spec.Name, idx); !ok {
		return nil, s.toConnect(method, fmt.Errorf("window_index: %d is not retained (only the previous, the current and, once pre-granted from, the next window are): %w", idx, errNotFound))
	}
	s.metrics.Requests.WithLabelValues(method, "ok").Inc()
	return connect.NewResponse(windowToProto(spec.Name, w, now)), nil
}

// GetCluster implements OperatorService.GetCluster from this node's view.
func (s *Server) GetCluster(context.Context, *connect.Request[allotv1.GetClusterRequest]) (*connect.Response[allotv1.GetClusterResponse], error) {
	const method = "GetCluster"
	members, err := s.node.Members()
	if err != nil {
		return nil, s.toConnect(method, err)
	}
	r := s.node.raft
	lid, _ := s.node.Leader()
	out := &allotv1.GetClusterResponse{
		LeaderId: lid, NodeId: s.node.cfg.NodeID, State: r.State().String(),
		LastLogIndex: r.LastIndex(), CommitIndex: r.CommitIndex(), AppliedIndex: r.AppliedIndex(), Term: r.CurrentTerm(),
		ClusterId: s.node.fsm.ClusterID(),
	}
	if p, ok := s.node.fsm.Policy(); ok {
		out.PolicyVersion = p.Version
	}
	out.Members = membersToProto(members)
	s.metrics.Requests.WithLabelValues(method, "ok").Inc()
	return connect.NewResponse(out), nil
}

func membersToProto(ms []MemberInfo) []*allotv1.Member {
	out := make([]*allotv1.Member, len(ms))
	for i, m := range ms {
		out[i] = &allotv1.Member{Id: m.ID, RaftAddress: m.RaftAddr, ApiAddress: m.APIAddr, Suffrage: m.Suffrage, Leader: m.Leader}
	}
	return out
}

// validateAddMember checks a new member before the configuration changes: a
// voter nobody can reach counts towards the quorum all the same (one such
// voter added to a single node stops the cluster at once), and its id must
// also be one the member table and -peer (id=raft=api) accept.
func validateAddMember(m *allotv1.AddMemberRequest) error {
	if err := checkMemberID(m.GetId()); err != nil {
		return err
	}
	if err := checkHostPort("raft_address", m.GetRaftAddress()); err != nil {
		return err
	}
	return checkHostPort("api_address", m.GetApiAddress())
}

// checkMemberID checks a member's Raft server ID: what the member table
// holds (fsm.MaxMemberIDBytes), printable, without spaces or '=' (the
// separator of -peer).
func checkMemberID(id string) error {
	switch {
	case id == "":
		return fmt.Errorf("id: must not be empty: %w", errInvalid)
	case len(id) > fsm.MaxMemberIDBytes:
		return fmt.Errorf("id: %d bytes, at most %d: %w", len(id), fsm.MaxMemberIDBytes, errInvalid)
	case !utf8.ValidString(id) || strings.ContainsFunc(id, func(r rune) bool { return r == '=' || unicode.IsSpace(r) || !unicode.IsPrint(r) }):
		return fmt.Errorf("id: %q must be printable, without spaces or '=': %w", id, errInvalid)
	}
	return nil
}

// checkHostPort checks the member address of field (see CheckDialAddr).
func checkHostPort(field, addr string) error {
	if addr == "" {
		return fmt.Errorf("%s: must not be empty: %w", field, errInvalid)
	}
	if len(addr) > maxAddressLen {
		return fmt.Errorf("%s: %d bytes, at most %d: %w", field, len(addr), maxAddressLen, errInvalid)
	}
	if err := CheckDialAddr(addr); err != nil {
		return fmt.Errorf("%s: %q: %v: %w", field, addr, err, errInvalid)
	}
	return nil
}

// CheckDialAddr says why addr is not an address other nodes can dial, or
// returns nil: it must be host:port with a host name or an IP address that
// is not unspecified (0.0.0.0, ::), and a port number in 1-65535. A
// member's Raft and API addresses must pass it (allotctl checks them too,
// before calling).
func CheckDialAddr(addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return errors.New("not host:port")
	}
	if host == "" {
		return errors.New("no host")
	}
	if ip, err := netip.ParseAddr(host); err == nil {
		if ip.IsUnspecified() {
			return fmt.Errorf("%s is no address other nodes can dial", host)
		}
	} else if strings.ContainsFunc(host, func(r rune) bool {
		return !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '.' || r == '_')
	}) {
		return fmt.Errorf("host %q is neither a host name nor an IP address", host)
	}
	if n, err := strconv.ParseUint(port, 10, 16); err != nil || n == 0 {
		return fmt.Errorf("port %q is not a number in 1-65535", port)
	}
	return nil
}

// probeTimeout bounds one call of a membership check to another node.
const probeTimeout = time.Second

// catchUpPolls is how often AddMember asks a new member how far it has
// applied the log.
const catchUpPolls = 100 * time.Millisecond

// AddMember implements OperatorService.AddMember. The member is added as a
// non-voter first, and promoted to voter only once it has applied the log
// up to where the leader's stood when it was added: a voter that cannot be
// reached (a stopped node, a mistyped address) would count towards the
// quorum all the same, and one such voter added to a single node stops the
// cluster. When the new member does not catch up in time (within the
// call's deadline and a few apply timeouts), it stays a non-voter, which
// costs the quorum nothing, and the call fails with FailedPrecondition: a
// retry promotes it once it is reachable. A call for a voter of the same
// addresses succeeds (a retry); an id that is a member at another Raft
// address, or a Raft address of another member, is AlreadyExists.
func (s *Server) AddMember(ctx context.Context, req *connect.Request[allotv1.AddMemberRequest]) (*connect.Response[allotv1.AddMemberResponse], error) {
	const method = "AddMember"
	m := req.Msg
	if err := validateAddMember(m); err != nil {
		return nil, s.toConnect(method, err)
	}
	if resp, handled, err := forward(ctx, s, req, func(c *peerClient) func(context.Context, *connect.Request[allotv1.AddMemberRequest]) (*connect.Response[allotv1.AddMemberResponse], error) {
		return c.op.AddMember
	}); handled {
		if err != nil {
			return nil, s.toConnect(method, err)
		}
		return resp, nil
	}
	p := Peer{ID: m.GetId(), RaftAddr: m.GetRaftAddress(), APIAddr: m.GetApiAddress()}
	if err := s.addMember(ctx, p); err != nil {
		return nil, s.toConnect(method, err)
	}
	members, err := s.node.Members()
	if err != nil {
		return nil, s.toConnect(method, err)
	}
	s.log.Info("member added", zap.String("member", p.ID))
	s.metrics.Requests.WithLabelValues(method, "ok").Inc()
	return connect.NewResponse(&allotv1.AddMemberResponse{Members: membersToProto(members)}), nil
}

// addMember adds p as a non-voter (unless it is a member already), waits
// for it to catch up, and promotes it.
func (s *Server) addMember(ctx context.Context, p Peer) error {
	members, _, err := s.node.membership()
	if err != nil {
		return err
	}
	var cur *MemberInfo
	for i, o := range members {
		switch {
		case o.ID == p.ID:
			cur = &members[i]
		case o.RaftAddr == p.RaftAddr:
			return fmt.Errorf("raft_address: %q is the address of member %q: %w", p.RaftAddr, o.ID, errExists)
		}
	}
	switch {
	case cur == nil:
		if err := s.node.AddNonvoter(ctx, p); err != nil {
			return err
		}
	case cur.RaftAddr != p.RaftAddr:
		return fmt.Errorf("id: %q is already a member at raft address %q, not %q (remove it first to move it): %w",
			p.ID, cur.RaftAddr, p.RaftAddr, errExists)
	default:
		// A retry, or the promotion of a member added before: its API
		// address is the one this call gives.
		if err := s.node.RecordMember(ctx, p.ID, p.APIAddr); err != nil {
			return err
		}
		if cur.Suffrage == raft.Voter.String() {
			return nil
		}
	}
	// The configuration now holds p as a non-voter; a change after this
	// one (p removed meanwhile) makes the promotion fail rather than add p
	// back.
	_, confIndex, err := s.node.membership()
	if err != nil {
		return err
	}
	target := s.node.raft.LastIndex()
	if err := s.awaitCaughtUp(ctx, p, target); err != nil {
		return fmt.Errorf("id: %q was added as a non-voter but not promoted to voter: %v; "+
			"a non-voter costs the quorum nothing, and retrying AddMember promotes it once it is reachable and has caught up: %w",
			p.ID, err, errPrecondition)
	}
	return s.node.Promote(ctx, p, confIndex)
}

// awaitCaughtUp asks the new member p, at its API address, until it reports
// that it has applied the log up to index target. It gives up when the
// call's deadline comes near (keeping a quarter of what remains to answer)
// or after three apply timeouts, and then says why p did not catch up.
func (s *Server) awaitCaughtUp(ctx context.Context, p Peer, target uint64) error {
	budget := 3 * s.node.cfg.ApplyTimeout
	if dl, ok := ctx.Deadline(); ok {
		budget = min(budget, time.Until(dl)*3/4)
	}
	wctx, cancel := context.WithTimeout(ctx, budget)
	defer cancel()
	t := time.NewTicker(catchUpPolls)
	defer t.Stop()
	for {
		why := s.caughtUp(wctx, p, target)
		if why == nil {
			return nil
		}
		select {
		case <-wctx.Done():
			return fmt.Errorf("not caught up within %s: %w", budget.Round(time.Millisecond), why)
		case <-t.C:
		}
	}
}

// caughtUp returns nil when p reports, at its API address, that it has
// applied the log up to index target, and else why not.
func (s *Server) caughtUp(ctx context.Context, p Peer, target uint64) error {
	c, err := s.probe(ctx, p.ID, p.APIAddr)
	if err != nil {
		return fmt.Errorf("its api_address %w", err)
	}
	if c.GetAppliedIndex() < target {
		return fmt.Errorf("it has applied the log up to index %d of %d", c.GetAppliedIndex(), target)
	}
	return nil
}

// RemoveMember implements OperatorService.RemoveMember. Removing a voter
// is refused with FailedPrecondition unless a quorum of the voters that
// remain answer and follow this leader: the new configuration must commit
// with them, and a configuration whose quorum is cut off elects no leader,
// not even to undo the change, until they are back.
func (s *Server) RemoveMember(ctx context.Context, req *connect.Request[allotv1.RemoveMemberRequest]) (*connect.Response[allotv1.RemoveMemberResponse], error) {
	const method = "RemoveMember"
	id := req.Msg.GetId()
	// The member table holds no longer id (and removing one proposes its
	// removal from the table); a longer one is refused before it is quoted.
	if err := checkField("id", id, fsm.MaxMemberIDBytes); err != nil {
		return nil, s.toConnect(method, err)
	}
	if resp, handled, err := forward(ctx, s, req, func(c *peerClient) func(context.Context, *connect.Request[allotv1.RemoveMemberRequest]) (*connect.Response[allotv1.RemoveMemberResponse], error) {
		return c.op.RemoveMember
	}); handled {
		if err != nil {
			return nil, s.toConnect(method, err)
		}
		return resp, nil
	}
	members, err := s.node.Members()
	if err != nil {
		return nil, s.toConnect(method, err)
	}
	i := slices.IndexFunc(members, func(m MemberInfo) bool { return m.ID == id })
	if i < 0 {
		return nil, s.toConnect(method, fmt.Errorf("id: %q is not a member: %w", id, errNotFound))
	}
	if members[i].Suffrage == raft.Voter.String() {
		// A non-voter's removal leaves the voters, and the quorum, as they are.
		if err := s.checkQuorumWithout(ctx, members, id); err != nil {
			return nil, s.toConnect(method, err)
		}
	}
	if err := s.node.RemoveServer(ctx, id); err != nil {
		return nil, s.toConnect(method, err)
	}
	if members, err = s.node.Members(); err != nil {
		return nil, s.toConnect(method, err)
	}
	s.log.Info("member removed", zap.String("member", id))
	s.metrics.Requests.WithLabelValues(method, "ok").Inc()
	return connect.NewResponse(&allotv1.RemoveMemberResponse{Members: membersToProto(members)}), nil
}

// checkQuorumWithout returns nil when a quorum of the voters of members
// other than id answer and follow this leader (this node, when it stays, is
// one of them), and else an errPrecondition naming those that do not.
func (s *Server) checkQuorumWithout(ctx context.Context, members []MemberInfo, id string) error {
	self := s.node.cfg.NodeID
	term := s.node.raft.CurrentTerm()
	var remain []MemberInfo
	for _, m := range members {
		if m.ID != id && m.Suffrage == raft.Voter.String() {
			remain = append(remain, m)
		}
	}
	if len(remain) == 0 {
		return fmt.Errorf("id: %q is the only voter, and a cluster needs one: %w", id, errPrecondition)
	}
	why := make([]error, len(remain))
	var wg sync.WaitGroup
	for i, m := range remain {
		if m.ID == self {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			why[i] = s.follows(ctx, m, self, term)
		}()
	}
	wg.Wait()
	answered := 0
	var missing []string
	for i, m := range remain {
		if why[i] == nil {
			answered++
			continue
		}
		missing = append(missing, fmt.Sprintf("%s (%v)", m.ID, why[i]))
	}
	if quorum := len(remain)/2 + 1; answered < quorum {
		return fmt.Errorf("id: removing %q would leave %d voters, %d of which must be up to commit, and only %d are: "+
			"not reachable or not following this leader: %s; bring them back, or remove them first: %w",
			id, len(remain), quorum, answered, strings.Join(missing, "; "), errPrecondition)
	}
	return nil
}

// follows returns nil when member m answers at its API address that it
// follows leader in term, and else why not.
func (s *Server) follows(ctx context.Context, m MemberInfo, leader string, term uint64) error {
	if m.APIAddr == "" {
		return errors.New("no API address recorded")
	}
	c, err := s.probe(ctx, m.ID, m.APIAddr)
	if err != nil {
		return err
	}
	if c.GetLeaderId() != leader || c.GetTerm() != term {
		return fmt.Errorf("its leader is %q in term %d, not %q in term %d", c.GetLeaderId(), c.GetTerm(), leader, term)
	}
	return nil
}

// probe asks the node id at its API address addr for its view of the
// cluster, within probeTimeout, and checks that it answers as id.
func (s *Server) probe(ctx context.Context, id, addr string) (*allotv1.GetClusterResponse, error) {
	pctx, cancel := context.WithTimeout(ctx, probeTimeout)
	defer cancel()
	resp, err := s.peers.get(addr).op.GetCluster(pctx, connect.NewRequest(&allotv1.GetClusterRequest{}))
	if err != nil {
		return nil, fmt.Errorf("%s does not answer: %w", addr, err)
	}
	if got := resp.Msg.GetNodeId(); got != id {
		return nil, fmt.Errorf("%s answers as node %q", addr, got)
	}
	return resp.Msg, nil
}

// peerClient holds Connect clients for one node's API address.
type peerClient struct {
	alloc allotv1connect.AllocatorServiceClient
	op    allotv1connect.OperatorServiceClient
}

// peerClients caches a peerClient per address over one HTTP client.
type peerClients struct {
	http *http.Client
	mu   sync.Mutex
	m    map[string]*peerClient
}

func newPeerClients() *peerClients {
	return &peerClients{http: NewHTTPClient(), m: map[string]*peerClient{}}
}

func (p *peerClients) get(addr string) *peerClient {
	p.mu.Lock()
	defer p.mu.Unlock()
	c, ok := p.m[addr]
	if !ok {
		base := baseURL(addr)
		c = &peerClient{
			alloc: allotv1connect.NewAllocatorServiceClient(p.http, base),
			op:    allotv1connect.NewOperatorServiceClient(p.http, base),
		}
		p.m[addr] = c
	}
	return c
}
