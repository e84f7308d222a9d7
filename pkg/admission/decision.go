package admission

import (
	"github.com/allot-dev/allot/pkg/policy"
)

// Outcome is what a gateway does with a request.
type Outcome uint8

// The outcomes.
const (
	// Allow forwards the request.
	Allow Outcome = iota
	// Deny answers 429 Too Many Requests with Retry-After: the caller is
	// over policy.
	Deny
	// Unavailable answers 503 Service Unavailable with Retry-After: a
	// fail-closed rule could not be decided because the store did not
	// answer. It is the limiter's problem, not the caller's.
	Unavailable
)

// String returns "allow", "deny" or "unavailable".
func (o Outcome) String() string {
	switch o {
	case Allow:
		return "allow"
	case Deny:
		return "deny"
	case Unavailable:
		return "unavailable"
	}
	return "unknown"
}

// Source says what decided.
type Source uint8

// The sources of a decision.
const (
	// SourceNone: no rule matched the request.
	SourceNone Source = iota
	// SourceStore: the store decided every rule.
	SourceStore
	// SourceReplay: a retry of an admitted request id; the earlier decision
	// was returned and nothing was charged again.
	SourceReplay
	// SourceNegativeCache: a recently denied key was denied again in
	// process, without a store call.
	SourceNegativeCache
	// SourceLocal: only gateway-local chunks were involved.
	SourceLocal
	// SourceFailMode: the store could not answer and at least one rule was
	// decided by its fail mode (see RuleResult.FailMode).
	SourceFailMode
)

// String names the source.
func (s Source) String() string {
	switch s {
	case SourceNone:
		return "none"
	case SourceStore:
		return "store"
	case SourceReplay:
		return "replay"
	case SourceNegativeCache:
		return "negative_cache"
	case SourceLocal:
		return "local"
	case SourceFailMode:
		return "fail_mode"
	}
	return "unknown"
}

// RuleResult is one matched rule's part of a decision.
type RuleResult struct {
	// Rule is the rule's name.
	Rule string
	// Scope is the rule's scope.
	Scope policy.Scope
	// Kind is the rule's kind.
	Kind policy.Kind
	// Def is the rule's definition, shared with the policy: read only. An
	// API that splits a request into parts (Envoy's descriptors) uses its
	// match list to say which part a rule is about.
	Def *policy.Rule
	// Pool is, for a global quota, the leased pool the request is charged
	// to: the rule's name for a single pool, the instance's name
	// (policy.InstanceName) for a template; empty for other kinds.
	Pool string
	// Shadow rules never deny; Allowed says whether they would have.
	Shadow bool
	// Allowed says whether this rule admits the request (for a shadow rule,
	// whether it would).
	Allowed bool
	// Remaining is what the rule has left after this decision, in its own
	// units (tokens, requests, slots); -1 when unknown.
	Remaining int64
	// RetryAfter is the rule's wait in whole seconds, rounded up, when it
	// does not admit; -1 when waiting will not help (a bucket that never
	// refills).
	RetryAfter int64
	// Reset is the seconds until the rule is whole again (a full bucket, the
	// window's end), rounded up; 0 when unknown.
	Reset int64
	// Quota and Window are the rule's advertised quota and window in seconds
	// (RateLimit-Policy q and w); 0 when the rule is not advertised.
	Quota, Window int64
	// FailMode is the fail mode that decided the rule when the store could
	// not; empty when the store (or a local chunk) decided.
	FailMode policy.FailMode
}

// Decision is the answer to one Request.
type Decision struct {
	// Outcome is allow, deny (429) or unavailable (503).
	Outcome Outcome
	// Rule and Scope name the rule that denied, or could not be decided
	// (the first in evaluation order); empty when allowed.
	Rule  string
	Scope policy.Scope
	// RetryAfter is, for Deny and Unavailable, the whole seconds to wait,
	// rounded up: a hint from the current state, never a reservation. -1
	// means waiting will not help.
	RetryAfter int64
	// Remaining is the smallest Remaining of the live rules; -1 when no rule
	// reported one.
	Remaining int64
	// ID identifies the decision in logs and in the 429 body; a replay
	// returns the earlier decision's id.
	ID string
	// PolicyVersion is the version of the policy that decided.
	PolicyVersion uint64
	// WouldDeny says a shadow rule would have denied the request.
	WouldDeny bool
	// Source says what decided.
	Source Source
	// Rules are the matched rules in evaluation order.
	Rules []RuleResult

	slots []slotRef
}

// Allowed reports whether the request may proceed.
func (d *Decision) Allowed() bool { return d.Outcome == Allow }

// HasSlots reports whether the decision holds concurrency slots that the
// caller must Release when the work ends.
func (d *Decision) HasSlots() bool { return len(d.slots) > 0 }
