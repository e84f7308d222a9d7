package agent

import (
	"context"
	"errors"
	"fmt"

	"connectrpc.com/connect"
	"google.golang.org/grpc"

	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// MaxBatchChecks is the most checks one CheckBatch call may carry.
const MaxBatchChecks = 1024

// checkBatch decides every check of m side by side and hands their outcomes
// to send as they are decided: the outcomes ready together go in one
// message, so a batch decided in one store round trip is answered with one
// message, and a check that waits (for a renewal, say) holds back no other.
// Only a malformed batch as a whole (too many checks, a missing check) is an
// error of the call; a check's own bad input is that check's outcome.
func (s *AdmissionService) checkBatch(ctx context.Context, api string, m *allotv1.CheckBatchRequest, send func(*allotv1.CheckBatchResponse) error) error {
	checks := m.GetChecks()
	if len(checks) > MaxBatchChecks {
		return fmt.Errorf("checks: %d checks, at most %d per call: %w", len(checks), MaxBatchChecks, ErrInvalidRequest)
	}
	for i, c := range checks {
		if c == nil {
			return fmt.Errorf("checks[%d]: missing: %w", i, ErrInvalidRequest)
		}
	}
	if len(checks) == 0 {
		return nil
	}
	a := s.a
	latency := a.m.latency.WithLabelValues(api)
	ctx, cancel := context.WithCancel(ctx)
	defer cancel() // a failed send stops the checks still waiting
	done := make(chan *allotv1.CheckOutcome, len(checks))
	for i, c := range checks {
		a.items.Go(func() {
			t0 := a.now()
			o := &allotv1.CheckOutcome{Index: uint32(i)}
			v, err := s.check(ctx, c)
			if err != nil {
				code := codeOf(err)
				if code == connect.CodeInvalidArgument {
					// The message names the check's field: name the check.
					err = fmt.Errorf("checks[%d].%w", i, err)
				}
				a.m.badRequests.WithLabelValues(api, code.String()).Inc()
				o.Error = &allotv1.CheckError{Code: code.String(), Message: publicMessage(a, err)}
			} else {
				o.Response = checkResponse(v)
			}
			latency.Observe(a.now().Sub(t0).Seconds())
			done <- o
		})
	}
	for left := len(checks); left > 0; {
		msg := &allotv1.CheckBatchResponse{Outcomes: []*allotv1.CheckOutcome{<-done}}
		for more := true; more && len(msg.Outcomes) < left; {
			select {
			case o := <-done:
				msg.Outcomes = append(msg.Outcomes, o)
			default:
				more = false
			}
		}
		left -= len(msg.Outcomes)
		if err := send(msg); err != nil {
			return err
		}
	}
	return nil
}

// publicMessage is what a client is told of err: its message for input
// errors (it names the field), "internal error" (logged) otherwise.
func publicMessage(a *Agent, err error) string {
	var ce *connect.Error
	if errors.As(toConnect(a.log, err), &ce) {
		return ce.Message()
	}
	return err.Error()
}

// CheckBatch implements AdmissionService.CheckBatch.
func (s *AdmissionService) CheckBatch(ctx context.Context, req *connect.Request[allotv1.CheckBatchRequest], stream *connect.ServerStream[allotv1.CheckBatchResponse]) error {
	if err := s.checkBatch(ctx, "connect-batch", req.Msg, stream.Send); err != nil {
		if errors.Is(err, ErrInvalidRequest) {
			s.a.m.badRequests.WithLabelValues("connect-batch", codeOf(err).String()).Inc()
			return toConnect(s.a.log, err)
		}
		return err // the stream broke: the client is gone
	}
	return nil
}

// CheckBatch implements AdmissionService.CheckBatch over gRPC.
func (g *GRPCAdmissionService) CheckBatch(req *allotv1.CheckBatchRequest, stream grpc.ServerStreamingServer[allotv1.CheckBatchResponse]) error {
	a := g.s.a
	if err := g.s.checkBatch(stream.Context(), "grpc-batch", req, stream.Send); err != nil {
		if errors.Is(err, ErrInvalidRequest) {
			a.m.badRequests.WithLabelValues("grpc-batch", codeOf(err).String()).Inc()
			return toGRPC(a.log, err)
		}
		return err
	}
	return nil
}
