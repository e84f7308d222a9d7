package allocator

import (
	"context"
	"errors"
	"time"

	"connectrpc.com/connect"
	spb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/anypb"

	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// grpcWorkers is the size of the gRPC server's handler pool; calls beyond it
// get goroutines of their own.
const grpcWorkers = 64

// NewGRPCServer returns a gRPC server for AllocatorService (Acquire and
// Release) on s, on grpc-go's own HTTP/2 transport. The Connect API serves
// the same calls (gRPC protocol included) on net/http, whose HTTP/2 server
// costs about twice the CPU per call; callers that make many calls, such as
// region agents with -allocators-grpc, use this listener instead. The calls
// behave as on the Connect API: validation, forwarding to the leader,
// metrics, error codes and the leader hint detail are the same. Messages
// over Config.MaxBodyBytes are refused with RESOURCE_EXHAUSTED.
func NewGRPCServer(s *Server, opts ...grpc.ServerOption) *grpc.Server {
	opts = append([]grpc.ServerOption{
		grpc.MaxRecvMsgSize(s.node.cfg.MaxBodyBytes),
		// Handlers run on goroutines whose stacks have grown already.
		grpc.NumStreamWorkers(grpcWorkers),
		// Clients ping idle connections (grpcKeepalive) to notice a peer a
		// partition left half-dead; pings that often are welcome.
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 5 * time.Second, PermitWithoutStream: true}),
	}, opts...)
	g := grpc.NewServer(opts...)
	allotv1.RegisterAllocatorServiceServer(g, grpcAllocator{s: s})
	return g
}

// grpcAllocator serves AllocatorService on grpc-go through the Connect
// handlers' methods.
type grpcAllocator struct {
	allotv1.UnimplementedAllocatorServiceServer
	s *Server
}

func (g grpcAllocator) Acquire(ctx context.Context, req *allotv1.AcquireRequest) (*allotv1.AcquireResponse, error) {
	resp, err := g.s.Acquire(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, grpcError(err)
	}
	return resp.Msg, nil
}

func (g grpcAllocator) Release(ctx context.Context, req *allotv1.ReleaseRequest) (*allotv1.ReleaseResponse, error) {
	resp, err := g.s.Release(ctx, connect.NewRequest(req))
	if err != nil {
		return nil, grpcError(err)
	}
	return resp.Msg, nil
}

// grpcError turns a Connect error into a gRPC status with the same code,
// message and details (the leader hint among them).
func grpcError(err error) error {
	var ce *connect.Error
	if !errors.As(err, &ce) {
		return status.Error(codes.Internal, "internal error")
	}
	st := &spb.Status{Code: int32(ce.Code()), Message: ce.Message()}
	for _, d := range ce.Details() {
		st.Details = append(st.Details, &anypb.Any{TypeUrl: "type.googleapis.com/" + d.Type(), Value: d.Bytes()})
	}
	return status.FromProto(st).Err()
}

// connectError turns a gRPC call's error into a Connect error with the same
// code, message and details, so that callers (connect.CodeOf,
// LeaderHintOf) see one kind of error whichever transport a call took.
func connectError(err error) error {
	st, ok := status.FromError(err)
	if !ok {
		return connect.NewError(connect.CodeUnknown, err)
	}
	if st.Code() == codes.OK {
		return nil
	}
	ce := connect.NewError(connect.Code(st.Code()), errors.New(st.Message()))
	for _, a := range st.Proto().GetDetails() {
		m, err := a.UnmarshalNew()
		if err != nil {
			continue // a detail of a type this build does not know
		}
		if d, err := connect.NewErrorDetail(m); err == nil {
			ce.AddDetail(d)
		}
	}
	return ce
}

// grpcKeepalive pings a connection idle for 10 s (grpc-go's shortest) and
// closes it when the ping is not answered within a second.
var grpcKeepalive = keepalive.ClientParameters{Time: 10 * time.Second, Timeout: time.Second, PermitWithoutStream: true}
