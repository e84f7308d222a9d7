package agent

import (
	"context"

	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// GRPCAdmissionService serves allot.v1.AdmissionService (Check and
// ReleaseSlot, the same API as the Connect handlers) on the agent's gRPC
// listener, next to Envoy's RLS. gRPC clients, and Connect clients built
// with connect.WithGRPC(), reach it there; that listener runs gRPC's native
// HTTP/2 transport, which costs less CPU per call than net/http's (see
// docs/agent-bench.md). Answers and error codes are the Connect handlers'.
type GRPCAdmissionService struct {
	allotv1.UnimplementedAdmissionServiceServer
	s *AdmissionService
}

var _ allotv1.AdmissionServiceServer = (*GRPCAdmissionService)(nil)

// NewGRPCAdmissionService returns the gRPC handlers of a.
func NewGRPCAdmissionService(a *Agent) *GRPCAdmissionService {
	return &GRPCAdmissionService{s: NewAdmissionService(a)}
}

// Check implements AdmissionService.Check over gRPC.
func (g *GRPCAdmissionService) Check(ctx context.Context, req *allotv1.CheckRequest) (*allotv1.CheckResponse, error) {
	a := g.s.a
	t0 := a.now()
	defer func() { a.m.latency.WithLabelValues("grpc").Observe(a.now().Sub(t0).Seconds()) }()
	v, err := g.s.check(ctx, req)
	if err != nil {
		a.m.badRequests.WithLabelValues("grpc", codeOf(err).String()).Inc()
		return nil, toGRPC(a.log, err)
	}
	return checkResponse(v), nil
}

// ReleaseSlot implements AdmissionService.ReleaseSlot over gRPC.
func (g *GRPCAdmissionService) ReleaseSlot(ctx context.Context, req *allotv1.ReleaseSlotRequest) (*allotv1.ReleaseSlotResponse, error) {
	a := g.s.a
	n, err := g.s.releaseSlot(ctx, req)
	if err != nil {
		a.m.badRequests.WithLabelValues("grpc", codeOf(err).String()).Inc()
		return nil, toGRPC(a.log, err)
	}
	return &allotv1.ReleaseSlotResponse{Released: n}, nil
}
