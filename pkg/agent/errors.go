package agent

import (
	"context"
	"errors"
	"regexp"
	"strconv"
	"strings"

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
// allocator is unreachable. ReleaseSlot wraps it when the store cannot be
// reached.
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
	// The caller's end before the store's trouble: a call whose caller left
	// or whose deadline passed wraps its context's error, and often
	// ErrUnavailable too (the store did not answer in time).
	case errors.Is(err, context.DeadlineExceeded):
		return connect.CodeDeadlineExceeded
	case errors.Is(err, context.Canceled):
		return connect.CodeCanceled
	case errors.Is(err, ErrNotReady), errors.Is(err, ErrUnavailable), errors.Is(err, admission.ErrUnavailable), errors.Is(err, admission.ErrClosed):
		return connect.CodeUnavailable
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

// apiFields presents an engine error about a request under the field names
// of the API the request came through. The engine names a request's
// entries descriptors[i] (and their list descriptors) and its cost hits;
// the Check API calls them entries[i] and cost, the Envoy API
// descriptors[i].entries[j] and hits_addend. path maps the engine's index of
// an entry to the API's path; list and hits are the API's names, and
// requestID the API's name of the request id (the engine's is request_id;
// Envoy's is the entry it came from), "" to keep the engine's. Other errors
// come back as they are.
func apiFields(err error, path func(int) string, list, hits, requestID string) error {
	if err == nil || !errors.Is(err, admission.ErrInvalidRequest) {
		return err
	}
	msg := err.Error()
	switch {
	case strings.HasPrefix(msg, "descriptors:"):
		msg = list + msg[len("descriptors"):]
	case strings.HasPrefix(msg, "hits:"):
		msg = hits + msg[len("hits"):]
	}
	msg = entryRef.ReplaceAllStringFunc(msg, func(ref string) string {
		i, perr := strconv.Atoi(ref[len("descriptors[") : len(ref)-1])
		if perr != nil {
			return ref
		}
		return path(i)
	})
	// After the entries: an API's name of the request id may itself be an
	// entry's path, which the engine's names must not be mistaken for.
	if requestID != "" && strings.HasPrefix(msg, "request_id:") {
		msg = requestID + msg[len("request_id"):]
	}
	if msg == err.Error() {
		return err
	}
	return &fieldError{msg: msg, err: err}
}

// entryRef is the engine's name of a request's entry.
var entryRef = regexp.MustCompile(`descriptors\[[0-9]+\]`)

// fieldError is an error with its message rewritten by apiFields; it still
// wraps the engine's error for errors.Is.
type fieldError struct {
	msg string
	err error
}

func (e *fieldError) Error() string { return e.msg }
func (e *fieldError) Unwrap() error { return e.err }

// publicError is an error whose message is what an API caller is told (the
// store's address and the dialer's message left out, and logged instead);
// it still wraps the errors its code is decided by, for errors.Is.
type publicError struct {
	msg  string
	errs []error
}

func (e *publicError) Error() string   { return e.msg }
func (e *publicError) Unwrap() []error { return e.errs }
