package agent

import (
	"context"
	"fmt"
	"net/http"
	"strconv"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/policy"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
	"github.com/allot-dev/allot/proto/allot/v1/allotv1connect"
)

// AdmissionService serves allot.v1.AdmissionService (Connect, gRPC and
// gRPC-Web) on an agent.
type AdmissionService struct{ a *Agent }

var _ allotv1connect.AdmissionServiceHandler = (*AdmissionService)(nil)

// NewAdmissionService returns the Connect handlers of a.
func NewAdmissionService(a *Agent) *AdmissionService { return &AdmissionService{a: a} }

// Handler returns the service's path and handler, with bodies over
// Config.MaxRequestBytes refused with ResourceExhausted.
func (s *AdmissionService) Handler() (string, http.Handler) {
	return allotv1connect.NewAdmissionServiceHandler(s,
		connect.WithReadMaxBytes(s.a.cfg.MaxRequestBytes),
		connect.WithCompressMinBytes(4096),
	)
}

// entriesOf converts the request's descriptor entries, which must not be
// empty (errNoEntries).
func entriesOf(in []*allotv1.DescriptorEntry) ([]policy.Entry, error) {
	if len(in) == 0 {
		return nil, errNoEntries
	}
	es := make([]policy.Entry, len(in))
	for i, e := range in {
		if e == nil {
			return nil, fmt.Errorf("entries[%d]: missing: %w", i, ErrInvalidRequest)
		}
		es[i] = policy.Entry{Key: e.GetKey(), Value: e.GetValue()}
	}
	return es, nil
}

// Check implements AdmissionService.Check. A decision is always a response
// (allowed, denied with retry_after_seconds, or unavailable); only bad input
// and a missing policy are errors.
func (s *AdmissionService) Check(ctx context.Context, req *connect.Request[allotv1.CheckRequest]) (*connect.Response[allotv1.CheckResponse], error) {
	t0 := s.a.now()
	defer func() { s.a.m.latency.WithLabelValues("connect").Observe(s.a.now().Sub(t0).Seconds()) }()
	v, err := s.check(ctx, req.Msg)
	if err != nil {
		s.a.m.badRequests.WithLabelValues("connect", codeOf(err).String()).Inc()
		return nil, toConnect(s.a.log, err)
	}
	return connect.NewResponse(checkResponse(v)), nil
}

// checkResponse is the wire form of a verdict.
func checkResponse(v *Verdict) *allotv1.CheckResponse {
	return &allotv1.CheckResponse{
		Allowed:           v.Allowed,
		Rule:              v.Rule,
		Scope:             string(v.Scope),
		RetryAfterSeconds: v.RetryAfter,
		Remaining:         v.Remaining,
		DecisionId:        v.DecisionID,
		PolicyVersion:     v.PolicyVersion,
		WouldDeny:         v.WouldDeny,
		Unavailable:       v.Unavailable,
		Replayed:          v.Source == admission.SourceReplay,
		Degraded:          v.Source == admission.SourceFailMode,
	}
}

// errNoEntries is the answer to a check (or a ReleaseSlot) without entries:
// a gateway's bug (it sent nothing to decide by), not a request that no rule
// matches. Entries with empty values are a request (an empty value counts as
// absent).
var errNoEntries = fmt.Errorf("entries: must not be empty: %w", ErrInvalidRequest)

// check decides one CheckRequest, for Check and for each check of a batch.
func (s *AdmissionService) check(ctx context.Context, m *allotv1.CheckRequest) (*Verdict, error) {
	es, err := entriesOf(m.GetEntries())
	if err != nil {
		return nil, err
	}
	v, err := s.a.Check(ctx, &Input{Descriptors: es, Cost: m.GetCost(), RequestID: m.GetRequestId()})
	return v, apiFields(err, entryPath, "entries", "cost", "request_id")
}

// entryPath is the Check API's path of a request's i-th entry.
func entryPath(i int) string { return "entries[" + strconv.Itoa(i) + "]" }

// ReleaseSlot implements AdmissionService.ReleaseSlot.
func (s *AdmissionService) ReleaseSlot(ctx context.Context, req *connect.Request[allotv1.ReleaseSlotRequest]) (*connect.Response[allotv1.ReleaseSlotResponse], error) {
	n, err := s.releaseSlot(ctx, req.Msg)
	if err != nil {
		s.a.m.badRequests.WithLabelValues("connect", codeOf(err).String()).Inc()
		return nil, toConnect(s.a.log, err)
	}
	return connect.NewResponse(&allotv1.ReleaseSlotResponse{Released: n}), nil
}

// releaseSlot frees one request's slots, for the Connect and gRPC
// handlers. Entries are required as in check: without them no slot can be
// found, and answering "0 released" would leave the caller's slots held
// until their slot_ttl.
func (s *AdmissionService) releaseSlot(ctx context.Context, m *allotv1.ReleaseSlotRequest) (int64, error) {
	es, err := entriesOf(m.GetEntries())
	if err != nil {
		return 0, err
	}
	n, err := s.a.ReleaseSlot(ctx, es, m.GetRequestId())
	return n, apiFields(err, entryPath, "entries", "cost", "request_id")
}

// Mux serves the agent's Connect API, /metrics (when gatherer is set),
// /healthz (the process is up) and /readyz (Agent.Ready: a policy is in
// force, and its regions include the agent's; 503 with the reason when not).
func Mux(a *Agent, gatherer prometheus.Gatherer) http.Handler {
	mux := http.NewServeMux()
	mux.Handle(NewAdmissionService(a).Handler())
	if gatherer != nil {
		mux.Handle("/metrics", promhttp.HandlerFor(gatherer, promhttp.HandlerOpts{}))
	}
	mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) {
		_, _ = w.Write([]byte("ok\n"))
	})
	mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
		if why := a.NotReadyReason(); why != "" {
			http.Error(w, why, http.StatusServiceUnavailable)
			return
		}
		_, _ = fmt.Fprintf(w, "policy v%d\n", a.PolicyVersion())
	})
	return mux
}
