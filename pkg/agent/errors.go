package agent

import (
	"context"
	"errors"

	"connectrpc.com/connect"
	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/allot-dev/allot/pkg/admission"
)

// ErrInvalidRequest is wrapped by every error about bad input that the agent
// itself finds (a negative cost, a malformed Envoy request, a missing request
// id); the message before it names the field. Errors of the engine about bad
// input wrap admission.ErrInvalidRequest instead. Nothing is debited.
var ErrInvalidRequest = errors.New("invalid request")

// ErrNotReady is returned while no policy is in force yet: the agent has no
// last-known-good policy and has not reached the allocator.
var ErrNotReady = errors.New("no policy in force yet")

// ErrUnavailable is what the gRPC (Envoy) API answers when the limiter
// cannot decide a request (a 503 on the Connect API): a fail-closed rule
// whose store did not answer, or a leased pool that ran dry while the
// allocator is unreachable.
var ErrUnavailable = errors.New("limiter cannot decide")

// ErrPolicyRejected is wrapped by the reasons a published policy record is
// refused (older than the one in force, malformed, digest mismatch); the
// version in force stays.
var ErrPolicyRejected = errors.New("policy rejected")

// ErrMalformedGrant is wrapped by the reasons an Acquire answer is refused
// (wrong number of grants, a grant for another quota, tokens or expiry out of
// range): nothing of it is deposited.
var ErrMalformedGrant = errors.New("malformed allocator answer")

// codeOf maps an error to its Connect code: the one place errors become
// codes, for the Connect and the gRPC (Envoy) handlers alike.
func codeOf(err error) connect.Code {
	switch {
	case errors.Is(err, ErrInvalidRequest), errors.Is(err, admission.ErrInvalidRequest):
		return connect.CodeInvalidArgument
	case errors.Is(err, ErrNotReady), errors.Is(err, ErrUnavailable), errors.Is(err, admission.ErrUnavailable), errors.Is(err, admission.ErrClosed):
		return connect.CodeUnavailable
	case errors.Is(err, context.DeadlineExceeded):
		return connect.CodeDeadlineExceeded
	case errors.Is(err, context.Canceled):
		return connect.CodeCanceled
	}
	return connect.CodeInternal
}

// toConnect turns err into a Connect error. Input errors carry their message
// (it names the field); internal errors are logged and reach the client only
// as "internal error".
func toConnect(log *zap.Logger, err error) error {
	code := codeOf(err)
	if code == connect.CodeInternal {
		log.Error("internal error", zap.Error(err))
		return connect.NewError(code, errors.New("internal error"))
	}
	return connect.NewError(code, err)
}

// toGRPC turns err into a gRPC status error with the same mapping (Connect
// and gRPC share code numbers).
func toGRPC(log *zap.Logger, err error) error {
	code := codeOf(err)
	if code == connect.CodeInternal {
		log.Error("internal error", zap.Error(err))
		return status.Error(codes.Internal, "internal error")
	}
	return status.Error(codes.Code(code), err.Error())
}
