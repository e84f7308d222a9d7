package admission

import (
	"errors"
	"fmt"
	"net"

	"github.com/redis/go-redis/v9"
)

// ErrInvalidRequest is wrapped by every error Decide returns for bad input:
// unknown or malformed descriptors, a bad cost, an oversized request, a
// missing tenant. Nothing was debited. Gateways map it to 400.
var ErrInvalidRequest = errors.New("invalid request")

// The specific bad-input errors. Each wraps ErrInvalidRequest, and the error
// Decide returns wraps one of them with the field at fault, e.g.
// `descriptors[3].key: unknown descriptor "colour"`.
var (
	// ErrUnknownDescriptor is a descriptor key no rule of the policy uses,
	// neither a standard key (tenant, user, route, ip, auth) nor listed in
	// Config.ExtraDescriptors: most likely a typo.
	ErrUnknownDescriptor = wrapInvalid("unknown descriptor")
	// ErrBadDescriptor is a malformed descriptor: an empty or invalid key, a
	// key given twice, or a value that is not printable UTF-8.
	ErrBadDescriptor = wrapInvalid("bad descriptor")
	// ErrTooLarge is an oversized request: too many descriptors, or a key,
	// value or request id longer than the limits in this package.
	ErrTooLarge = wrapInvalid("request too large")
	// ErrBadCost is a negative or huge hit count, or a cost (rule cost x
	// hits) above what the rule can ever admit (its capacity, limit or
	// chunk): such a request could never succeed.
	ErrBadCost = wrapInvalid("bad cost")
	// ErrMissingTenant is a request that names a user without a tenant:
	// per-user counters live inside a tenant, so the tenant is required.
	ErrMissingTenant = wrapInvalid("missing tenant")
)

// ErrInvalidPolicy is returned by New and Apply for a document that fails
// policy validation; it also wraps policy.ErrInvalid.
var ErrInvalidPolicy = errors.New("invalid policy")

// ErrStalePolicy is returned by Apply for a version that is not newer than
// the one in force: versions only move forward, so a replayed old snapshot
// can never replace a newer one.
var ErrStalePolicy = errors.New("stale policy version")

// ErrClosed is returned after Close.
var ErrClosed = errors.New("admission: closed")

// ErrUnknownQuota is returned by the leased-pool methods for a name that is
// not a global_quota rule of the policy in force.
var ErrUnknownQuota = errors.New("unknown quota")

// ErrBadGrant is returned by DepositChunk for an empty grant id, a
// non-positive token count or TTL, or oversized values.
var ErrBadGrant = errors.New("bad grant")

// ErrUnavailable is returned by the methods that talk to the store outside
// the decision path (DepositChunk, PoolStats, Renew, ...) when it cannot
// answer in time or the circuit breaker is open. Decide never returns it:
// there the rule's fail mode decides.
var ErrUnavailable = errors.New("store unavailable")

// ErrOverloaded is reported (wrapped in ErrUnavailable) when more store calls
// are pending than RedisConfig.MaxPending allows.
var ErrOverloaded = errors.New("store overloaded")

// ErrSlotLost is returned by Renew when a concurrency slot has already
// expired or was released: the work it guarded is no longer counted.
var ErrSlotLost = errors.New("concurrency slot lost")

// ErrStoreFull is reported (wrapped in ErrUnavailable) by the embedded store
// when it holds MemoryConfig.MaxKeys live keys and must not grow.
var ErrStoreFull = errors.New("store full")

// errBreakerOpen is wrapped in ErrUnavailable when the circuit breaker
// refused a call without sending it.
var errBreakerOpen = errors.New("circuit breaker open")

// errRefused is what a store call the circuit breaker refused fails with.
// It is made once: a refusal allocates nothing.
var errRefused = fmt.Errorf("%w: %w", ErrUnavailable, errBreakerOpen)

// errSlotMoving is wrapped in the error of a store call whose caller gave
// up while the call waited to be sent again after Redis Cluster refused it
// with TRYAGAIN: the node was serving, and the breaker does not count it.
var errSlotMoving = errors.New("refused while its slot was being moved (TRYAGAIN), waiting to be sent again")

// errDropped is wrapped in the error of a store call whose caller gave up
// (its timeout or its context) while the call still waited in the batcher:
// the batcher drops such a call instead of sending it.
var errDropped = errors.New("dropped before it was sent")

// Unsent reports whether err, returned by a store operation of an Engine
// (DepositChunk, MarkExhausted, ...), proves the operation never reached the
// store and so had no effect: bad arguments, an unknown quota, a closed
// engine, a full queue, an open circuit breaker, a full embedded store, a
// connection that could not be made, or a call that timed out (or whose
// caller gave up) while it still waited to be sent, which the batcher then
// drops. Any other error leaves the outcome unknown: a call that timed out
// after it was sent may still be applied later (a paused Redis runs it when
// it resumes), so a caller must not act as if it had failed (e.g. hand a
// deposit's tokens back) without first making sure it cannot land.
func Unsent(err error) bool {
	if err == nil {
		return false
	}
	for _, e := range []error{ErrBadGrant, ErrUnknownQuota, ErrClosed, ErrOverloaded, errBreakerOpen, errDropped, ErrStoreFull, redis.ErrPoolTimeout} {
		if errors.Is(err, e) {
			return true
		}
	}
	var op *net.OpError
	return errors.As(err, &op) && op.Op == "dial"
}

// DescriptorError is the error Decide returns for a request refused for one
// of its descriptors (its key or value): Index is its position in
// Request.Descriptors, for a caller that built them from several sources
// (the HTTP middleware answers 500 for the ones it added itself). It wraps
// the specific error (ErrBadDescriptor, ErrTooLarge, ErrUnknownDescriptor).
type DescriptorError struct {
	Index int
	Err   error
}

// Error returns the message, which names the descriptor by its index.
func (e *DescriptorError) Error() string { return e.Err.Error() }

// Unwrap returns the specific error.
func (e *DescriptorError) Unwrap() error { return e.Err }

func descriptorError(i int, err error) error { return &DescriptorError{Index: i, Err: err} }

type invalidError struct{ msg string }

func wrapInvalid(msg string) error { return &invalidError{msg: msg} }

// Error returns the error's message.
func (e *invalidError) Error() string { return e.msg }

// Unwrap returns ErrInvalidRequest.
func (e *invalidError) Unwrap() error { return ErrInvalidRequest }
