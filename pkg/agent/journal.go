package agent

import (
	"encoding/json"
	"errors"
	"io"
	"sync"
	"time"

	"connectrpc.com/connect"
	"go.uber.org/zap"

	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// The kinds of LeaseEvent.
const (
	// LeaseEventStart opens the journal of one agent process; it is written
	// by whoever creates the journal (cmd/regionagent), not by the agent.
	LeaseEventStart = "start"
	// LeaseEventAcquire is one attempt of one Acquire request id: its
	// answer, its refusal or its failure to get an answer. Retries of the
	// request id are further events with the same RequestID and FirstSent.
	LeaseEventAcquire = "acquire"
	// LeaseEventDeposit is one grant put into (or, with Outcome failed, not
	// put into) the region's store.
	LeaseEventDeposit = "deposit"
	// LeaseEventRelease is one Release of a grant's tokens back to the
	// allocator: a grant the agent could not use, or the unspent rest it
	// withdrew from the store at shutdown.
	LeaseEventRelease = "release"
	// LeaseEventFallback is one fallback allowance put into (or, with
	// Outcome failed, not put into) the region's store while cut off from
	// the allocator: GrantID fb-<region>-<window>, Window the window it
	// belongs to by the leader's clock, Tokens what the deposit added (0
	// when the region's allowance for the window was in the store already,
	// another agent's, or tombstoned), Deadline, TTLMs, Sent and At as for
	// a deposit, LeaderNowMs the agent's estimate of the leader's clock at
	// Sent, which placed it.
	LeaseEventFallback = "fallback"
)

// The outcomes of a LeaseEvent.
const (
	// LeaseOK: the call was answered (or the deposit made).
	LeaseOK = "ok"
	// LeaseFailed: the call was refused and had no effect (or the deposit
	// was not made).
	LeaseFailed = "failed"
	// LeaseUnknown: no answer; the allocator may or may not have applied the
	// call. The agent retries an Acquire with the same request id. (A
	// deposit: an attempt may have reached the store, and it could not be
	// withdrawn: the withdrawal failed, the pool left the policy, or there
	// is no Redis client to withdraw with.)
	LeaseUnknown = "unknown"
)

// LeaseEvent is one entry of the lease journal: what the lease manager asked
// the allocator for, what it was granted, what it deposited into the store
// and with what deadline, and what it handed back. Times are the agent's
// clock (WithClock) in Unix nanoseconds; the allocator's are its own, in Unix
// milliseconds. Fields that do not apply to a Kind are zero.
type LeaseEvent struct {
	// Kind is one of the LeaseEvent* kinds.
	Kind string `json:"kind"`
	// At is when the event completed: the answer (or failure) of a call;
	// for a deposit, see TTLMs.
	At int64 `json:"at"`
	// Sent is when this attempt, deposit or Release started.
	Sent int64 `json:"sent,omitempty"`
	// Region is the agent's region.
	Region string `json:"region,omitempty"`
	// RequestID names an Acquire (shared by its retries) or a Release.
	RequestID string `json:"request_id,omitempty"`
	// FirstSent is when the Acquire was first sent: its leases' deadlines
	// are measured from it.
	FirstSent int64 `json:"first_sent,omitempty"`
	// Outcome is LeaseOK, LeaseFailed or LeaseUnknown.
	Outcome string `json:"outcome,omitempty"`
	// Code and Err describe a refused, unanswered or failed call.
	Code string `json:"code,omitempty"`
	Err  string `json:"err,omitempty"`
	// Wants are an Acquire's requests.
	Wants []JournalWant `json:"wants,omitempty"`
	// Grants are an answered Acquire's grants, in the order of Wants.
	Grants []JournalGrant `json:"grants,omitempty"`
	// LeaderNowMs is the leader's stamp on an answered Acquire.
	LeaderNowMs int64 `json:"leader_now_ms,omitempty"`
	// Replayed is the allocator's replayed flag of an answered Acquire.
	Replayed bool `json:"replayed,omitempty"`
	// Quota, GrantID and Tokens name a deposit's or a Release's grant and
	// its tokens.
	Quota   string `json:"quota,omitempty"`
	GrantID string `json:"grant_id,omitempty"`
	Tokens  int64  `json:"tokens,omitempty"`
	// ExpiresMs is a deposited grant's expiry by the allocator (Unix ms).
	ExpiresMs int64 `json:"expires_ms,omitempty"`
	// Deadline is a deposited grant's deadline by the send-time rule
	// (lease.Deadline from FirstSent, minus the margin), on the agent's clock.
	Deadline int64 `json:"deadline,omitempty"`
	// TTLMs and At bound a deposit's chunk in the store by the store's
	// clock. Outcome ok: the relative TTL the deposit gave the store, whose
	// answer came back at At (within the deposit's bound), so the chunk
	// expires at most TTLMs after At. Outcome failed: TTLMs is 0 and nothing
	// of the grant is spendable in the store after At (no attempt reached
	// the store, or the agent withdrew the grant, returning at At). Outcome
	// unknown: the TTL of an attempt that may still land and count it from
	// its arrival, so At + TTLMs bounds nothing.
	TTLMs int64 `json:"ttl_ms,omitempty"`
	// Window is a fallback allowance's window index (LeaseEventFallback).
	Window int64 `json:"window,omitempty"`
	// Returned is what a Release returned to the pool.
	Returned int64 `json:"returned,omitempty"`
	// ClockOffsetNs, in a start event, is how far the agent's clock was set
	// from the machine's clock (a fault injected on purpose; 0 normally):
	// the agent's times minus it are machine times.
	ClockOffsetNs int64 `json:"clock_offset_ns,omitempty"`
	// Pid, in a start event, is the agent's process id.
	Pid int `json:"pid,omitempty"`
}

// JournalWant is one want of an Acquire, as sent.
type JournalWant struct {
	// Quota, Tokens and DemandPerSecond as in allot.v1.Want.
	Quota           string  `json:"quota"`
	Tokens          int64   `json:"tokens"`
	DemandPerSecond float64 `json:"demand,omitempty"`
	// Next is allot.v1.Want.next_window: a pre-grant was asked for.
	Next bool `json:"next,omitempty"`
}

// JournalGrant is one grant of an answered Acquire, as received.
type JournalGrant struct {
	// Quota, GrantID and Tokens as in allot.v1.Grant.
	Quota   string `json:"quota"`
	GrantID string `json:"grant_id,omitempty"`
	Tokens  int64  `json:"tokens"`
	// ExpiresMs and WindowEndMs are the allocator's expiry and window end
	// (Unix ms, leader clock); Window is the window index.
	ExpiresMs   int64 `json:"expires_ms,omitempty"`
	WindowEndMs int64 `json:"window_end_ms,omitempty"`
	Window      int64 `json:"window,omitempty"`
	// TTLMs is the lease's TTL from the leader's stamp.
	TTLMs int64 `json:"ttl_ms,omitempty"`
	// Exhausted is the allocator's pool_exhausted flag.
	Exhausted bool `json:"exhausted,omitempty"`
	// NotBeforeMs is a pre-grant's window start (Unix ms, leader clock);
	// 0 for a grant of the current window.
	NotBeforeMs int64 `json:"not_before_ms,omitempty"`
}

// LeaseObserver receives every lease event of an agent (WithLeaseObserver).
// It is called from the lease manager's goroutines, concurrently, and must
// not block for long: renewals wait for it.
type LeaseObserver func(LeaseEvent)

// LeaseJournal writes lease events as JSON lines, one Write per event, so a
// reader tailing the file never sees half an event from a live writer. It is
// safe for concurrent use; Record is a LeaseObserver.
type LeaseJournal struct {
	mu  sync.Mutex
	w   io.Writer
	err error
	log *zap.Logger // nil: errors are not logged (SetLogger)
}

// NewLeaseJournal returns a journal writing to w (typically a file opened
// with O_APPEND, which the caller closes after the agent's Run returned).
func NewLeaseJournal(w io.Writer) *LeaseJournal { return &LeaseJournal{w: w} }

// SetLogger makes the journal log the error that stops it (Record) as a
// warning, once, when it happens.
func (j *LeaseJournal) SetLogger(log *zap.Logger) {
	j.mu.Lock()
	j.log = log
	j.mu.Unlock()
}

// errJournalClosed is kept after Close.
var errJournalClosed = errors.New("lease journal closed")

// Record writes ev. After the first write error it writes nothing more and
// Err returns that error (logged then, with SetLogger): the journal is an
// observer, never a reason for the agent to stop deciding.
func (j *LeaseJournal) Record(ev LeaseEvent) {
	b, err := json.Marshal(ev)
	j.mu.Lock()
	defer j.mu.Unlock()
	if j.err != nil {
		return
	}
	if err == nil {
		b = append(b, '\n')
		_, err = j.w.Write(b)
	}
	if err != nil {
		j.err = err
		if j.log != nil {
			j.log.Warn("lease journal stopped: an event could not be written, and no later one is journaled",
				zap.String("kind", ev.Kind), zap.Error(err))
		}
	}
}

// Err returns the first error Record met, if any.
func (j *LeaseJournal) Err() error {
	j.mu.Lock()
	defer j.mu.Unlock()
	if errors.Is(j.err, errJournalClosed) {
		return nil
	}
	return j.err
}

// Close makes later Records do nothing (the writer is the caller's to
// close) and returns Err.
func (j *LeaseJournal) Close() error {
	err := j.Err()
	j.mu.Lock()
	if j.err == nil {
		j.err = errJournalClosed
	}
	j.mu.Unlock()
	return err
}

// WithLeaseObserver makes the agent report every lease event to f (for
// example a LeaseJournal's Record): each Acquire attempt with its answer,
// each deposit with the deadline and TTL it gave the store, each Release,
// each fallback allowance deposited while cut off.
func WithLeaseObserver(f LeaseObserver) Option { return func(o *options) { o.observer = f } }

// refused reports whether an Acquire error means the allocator refused the
// call, so nothing was granted (anything else may have been applied).
func refused(err error) bool {
	switch connect.CodeOf(err) {
	case connect.CodeNotFound, connect.CodeInvalidArgument, connect.CodeFailedPrecondition, connect.CodePermissionDenied,
		connect.CodeResourceExhausted:
		return true
	}
	return false
}

// depositTrace keeps what a grant's deposit attempts tell of its chunk in
// the store: the first send, the last attempt's end, and the attempt that
// may have reached the store, if any (every attempt but the last was
// Unsent: no attempt follows one that may have reached the store).
type depositTrace struct {
	sent, end time.Time
	// reached: an attempt may have reached the store; landedSent and ttl
	// are its send and the TTL it gave.
	reached    bool
	landedSent time.Time
	ttl        time.Duration
}

// attempt records an attempt sent at sent, ended at end, with ttl; reached
// is false when it certainly never reached the store.
func (d *depositTrace) attempt(sent, end time.Time, ttl time.Duration, reached bool) {
	if d.sent.IsZero() {
		d.sent = sent
	}
	d.end = end
	if reached {
		d.reached, d.landedSent, d.ttl = true, sent, ttl
	}
}

// journalAcquire reports one Acquire attempt.
func (l *leases) journalAcquire(c *acquireCall, sent, at time.Time, resp *allotv1.AcquireResponse, err error) {
	if l.journal == nil {
		return
	}
	ev := LeaseEvent{Kind: LeaseEventAcquire, At: at.UnixNano(), Sent: sent.UnixNano(), Region: l.region, RequestID: c.req.RequestId,
		FirstSent: c.sentAt.UnixNano(), Outcome: LeaseOK, Wants: make([]JournalWant, 0, len(c.req.Wants))}
	for _, w := range c.req.Wants {
		ev.Wants = append(ev.Wants, JournalWant{Quota: w.Quota, Tokens: w.Tokens, DemandPerSecond: w.DemandPerSecond, Next: w.NextWindow})
	}
	if err == nil {
		// An answer the agent refuses to use may still have granted.
		err = validateAcquire(c.req, resp)
	}
	switch {
	case err == nil:
		ev.LeaderNowMs, ev.Replayed = resp.LeaderNowUnixMs, resp.Replayed
		ev.Grants = make([]JournalGrant, 0, len(resp.Grants))
		for _, g := range resp.Grants {
			ev.Grants = append(ev.Grants, JournalGrant{Quota: g.Quota, GrantID: g.GrantId, Tokens: g.Tokens, ExpiresMs: g.ExpiresUnixMs,
				WindowEndMs: g.WindowEndUnixMs, Window: g.WindowIndex, TTLMs: g.TtlMs, Exhausted: g.PoolExhausted, NotBeforeMs: g.NotBeforeUnixMs})
		}
	case refused(err):
		ev.Outcome, ev.Code, ev.Err = LeaseFailed, connect.CodeOf(err).String(), err.Error()
	default:
		ev.Outcome, ev.Code, ev.Err = LeaseUnknown, connect.CodeOf(err).String(), err.Error()
	}
	l.journal(ev)
}

// journalDeposit reports a grant's deposit: made (err nil), or failed, out
// telling whether nothing of it is spendable in the store after at (see
// LeaseEvent.TTLMs).
func (l *leases) journalDeposit(g *allotv1.Grant, deadline time.Time, d depositTrace, err error, out bool, at time.Time) {
	if l.journal == nil {
		return
	}
	ev := LeaseEvent{Kind: LeaseEventDeposit, At: d.end.UnixNano(), Sent: d.sent.UnixNano(), Region: l.region, Outcome: LeaseOK,
		Quota: g.Quota, GrantID: g.GrantId, Tokens: g.Tokens, ExpiresMs: g.ExpiresUnixMs, Deadline: deadline.UnixNano(), TTLMs: d.ttl.Milliseconds()}
	if d.sent.IsZero() { // no attempt: the lease ended too soon
		ev.At, ev.Sent = at.UnixNano(), 0
	}
	switch {
	case err == nil:
	case out:
		ev.Outcome, ev.Err, ev.At, ev.TTLMs = LeaseFailed, err.Error(), at.UnixNano(), 0
	default:
		ev.Outcome, ev.Err = LeaseUnknown, err.Error()
	}
	l.journal(ev)
}

// journalFallback reports a fallback allowance's deposit of tokens (what
// it added) into quota's pool as chunk id for window idx, placed at the
// leader's-clock estimate leaderMs: made (err nil), or failed, out telling
// whether nothing of it is spendable in the store after at (see
// unsureDeposit).
func (l *leases) journalFallback(quota, id string, idx, tokens, leaderMs int64, deadline time.Time, d depositTrace, err error, out bool, at time.Time) {
	if l.journal == nil {
		return
	}
	ev := LeaseEvent{Kind: LeaseEventFallback, At: d.end.UnixNano(), Sent: d.sent.UnixNano(), Region: l.region, Outcome: LeaseOK,
		Quota: quota, GrantID: id, Window: idx, Tokens: tokens, LeaderNowMs: leaderMs, Deadline: deadline.UnixNano(), TTLMs: d.ttl.Milliseconds()}
	switch {
	case err == nil:
	case out:
		ev.Outcome, ev.Err, ev.At, ev.TTLMs = LeaseFailed, err.Error(), at.UnixNano(), 0
	default:
		ev.Outcome, ev.Err = LeaseUnknown, err.Error()
	}
	l.journal(ev)
}

// journalRelease reports one Release.
func (l *leases) journalRelease(quota, grantID string, tokens int64, sent time.Time, resp *allotv1.ReleaseResponse, err error) {
	if l.journal == nil {
		return
	}
	ev := LeaseEvent{Kind: LeaseEventRelease, At: l.clock.Now().UnixNano(), Sent: sent.UnixNano(), Region: l.region, RequestID: "release-" + grantID,
		Outcome: LeaseOK, Quota: quota, GrantID: grantID, Tokens: tokens}
	switch {
	case err == nil:
		ev.Returned = resp.GetReturned()
	case connect.CodeOf(err) == connect.CodeNotFound || connect.CodeOf(err) == connect.CodeInvalidArgument ||
		connect.CodeOf(err) == connect.CodeFailedPrecondition:
		ev.Outcome, ev.Code, ev.Err = LeaseFailed, connect.CodeOf(err).String(), err.Error()
	default:
		ev.Outcome, ev.Code, ev.Err = LeaseUnknown, connect.CodeOf(err).String(), err.Error()
	}
	l.journal(ev)
}
