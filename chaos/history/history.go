// Package history is the record the chaos suite checks: every Acquire,
// Release and GetWindow with its invocation and response, every admission
// with the lease it spent and that lease's deadline, every denial, every
// stranded chunk, and the fault timeline, all stamped by one true clock.
//
// The true clock is CLOCK_MONOTONIC, which every process on the machine
// shares, shifted once by the suite to Unix nanoseconds (TrueClock). Wall
// clocks of individual processes may be skewed on purpose; the true clock
// never is, so windows "by the suite's clock" are comparable with the
// allocator's Unix-millisecond expiries as long as the allocator's wall clock
// is the machine's (the suite never skews allocator clocks).
//
// Events travel from region processes (drivers, load generators) to the
// suite as JSON lines (Message, Wire).
package history

import (
	"encoding/json"
	"fmt"
	"math"
	"sort"
	"sync"
)

// Kind names what an Event records.
type Kind string

// The event kinds.
const (
	// KindAcquire is one want of one Acquire request id: Call is the first
	// attempt's invocation, At the response that resolved it (or the moment
	// the region gave up, with Outcome unknown).
	KindAcquire Kind = "acquire"
	// KindProbe is a deliberate re-send of an already answered request id:
	// the allocator must replay the recorded grant and grant nothing new.
	KindProbe Kind = "probe"
	// KindRelease is one Release of the unspent rest of a grant.
	KindRelease Kind = "release"
	// KindDeposit is a region agent's deposit of one grant (GrantID, Tokens)
	// into its store: Call is when it was sent (0 when no attempt was made),
	// At when it returned, Outcome whether the chunk is in the store (OK),
	// certainly not spendable there after At (Failed), or may land late and
	// outlive its lease (Unknown), and Deadline the bound it gives the
	// grant's acquire event (0 when it bounds nothing).
	KindDeposit Kind = "deposit"
	// KindFallback is a region agent's fallback allowance (a quota of
	// fail_mode fallback) put into its store while cut off from the
	// allocators: GrantID fb-<region>-<window>, Window the window it belongs
	// to by the agent's estimate of the leader's clock (LeaderNowMs, at
	// Call), Tokens what the deposit added (0 when the region's allowance
	// of the window was in the store already: no chunk of its own), Call
	// when it was sent and At when it returned. Outcome and Deadline as for
	// a KindDeposit: OK, the chunk expires in the store at most at Deadline
	// (At + the TTL it gave the store); Failed, nothing of it is spendable
	// after At (Deadline = At); Unknown, a copy may land late (Deadline 0).
	// LastAcquire is the agent process's last Acquire attempt before Call.
	KindFallback Kind = "fallback"
	// KindGetWindow is one read of a window's ledger (by the suite's observer).
	KindGetWindow Kind = "getwindow"
	// KindAdmit is Tokens admissions at At, spent from GrantID whose deadline
	// (by the region's rule, on the true clock) is Deadline.
	KindAdmit Kind = "admit"
	// KindDeny is Tokens denials at At, with Reason.
	KindDeny Kind = "deny"
	// KindStrand is Tokens of GrantID whose deadline passed unspent.
	KindStrand Kind = "strand"
)

// Outcome is what a client knows about an operation's effect.
type Outcome string

// The outcomes.
const (
	// OK: the operation took effect and its response is known.
	OK Outcome = "ok"
	// Failed: the operation definitely did not take effect (a validation
	// error, for example).
	Failed Outcome = "failed"
	// Unknown: it may or may not have taken effect (timeouts, cut links).
	Unknown Outcome = "unknown"
)

// Deny reasons.
const (
	// ReasonNoTokens: no unexpired token held, the pool was not known to be exhausted.
	ReasonNoTokens = "no_tokens"
	// ReasonExhausted: the allocator said this window's pool is exhausted.
	ReasonExhausted = "pool_exhausted"
	// ReasonCutOff: the last Acquire failed; the region is cut off.
	ReasonCutOff = "cut_off"
	// ReasonLocalLimit: an Independent region's own per-window limit.
	ReasonLocalLimit = "local_limit"
	// ReasonLimited: the region agent answered 429 (the quota's pool is
	// exhausted for the window, or another rule denied).
	ReasonLimited = "limited_429"
	// ReasonUnavailable: the region agent answered 503 (the limiter could
	// not decide: cut off from the allocator, no renewal within its starve
	// wait, or its store unreachable).
	ReasonUnavailable = "unavailable_503"
	// ReasonNoAnswer: the region agent did not answer the request (nor its
	// retries with the same request id).
	ReasonNoAnswer = "no_answer"
)

// Event is one recorded happening. Fields that do not apply to a Kind are zero.
type Event struct {
	// Kind says what happened.
	Kind Kind `json:"k"`
	// Region and Quota name where it happened.
	Region string `json:"r,omitempty"`
	Quota  string `json:"q,omitempty"`
	// At is when it happened (admissions, denials, strands) or when the
	// operation returned, in true Unix nanoseconds.
	At int64 `json:"t"`
	// Call is when an operation was first invoked, in true Unix nanoseconds.
	Call int64 `json:"c,omitempty"`
	// Outcome of an operation.
	Outcome Outcome `json:"o,omitempty"`
	// Err is the last error of a failed or unknown operation.
	Err string `json:"e,omitempty"`
	// RequestID of an Acquire or Probe.
	RequestID string `json:"id,omitempty"`
	// Asked is the tokens an Acquire asked for this quota.
	Asked int64 `json:"ask,omitempty"`
	// GrantID of a grant, release, admission or strand.
	GrantID string `json:"g,omitempty"`
	// Tokens granted, released, admitted, denied or stranded.
	Tokens int64 `json:"n,omitempty"`
	// Window is the grant's (or ledger's) window index.
	Window int64 `json:"w,omitempty"`
	// ExpiresMs is the allocator's expiry of the grant (Unix ms, leader clock).
	ExpiresMs int64 `json:"x,omitempty"`
	// LeaderNowMs is the leader's stamp on the Acquire.
	LeaderNowMs int64 `json:"ln,omitempty"`
	// Deadline is the region's deadline for the grant, in true Unix ns.
	Deadline int64 `json:"d,omitempty"`
	// Replayed is the allocator's replayed flag on an Acquire; on an
	// admission, that the answer repeated an earlier decision of the same
	// request id (the store's idempotency record): that decision was made
	// at some instant from Call to At, by an attempt whose answer was lost.
	Replayed bool `json:"rp,omitempty"`
	// Degraded marks an admission a rule's fail mode decided (the agent's
	// CheckResponse.degraded): the region's store did not answer in time,
	// whether or not the run broke it, and the agent's engine admitted from
	// its in-process fallback share.
	Degraded bool `json:"dg,omitempty"`
	// Exhausted is the allocator's pool_exhausted flag.
	Exhausted bool `json:"ex,omitempty"`
	// Next marks an Acquire (or probe) that asked for a pre-grant: tokens
	// of the window after the current one.
	Next bool `json:"nx,omitempty"`
	// NotBeforeMs is a pre-grant's window start (Unix ms, leader clock):
	// none of its tokens may be spent before.
	NotBeforeMs int64 `json:"nb,omitempty"`
	// Returned is the tokens a Release returned to the pool.
	Returned int64 `json:"ret,omitempty"`
	// Remaining, Granted and Released are a ledger's totals (GetWindow).
	Remaining int64 `json:"rem,omitempty"`
	Granted   int64 `json:"gr,omitempty"`
	Released  int64 `json:"rel,omitempty"`
	// Grants are a ledger's grant records (GetWindow).
	Grants []LedgerGrant `json:"gs,omitempty"`
	// Reason of a denial.
	Reason string `json:"why,omitempty"`
	// LastAcquire, on a KindFallback event, is the last Acquire attempt the
	// agent process ended before the deposit was sent, answered or not
	// (attempts the allocator refused are left out: a refusal does not
	// change whether the agent counts itself cut off); nil when it had
	// ended none.
	LastAcquire *Attempt `json:"la,omitempty"`
}

// Attempt is one attempt of an Acquire request id, as a region agent's
// lease journal records it.
type Attempt struct {
	// RequestID names the Acquire.
	RequestID string `json:"id"`
	// At is when the attempt ended (true Unix ns).
	At int64 `json:"t"`
	// Outcome: OK (answered) or Unknown (no answer, or an answer the agent
	// could not use).
	Outcome Outcome `json:"o"`
}

// LedgerGrant is one grant as a window ledger lists it.
type LedgerGrant struct {
	// GrantID, Region and Tokens as the allocator recorded them.
	GrantID string `json:"g"`
	Region  string `json:"r"`
	Tokens  int64  `json:"n"`
	// Released tokens of the grant.
	Released int64 `json:"rel,omitempty"`
	// GrantedMs and ExpiresMs are when the grant was made and when it
	// expires (Unix ms, leader clock).
	GrantedMs int64 `json:"gt,omitempty"`
	ExpiresMs int64 `json:"x"`
}

// Never is the return time of an operation whose response never came.
const Never = math.MaxInt64

// Fault is one entry of the fault timeline.
type Fault struct {
	// Scenario names the scenario that injected it.
	Scenario string
	// Action is "inject", "heal" or a note ("leader a2 killed", ...).
	Action string
	// Detail says what exactly was done.
	Detail string
	// At is when, in true Unix ns.
	At int64
}

// Span is the fault window of one scenario: what the checkers excuse and
// what the report attributes to the scenario.
type Span struct {
	// Scenario is the scenario's name.
	Scenario string
	// Start is the first injection; End the last heal (true Unix ns).
	Start, End int64
	// RecoverFrom is the instant from which the system is expected to
	// recover: the heal for partitions, the injection for crashes that a
	// new election repairs.
	RecoverFrom int64
	// Regions are the regions the fault touches; empty means all.
	Regions []string
	// Skipped says the scenario could not run here, and why.
	Skipped string
	// Store says the fault stops or kills the store (Redis) of the regions
	// it touches: what was deposited into it, or on its way, may be lost.
	Store bool
	// CutOff says the fault cuts the regions it touches off from every
	// allocator (partition-region, cut-allocators): their agents may admit
	// a quota's fallback allowance (fail_mode fallback) meanwhile.
	CutOff bool
}

// Affects reports whether the span touches region.
func (s Span) Affects(region string) bool {
	if len(s.Regions) == 0 {
		return true
	}
	for _, r := range s.Regions {
		if r == region {
			return true
		}
	}
	return false
}

// Recorder collects events and the fault timeline; it is safe for
// concurrent use.
type Recorder struct {
	mu sync.Mutex
	// events are kept in blocks of eventBlock: one slice grown by append
	// would copy all of a soak's events (hundreds of MB) at each doubling,
	// holding mu, in a copy the garbage collector cannot interrupt, and
	// that stalled the whole test process for up to a second.
	events [][]Event
	n      int // events recorded
	faults []Fault
	spans  []Span
}

// eventBlock is how many events one block of Recorder.events holds (~1 MB).
const eventBlock = 4096

// Record appends events.
func (r *Recorder) Record(evs ...Event) {
	r.mu.Lock()
	for len(evs) > 0 {
		if len(r.events) == 0 || len(r.events[len(r.events)-1]) == eventBlock {
			r.events = append(r.events, make([]Event, 0, eventBlock))
		}
		last := &r.events[len(r.events)-1]
		k := min(len(evs), eventBlock-len(*last))
		*last = append(*last, evs[:k]...)
		evs = evs[k:]
		r.n += k
	}
	r.mu.Unlock()
}

// Fault appends a fault timeline entry.
func (r *Recorder) Fault(f Fault) {
	r.mu.Lock()
	r.faults = append(r.faults, f)
	r.mu.Unlock()
}

// Span appends a scenario's fault window.
func (r *Recorder) Span(s Span) {
	r.mu.Lock()
	r.spans = append(r.spans, s)
	r.mu.Unlock()
}

// History is a snapshot of everything recorded.
type History struct {
	// Events in recording order.
	Events []Event
	// Faults is the fault timeline, by time.
	Faults []Fault
	// Spans are the scenarios' fault windows, by start.
	Spans []Span
}

// Snapshot returns a copy of what was recorded so far.
func (r *Recorder) Snapshot() History {
	r.mu.Lock()
	defer r.mu.Unlock()
	events := make([]Event, 0, r.n)
	for _, b := range r.events {
		events = append(events, b...)
	}
	h := History{
		Events: events,
		Faults: append([]Fault(nil), r.faults...),
		Spans:  append([]Span(nil), r.spans...),
	}
	sort.SliceStable(h.Faults, func(i, j int) bool { return h.Faults[i].At < h.Faults[j].At })
	sort.SliceStable(h.Spans, func(i, j int) bool { return h.Spans[i].Start < h.Spans[j].Start })
	return h
}

// Message is one JSON line between the suite and a region driver: exactly
// one field is set.
type Message struct {
	// Hello is the first line a driver sends: its region name.
	Hello string `json:"hello,omitempty"`
	// Event is a recorded event (driver to suite).
	Event *Event `json:"ev,omitempty"`
	// Command is an instruction (suite to driver).
	Command *Command `json:"cmd,omitempty"`
	// Ack answers a Command by its Seq (driver to suite); Err is set when
	// the command failed.
	Ack *Ack `json:"ack,omitempty"`
}

// Command is an instruction to a region driver.
type Command struct {
	// Seq identifies the command for its Ack.
	Seq int64 `json:"seq"`
	// Op is one of the Op* constants.
	Op string `json:"op"`
	// Quota and Rate for OpDemand.
	Quota string  `json:"q,omitempty"`
	Rate  float64 `json:"rate,omitempty"`
	// Skew for OpSkew: the region's wall clock is true time + Skew.
	Skew int64 `json:"skew,omitempty"`
	// N for OpStorm: concurrent extra Acquires per quota.
	N int `json:"n,omitempty"`
}

// Ack answers a Command.
type Ack struct {
	// Seq of the command answered.
	Seq int64 `json:"seq"`
	// Err is empty on success.
	Err string `json:"err,omitempty"`
}

// Commands a driver understands.
const (
	// OpDemand sets a quota's offered requests per second.
	OpDemand = "demand"
	// OpSkew sets the skew of the driver's wall clock.
	OpSkew = "skew"
	// OpStorm fires N concurrent extra Acquires per quota at once.
	OpStorm = "storm"
	// OpStop stops offering load, releases what it holds, resolves pending
	// Acquires, flushes its events and exits.
	OpStop = "stop"
)

// String renders an event compactly for failure messages.
func (e Event) String() string {
	b, err := json.Marshal(e)
	if err != nil {
		return fmt.Sprintf("%+v", err)
	}
	return string(b)
}
