package allocator

import (
	"context"
	"errors"

	"connectrpc.com/connect"
	"go.uber.org/zap"

	"github.com/allot-dev/allot/fsm"
	"github.com/allot-dev/allot/pkg/policy"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// toConnect maps an error to a Connect error in one place. Messages of input
// errors go to the client (they name the field); internal errors are logged
// and reach the client only as a generic message.
func (s *Server) toConnect(method string, err error) error {
	var ce *connect.Error
	code := connect.CodeInternal
	switch {
	case errors.As(err, &ce):
		s.metrics.Requests.WithLabelValues(method, ce.Code().String()).Inc()
		return err
	case errors.Is(err, fsm.ErrUnknownQuota), errors.Is(err, fsm.ErrUnknownGrant), errors.Is(err, errNotFound):
		code = connect.CodeNotFound
	case errors.Is(err, fsm.ErrInvalidArgument), errors.Is(err, fsm.ErrMalformedCommand), errors.Is(err, policy.ErrInvalid), errors.Is(err, errInvalid):
		code = connect.CodeInvalidArgument
	case errors.Is(err, errExists):
		code = connect.CodeAlreadyExists
	case errors.Is(err, fsm.ErrStaleVersion), errors.Is(err, errPrecondition), errors.Is(err, ErrMembershipRefused):
		code = connect.CodeFailedPrecondition
	case errors.Is(err, fsm.ErrResourceExhausted):
		code = connect.CodeResourceExhausted
	case errors.Is(err, ErrNotLeader), errors.Is(err, ErrUnknownOutcome):
		code = connect.CodeUnavailable
	case errors.Is(err, context.DeadlineExceeded):
		code = connect.CodeDeadlineExceeded
	case errors.Is(err, context.Canceled):
		code = connect.CodeCanceled
	}
	s.metrics.Requests.WithLabelValues(method, code.String()).Inc()
	if code == connect.CodeInternal {
		s.log.Error("internal error", zap.String("method", method), zap.Error(err))
		return connect.NewError(code, errors.New("internal error"))
	}
	out := connect.NewError(code, err)
	if code == connect.CodeUnavailable {
		id, api := s.node.Leader()
		if d, derr := connect.NewErrorDetail(&allotv1.LeaderHint{LeaderId: id, LeaderApiAddress: api}); derr == nil {
			out.AddDetail(d)
		}
		if api != "" {
			out.Meta().Set(headerLeader, api)
		}
	}
	return out
}

// errNotFound, errInvalid, errExists and errPrecondition mark errors of
// the server itself whose message goes to the client: the message before
// them names the field, or says what the cluster's state refuses.
var (
	errNotFound     = errors.New("not found")
	errInvalid      = errors.New("invalid")
	errExists       = errors.New("already exists")
	errPrecondition = errors.New("failed precondition")
)

// LeaderHintOf extracts the leader's API address from an Unavailable error.
func LeaderHintOf(err error) string {
	var ce *connect.Error
	if !errors.As(err, &ce) {
		return ""
	}
	for _, d := range ce.Details() {
		v, derr := d.Value()
		if derr != nil {
			continue
		}
		if h, ok := v.(*allotv1.LeaderHint); ok && h.GetLeaderApiAddress() != "" {
			return h.GetLeaderApiAddress()
		}
	}
	return ce.Meta().Get(headerLeader)
}
