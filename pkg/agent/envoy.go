package agent

import (
	"context"
	"fmt"
	"math"
	"strconv"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	ratelimitv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/policy"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// RequestIDKey is the suggested Config.EnvoyRequestIDKey: the descriptor key
// of the request id (Envoy's request_headers action on x-request-id, for
// example) when your own edge generates it per request. ShouldRateLimit
// takes a request id only when Config.EnvoyRequestIDKey is set.
const RequestIDKey = "request_id"

// RateLimitService serves Envoy's envoy.service.ratelimit.v3 API on an
// agent, so Envoy, Istio and other proxies use allot as their global rate
// limiter.
//
// Envoy sends several descriptors per request; allot decides a request
// against all of its rules at once, so the entries of every descriptor are
// merged into one descriptor (a key given twice must carry the same value)
// and decided atomically. Each descriptor's status reports the rules it is
// about, those whose match keys all appear among its entries: OVER_LIMIT
// when one of them denied, else OK with the tightest one's remaining count,
// limit (when its window is a unit Envoy names) and time to reset.
//
// hits_addend is the cost: as in Envoy, a descriptor's hits_addend
// overrides the request's (0 meaning 1) for that descriptor, and since one
// request has one cost in allot, every descriptor's hits must then be equal
// (else InvalidArgument); a descriptor hits_addend of 0 (check without
// consuming) is not supported. An entry keyed Config.EnvoyRequestIDKey, when
// that is set, is the request id instead of an entry (a request with no
// other entry is InvalidArgument, as one without descriptors).
//
// The domain selects nothing: limits and counters come from the allot
// policy, so with Config.EnvoyDomain empty every domain is served and all
// share the same counters; set it (-envoy-domain) to refuse other domains.
//
// A denial is OVER_LIMIT with retry-after and x-allot-* response headers.
// When the limiter cannot decide (a fail-closed rule whose store is down, or
// a leased pool that ran dry while the allocator is unreachable), the call
// fails with gRPC UNAVAILABLE: configure the filter with
// failure_mode_deny: true and status_on_error: {code: ServiceUnavailable}
// so Envoy answers 503, as allot's other APIs do. (With Envoy's default
// failure_mode_deny: false it would admit: fail open.)
type RateLimitService struct {
	rlsv3.UnimplementedRateLimitServiceServer
	a *Agent
}

var _ rlsv3.RateLimitServiceServer = (*RateLimitService)(nil)

// NewRateLimitService returns the RLS handler of a.
func NewRateLimitService(a *Agent) *RateLimitService { return &RateLimitService{a: a} }

// grpcWorkers is the size of the gRPC server's handler pool; calls beyond
// it get goroutines of their own.
const grpcWorkers = 64

// NewGRPCServer returns a gRPC server with the RLS service and
// allot.v1.AdmissionService (GRPCAdmissionService) registered, and
// messages over Config.MaxRequestBytes refused with RESOURCE_EXHAUSTED. It
// is served on its own listener (Envoy's rate limit cluster points at it),
// which keeps gRPC's native HTTP/2 transport on the hot path.
func NewGRPCServer(a *Agent, opts ...grpc.ServerOption) *grpc.Server {
	opts = append([]grpc.ServerOption{
		grpc.MaxRecvMsgSize(a.cfg.MaxRequestBytes),
		// Handlers run on a pool of goroutines whose stacks have grown
		// already, instead of a fresh goroutine (and stack growth) per call.
		grpc.NumStreamWorkers(grpcWorkers),
	}, opts...)
	s := grpc.NewServer(opts...)
	rlsv3.RegisterRateLimitServiceServer(s, NewRateLimitService(a))
	allotv1.RegisterAdmissionServiceServer(s, NewGRPCAdmissionService(a))
	return s
}

// ShouldRateLimit implements RateLimitService.ShouldRateLimit.
func (s *RateLimitService) ShouldRateLimit(ctx context.Context, req *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
	t0 := s.a.now()
	defer func() { s.a.m.latency.WithLabelValues("envoy").Observe(s.a.now().Sub(t0).Seconds()) }()
	in, paths, idPath, err := s.input(req)
	var v *Verdict
	if err == nil {
		v, err = s.a.Check(ctx, in)
		err = apiFields(err, func(i int) string {
			if i >= 0 && i < len(paths) {
				return paths[i]
			}
			return "descriptors (merged entry " + strconv.Itoa(i) + ")"
		}, "descriptors", "hits_addend", idPath)
	}
	if err != nil {
		s.a.m.badRequests.WithLabelValues("envoy", codeOf(err).String()).Inc()
		return nil, toGRPC(s.a.log, err)
	}
	if v.Unavailable {
		return nil, toGRPC(s.a.log, fmt.Errorf("rule %s could not be decided (decision %s, retry after %ds): %w",
			v.Rule, v.DecisionID, v.RetryAfter, ErrUnavailable))
	}
	code := rlsv3.RateLimitResponse_OK
	if !v.Allowed {
		code = rlsv3.RateLimitResponse_OVER_LIMIT
	}
	resp := &rlsv3.RateLimitResponse{OverallCode: code, Statuses: s.statuses(req, v)}
	if !v.Allowed {
		h := func(k, val string) *corev3.HeaderValue { return &corev3.HeaderValue{Key: k, Value: val} }
		resp.ResponseHeadersToAdd = []*corev3.HeaderValue{
			h("x-allot-rule", v.Rule),
			h("x-allot-scope", string(v.Scope)),
			h("x-allot-decision-id", v.DecisionID),
			h("x-allot-policy-version", strconv.FormatUint(v.PolicyVersion, 10)),
		}
		if v.RetryAfter > 0 {
			resp.ResponseHeadersToAdd = append(resp.ResponseHeadersToAdd, h("retry-after", strconv.FormatInt(v.RetryAfter, 10)))
		}
	}
	return resp, nil
}

// statuses are the per-descriptor answers: each descriptor is given the
// rules it is about, the ones whose match keys all appear among its entries
// (a rule whose keys span descriptors goes to each descriptor holding one
// of them). A descriptor is OVER_LIMIT when one of its rules denied, with
// the wait as duration_until_reset; otherwise OK, with its tightest rule's
// remaining count, its limit when the rule's window is a unit Envoy names
// (second, minute, hour, day) and the time until that rule is whole. A
// descriptor no live rule is about is OK with nothing else. If the
// denying rule could be given to no descriptor, every status carries the
// overall code, so the statuses never contradict it.
func (s *RateLimitService) statuses(req *rlsv3.RateLimitRequest, v *Verdict) []*rlsv3.RateLimitResponse_DescriptorStatus {
	descs := req.GetDescriptors()
	out := make([]*rlsv3.RateLimitResponse_DescriptorStatus, len(descs))
	best := make([]*admission.RuleResult, len(descs))
	denied := false
	for i := range v.Rules {
		r := &v.Rules[i]
		if r.Shadow {
			continue
		}
		whole := false
		for j, d := range descs {
			if coversAll(d, r.Def) {
				whole = true
				best[j] = tighter(best[j], r)
			}
		}
		if !whole {
			for j, d := range descs {
				if coversAny(d, r.Def) {
					best[j] = tighter(best[j], r)
				}
			}
		}
	}
	for j := range descs {
		st := &rlsv3.RateLimitResponse_DescriptorStatus{Code: rlsv3.RateLimitResponse_OK}
		out[j] = st
		r := best[j]
		if r == nil {
			continue
		}
		if r.Remaining >= 0 {
			st.LimitRemaining = uint32(min(r.Remaining, math.MaxUint32))
		}
		if !r.Allowed {
			denied = true
			st.Code = rlsv3.RateLimitResponse_OVER_LIMIT
			if v.RetryAfter > 0 {
				st.DurationUntilReset = durationpb.New(secondsDuration(v.RetryAfter))
			}
		} else if r.Reset > 0 {
			st.DurationUntilReset = durationpb.New(secondsDuration(r.Reset))
		}
		if u, ok := envoyUnits[r.Window]; ok && r.Quota > 0 && r.Quota <= math.MaxUint32 {
			st.CurrentLimit = &rlsv3.RateLimitResponse_RateLimit{Name: r.Rule, RequestsPerUnit: uint32(r.Quota), Unit: u}
		}
	}
	if !v.Allowed && !denied {
		for _, st := range out {
			st.Code = rlsv3.RateLimitResponse_OVER_LIMIT
			if v.RetryAfter > 0 {
				st.DurationUntilReset = durationpb.New(secondsDuration(v.RetryAfter))
			}
		}
	}
	return out
}

// envoyUnits are the windows (in seconds) Envoy's RateLimit units name.
var envoyUnits = map[int64]rlsv3.RateLimitResponse_RateLimit_Unit{
	1:     rlsv3.RateLimitResponse_RateLimit_SECOND,
	60:    rlsv3.RateLimitResponse_RateLimit_MINUTE,
	3600:  rlsv3.RateLimitResponse_RateLimit_HOUR,
	86400: rlsv3.RateLimitResponse_RateLimit_DAY,
}

// tighter is the rule a descriptor's status reports, of cur and r: a
// denying rule first, then the one with the least remaining.
func tighter(cur, r *admission.RuleResult) *admission.RuleResult {
	switch {
	case cur == nil:
		return r
	case cur.Allowed != r.Allowed:
		if !r.Allowed {
			return r
		}
		return cur
	case r.Remaining >= 0 && (cur.Remaining < 0 || r.Remaining < cur.Remaining):
		return r
	}
	return cur
}

// coversAll reports whether d has an entry for every match key of rule.
func coversAll(d *ratelimitv3.RateLimitDescriptor, rule *policy.Rule) bool {
	if rule == nil {
		return false
	}
	for _, m := range rule.Match {
		if !hasKey(d, m.Key) {
			return false
		}
	}
	return len(rule.Match) > 0
}

// coversAny reports whether d has an entry for a match key of rule.
func coversAny(d *ratelimitv3.RateLimitDescriptor, rule *policy.Rule) bool {
	if rule == nil {
		return false
	}
	for _, m := range rule.Match {
		if hasKey(d, m.Key) {
			return true
		}
	}
	return false
}

func hasKey(d *ratelimitv3.RateLimitDescriptor, key string) bool {
	for _, e := range d.GetEntries() {
		if e.GetKey() == key {
			return true
		}
	}
	return false
}

// input validates an Envoy request and merges its descriptors. paths[i]
// is where the merged entry i came from (descriptors[d].entries[e]), for
// errors about it; idPath is where the request id came from
// (descriptors[d].entries[e].value), "" when there is none.
func (s *RateLimitService) input(req *rlsv3.RateLimitRequest) (in *Input, paths []string, idPath string, err error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf(format+": %w", append(args, ErrInvalidRequest)...)
	}
	descs := req.GetDescriptors()
	switch {
	case req.GetDomain() == "":
		return nil, nil, "", bad("domain: must not be empty")
	case s.a.cfg.EnvoyDomain != "" && req.GetDomain() != s.a.cfg.EnvoyDomain:
		return nil, nil, "", bad("domain: %q is not served here (want %q)", truncate(req.GetDomain()), s.a.cfg.EnvoyDomain)
	case len(descs) == 0:
		return nil, nil, "", bad("descriptors: must not be empty")
	case len(descs) > admission.MaxDescriptors:
		return nil, nil, "", bad("descriptors: %d, the limit is %d", len(descs), admission.MaxDescriptors)
	}
	// A descriptor's hits_addend overrides the request's (0 meaning 1) for
	// that descriptor. allot charges the merged request once, so every
	// descriptor's hits must be the same: the request's, when a descriptor
	// goes without an override, else the first override's.
	hits, hitsFrom := uint64(max(req.GetHitsAddend(), 1)), ""
	for i, d := range descs {
		if d.GetHitsAddend() == nil {
			hitsFrom = fmt.Sprintf("the %d that descriptors[%d] takes from the request's hits_addend (0 meaning 1)", hits, i)
			break
		}
	}
	in = &Input{}
	from := map[string]int{} // key -> index of the first descriptor giving it
	idKey := s.a.cfg.EnvoyRequestIDKey
	for i, d := range descs {
		switch {
		case d == nil || len(d.GetEntries()) == 0:
			return nil, nil, "", bad("descriptors[%d].entries: must not be empty", i)
		case d.GetLimit() != nil:
			return nil, nil, "", bad("descriptors[%d].limit: overrides are not supported; limits come from the allot policy", i)
		case d.GetIsNegativeHits():
			return nil, nil, "", bad("descriptors[%d].is_negative_hits: refunds are not supported", i)
		}
		if h := d.GetHitsAddend(); h != nil {
			switch v := h.GetValue(); {
			case v == 0:
				return nil, nil, "", bad("descriptors[%d].hits_addend: 0 (check without consuming) is not supported", i)
			case v > uint64(admission.MaxHits):
				return nil, nil, "", bad("descriptors[%d].hits_addend: %d exceeds the maximum %d", i, v, int64(admission.MaxHits))
			case hitsFrom == "":
				hits, hitsFrom = v, fmt.Sprintf("descriptors[%d].hits_addend", i)
			case v != hits:
				return nil, nil, "", bad("descriptors[%d].hits_addend: %d differs from %s; allot decides a request's descriptors together, and one request has one cost in allot", i, v, hitsFrom)
			}
		}
		for j, e := range d.GetEntries() {
			if e.GetKey() == "" {
				return nil, nil, "", bad("descriptors[%d].entries[%d].key: must not be empty", i, j)
			}
			if idKey != "" && e.GetKey() == idKey {
				if idPath != "" {
					if e.GetValue() != in.RequestID {
						return nil, nil, "", bad("descriptors[%d].entries[%d].value: a second, different %s (%q at %s)", i, j, truncate(idKey), truncate(in.RequestID), idPath)
					}
					continue
				}
				in.RequestID = e.GetValue()
				idPath = fmt.Sprintf("descriptors[%d].entries[%d].value", i, j)
				continue
			}
			if k, seen := from[e.GetKey()]; seen {
				if prev := in.Descriptors[k].Value; prev != e.GetValue() {
					return nil, nil, "", bad("descriptors[%d].entries[%d]: %s=%q conflicts with %q given earlier", i, j, truncate(e.GetKey()), truncate(e.GetValue()), truncate(prev))
				}
				continue
			}
			from[e.GetKey()] = len(in.Descriptors)
			in.Descriptors = append(in.Descriptors, policy.Entry{Key: e.GetKey(), Value: e.GetValue()})
			paths = append(paths, fmt.Sprintf("descriptors[%d].entries[%d]", i, j))
		}
	}
	if len(in.Descriptors) == 0 {
		// Nothing to decide by, as with no descriptors at all.
		return nil, nil, "", bad("descriptors: must not be empty (the only entries are the request id, %s)", truncate(idKey))
	}
	in.Cost = int64(hits)
	return in, paths, idPath, nil
}

func secondsDuration(n int64) time.Duration { return time.Duration(n) * time.Second }

func truncate(s string) string {
	if len(s) > 64 {
		return s[:64] + "..."
	}
	return s
}
