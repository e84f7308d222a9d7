package chaos

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sort"
	"sync"
	"time"

	"github.com/allot-dev/allot/chaos/history"
	"github.com/allot-dev/allot/pkg/agent"
)

// journalConv turns a region agent's lease journal (agent.LeaseEvent JSON
// lines, regionagent -lease-journal) into history events:
//
//   - an Acquire request id becomes one history.KindAcquire per want once it
//     is resolved: answered (OK, with its grant), refused (Failed), or, when
//     the agent process that sent it ended without an answer, Unknown (At is
//     its last attempt). Call is the first send, the instant its leases'
//     deadlines count from;
//   - a granted chunk's event waits for its deposit, whose upper bound of
//     the store's expiry becomes the event's Deadline (true clock): the
//     deposit returned at At and gave Redis a relative TTL, so Redis (whose
//     clock is the machine's, the true clock) expires the chunk at most
//     At + TTL. A failed deposit that sent an attempt bounds it by its At
//     (nothing of the grant is spendable in the store after it); one that
//     sent none, and a grant handed back or left with no deposit journaled,
//     keep Deadline 0 (never deposited); an unknown one also keeps 0 (a late
//     copy may outlive the lease: the deposit event says so);
//   - a deposit also becomes a history.KindDeposit (see deposit);
//   - a Release becomes a history.KindRelease;
//   - a fallback allowance deposited while cut off (agent.LeaseEventFallback)
//     becomes a history.KindFallback (see fallback), with the store-expiry
//     bound of a deposit and the agent process's last Acquire attempt
//     before it was sent (history.Event.LastAcquire): whether the agent had
//     reason to count itself cut off.
//
// Agent times are the agent's clock, which a skew scenario sets off the
// machine's: each agent process opens its journal with a start event that
// names its offset, and times are shifted back by it.
type journalConv struct {
	region string
	emit   func(...history.Event)
	// probe, if set, is offered every answered request id.
	probe func(id string, wants []agent.JournalWant)

	offset  int64 // the current agent process's clock offset (ns)
	reqs    map[string]*journalReq
	pending map[string]history.Event // grant id -> acquire event awaiting its deposit
	grants  map[string]grantInfo     // grant id -> quota and window, for Releases
	bad     int                      // malformed lines
	lastBad string
	// attempts are the current agent process's Acquire attempts that were
	// answered or went unanswered (refusals left out), in journal order:
	// what a fallback event's LastAcquire is found in.
	attempts []history.Attempt
}

type journalReq struct {
	wants    []agent.JournalWant
	call     int64 // true ns
	lastAt   int64 // true ns of the last failed attempt
	lastErr  string
	resolved bool
}

type grantInfo struct {
	quota  string
	window int64
}

func newJournalConv(region string, emit func(...history.Event)) *journalConv {
	return &journalConv{region: region, emit: emit, reqs: map[string]*journalReq{}, pending: map[string]history.Event{}, grants: map[string]grantInfo{}}
}

// trueNs converts an agent-clock reading to the true clock.
func (j *journalConv) trueNs(agentNs int64) int64 {
	if agentNs == 0 {
		return 0
	}
	return agentNs - j.offset
}

// line handles one journal line.
func (j *journalConv) line(b []byte) {
	b = bytes.TrimSpace(b)
	if len(b) == 0 {
		return
	}
	var ev agent.LeaseEvent
	if err := json.Unmarshal(b, &ev); err != nil {
		j.bad++
		j.lastBad = fmt.Sprintf("%v: %.200s", err, b)
		return
	}
	j.handle(ev)
}

func (j *journalConv) handle(ev agent.LeaseEvent) {
	switch ev.Kind {
	case agent.LeaseEventStart:
		// The previous agent process (if any) has ended: what it never
		// had answered stays unknown.
		j.finish()
		j.offset = ev.ClockOffsetNs
		j.attempts = j.attempts[:0]
	case agent.LeaseEventAcquire:
		j.attempt(ev)
		j.acquire(ev)
	case agent.LeaseEventDeposit:
		j.deposit(ev)
	case agent.LeaseEventFallback:
		j.fallback(ev)
	case agent.LeaseEventRelease:
		if e, ok := j.pending[ev.GrantID]; ok { // handed back, never deposited
			delete(j.pending, ev.GrantID)
			j.emit(e)
		}
		g := j.grants[ev.GrantID]
		quota := ev.Quota
		if quota == "" {
			quota = g.quota
		}
		out := history.Event{Kind: history.KindRelease, Region: j.region, Quota: quota, Call: j.trueNs(ev.Sent), At: j.trueNs(ev.At),
			GrantID: ev.GrantID, Tokens: ev.Tokens, Window: g.window, Outcome: history.OK, Returned: ev.Returned}
		switch ev.Outcome {
		case agent.LeaseFailed:
			out.Outcome, out.Err = history.Failed, ev.Err
			if ev.Code == "not_found" {
				out.Reason = "not_found"
			}
		case agent.LeaseUnknown:
			out.Outcome, out.Err = history.Unknown, ev.Err
		}
		j.emit(out)
	}
}

// deposit emits a grant's deposit and the grant's acquire event, whose
// Deadline is what the deposit tells of the grant in the store (see
// agent.LeaseEvent.TTLMs): made (ok), the chunk expires at most TTL after
// the deposit returned; failed after an attempt was sent, nothing of the
// grant is spendable in the store after At; failed with no attempt sent,
// the grant was never deposited (Deadline 0); unknown, a copy may still
// land and outlive the lease by as long as it was late (Deadline 0, and
// the deposit event says unknown: check.CheckDepositUnknown).
func (j *journalConv) deposit(ev agent.LeaseEvent) {
	dep := history.Event{Kind: history.KindDeposit, Region: j.region, Quota: ev.Quota, GrantID: ev.GrantID, Tokens: ev.Tokens,
		Call: j.trueNs(ev.Sent), At: j.trueNs(ev.At), ExpiresMs: ev.ExpiresMs, Outcome: history.OK, Err: ev.Err}
	switch ev.Outcome {
	case agent.LeaseOK:
		dep.Deadline = j.trueNs(ev.At) + ev.TTLMs*int64(time.Millisecond)
	case agent.LeaseFailed:
		dep.Outcome = history.Failed
		if ev.Sent != 0 {
			dep.Deadline = j.trueNs(ev.At)
		}
	default:
		dep.Outcome = history.Unknown
	}
	if g, ok := j.grants[ev.GrantID]; ok {
		dep.Window = g.window
		if dep.Quota == "" {
			dep.Quota = g.quota
		}
	}
	j.emit(dep)
	e, ok := j.pending[ev.GrantID]
	if !ok {
		return
	}
	delete(j.pending, ev.GrantID)
	e.Deadline = dep.Deadline
	j.emit(e)
}

// attempt records an Acquire attempt that was answered (OK) or not
// (unknown: no answer, or one the agent refused to use); a refusal
// (failed) is left out: the agent's cut-off state does not change on one.
func (j *journalConv) attempt(ev agent.LeaseEvent) {
	var out history.Outcome
	switch ev.Outcome {
	case agent.LeaseOK:
		out = history.OK
	case agent.LeaseUnknown:
		out = history.Unknown
	default:
		return
	}
	j.attempts = append(j.attempts, history.Attempt{RequestID: ev.RequestID, At: j.trueNs(ev.At), Outcome: out})
}

// lastAttempt is the latest attempt of the current agent process that
// ended at or before at (true ns), nil when there is none.
func (j *journalConv) lastAttempt(at int64) *history.Attempt {
	// Attempts are journaled as they end, concurrent ones in any order:
	// look at them all (a process makes a few per second; fallbacks are
	// rare).
	var last *history.Attempt
	for i := range j.attempts {
		if a := j.attempts[i]; a.At <= at && (last == nil || a.At >= last.At) {
			last = &a
		}
	}
	return last
}

// fallback emits a fallback allowance's deposit: its times shifted to the
// true clock, Deadline bounding its chunk's expiry in the store as for a
// grant's deposit (made: At + TTL; failed: At; unknown: 0, a copy may
// land late), and the agent process's last Acquire attempt that ended
// before it was sent (the agent deposits an allowance only while cut off:
// its last answered-or-not attempt went unanswered).
func (j *journalConv) fallback(ev agent.LeaseEvent) {
	e := history.Event{Kind: history.KindFallback, Region: j.region, Quota: ev.Quota, GrantID: ev.GrantID, Tokens: ev.Tokens, Window: ev.Window,
		Call: j.trueNs(ev.Sent), At: j.trueNs(ev.At), LeaderNowMs: ev.LeaderNowMs, Outcome: history.OK, Err: ev.Err}
	switch ev.Outcome {
	case agent.LeaseOK:
		e.Deadline = j.trueNs(ev.At) + ev.TTLMs*int64(time.Millisecond)
	case agent.LeaseFailed:
		e.Outcome, e.Deadline = history.Failed, j.trueNs(ev.At)
	default:
		e.Outcome = history.Unknown
	}
	sent := e.Call
	if sent == 0 {
		sent = e.At
	}
	e.LastAcquire = j.lastAttempt(sent)
	j.emit(e)
}

func (j *journalConv) acquire(ev agent.LeaseEvent) {
	r := j.reqs[ev.RequestID]
	if r == nil {
		r = &journalReq{wants: ev.Wants, call: j.trueNs(ev.FirstSent)}
		if r.call == 0 {
			r.call = j.trueNs(ev.Sent)
		}
		j.reqs[ev.RequestID] = r
	}
	if r.resolved {
		return
	}
	at := j.trueNs(ev.At)
	switch ev.Outcome {
	case agent.LeaseOK:
		r.resolved = true
		byQuota := map[string]agent.JournalGrant{}
		for _, g := range ev.Grants {
			byQuota[g.Quota] = g
		}
		for _, w := range r.wants {
			e := history.Event{Kind: history.KindAcquire, Region: j.region, Quota: w.Quota, At: at, Call: r.call, Outcome: history.OK,
				RequestID: ev.RequestID, Asked: w.Tokens, Next: w.Next, LeaderNowMs: ev.LeaderNowMs, Replayed: ev.Replayed}
			g, ok := byQuota[w.Quota]
			if !ok {
				e.Outcome, e.Err = history.Failed, "no grant for the quota in the response"
				j.emit(e)
				continue
			}
			e.GrantID, e.Tokens, e.Window, e.ExpiresMs, e.Exhausted, e.NotBeforeMs = g.GrantID, g.Tokens, g.Window, g.ExpiresMs, g.Exhausted, g.NotBeforeMs
			if g.Tokens > 0 {
				j.grants[g.GrantID] = grantInfo{quota: w.Quota, window: g.Window}
				j.pending[g.GrantID] = e // emitted with its deposit (or its Release)
				continue
			}
			j.emit(e)
		}
		if j.probe != nil {
			j.probe(ev.RequestID, r.wants)
		}
	case agent.LeaseFailed:
		r.resolved = true
		for _, w := range r.wants {
			j.emit(history.Event{Kind: history.KindAcquire, Region: j.region, Quota: w.Quota, At: at, Call: r.call, Outcome: history.Failed,
				RequestID: ev.RequestID, Asked: w.Tokens, Next: w.Next, Err: ev.Err})
		}
	default:
		r.lastAt, r.lastErr = at, ev.Err
	}
}

// finish resolves what the ended agent process left open: request ids never
// answered are Unknown (their grants, if any, may exist), and granted chunks
// whose deposit was never journaled are emitted without a deadline.
func (j *journalConv) finish() {
	ids := make([]string, 0, len(j.reqs))
	for id, r := range j.reqs {
		if !r.resolved {
			ids = append(ids, id)
		}
	}
	sort.Strings(ids)
	for _, id := range ids {
		r := j.reqs[id]
		r.resolved = true
		at := r.lastAt
		if at == 0 {
			at = r.call
		}
		for _, w := range r.wants {
			j.emit(history.Event{Kind: history.KindAcquire, Region: j.region, Quota: w.Quota, At: at, Call: r.call, Outcome: history.Unknown,
				RequestID: id, Asked: w.Tokens, Next: w.Next, Err: r.lastErr})
		}
	}
	gids := make([]string, 0, len(j.pending))
	for id := range j.pending {
		gids = append(gids, id)
	}
	sort.Strings(gids)
	for _, id := range gids {
		j.emit(j.pending[id])
		delete(j.pending, id)
	}
}

// err reports malformed lines, if any.
func (j *journalConv) err() error {
	if j.bad == 0 {
		return nil
	}
	return fmt.Errorf("lease journal of %s: %d malformed lines, the last: %s", j.region, j.bad, j.lastBad)
}

// journalTail follows a journal file as the agent appends to it and feeds
// complete lines to a journalConv. One goroutine; every read is bounded.
type journalTail struct {
	path string
	conv *journalConv

	mu   sync.Mutex // guards conv against the final drain
	stop chan struct{}
	done chan struct{}
	f    *os.File
	rd   *bufio.Reader
	part []byte
	err  error
}

// journalPoll is how often the tail looks for new lines.
const journalPoll = 50 * time.Millisecond

// maxJournalLine bounds one journal line (an Acquire of thousands of wants
// stays far below).
const maxJournalLine = 4 << 20

func startJournalTail(path string, conv *journalConv) *journalTail {
	t := &journalTail{path: path, conv: conv, stop: make(chan struct{}), done: make(chan struct{})}
	go t.run()
	return t
}

func (t *journalTail) run() {
	defer close(t.done)
	tick := time.NewTicker(journalPoll)
	defer tick.Stop()
	for {
		select {
		case <-t.stop:
			return
		case <-tick.C:
		}
		t.mu.Lock()
		t.read()
		t.mu.Unlock()
	}
}

// read consumes every complete line written so far. The caller holds t.mu.
func (t *journalTail) read() {
	if t.err != nil {
		return
	}
	if t.f == nil {
		f, err := os.Open(t.path)
		if errors.Is(err, os.ErrNotExist) {
			return // the agent has not written yet
		}
		if err != nil {
			t.err = err
			return
		}
		t.f, t.rd = f, bufio.NewReaderSize(f, 64<<10)
	}
	for {
		b, err := t.rd.ReadSlice('\n')
		if len(b) > 0 {
			t.part = append(t.part, b...)
		}
		if errors.Is(err, bufio.ErrBufferFull) {
			if len(t.part) > maxJournalLine {
				t.err = fmt.Errorf("lease journal %s: a line longer than %d bytes", t.path, maxJournalLine)
				return
			}
			continue
		}
		if err == nil {
			t.conv.line(t.part)
			t.part = t.part[:0]
			continue
		}
		if !errors.Is(err, io.EOF) {
			t.err = err
		}
		return // EOF: a partial line waits for its end
	}
}

// close stops following, reads what is left (the agent has exited), and
// resolves what stayed open. It returns the first read error or the
// malformed lines, if any.
func (t *journalTail) close(ctx context.Context) error {
	select {
	case <-t.done:
	default:
		close(t.stop)
	}
	select {
	case <-t.done:
	case <-ctx.Done():
		return fmt.Errorf("lease journal %s: %w", t.path, ctx.Err())
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.read()
	if len(bytes.TrimSpace(t.part)) > 0 {
		t.conv.line(t.part) // a last line without its newline (a killed agent)
		t.part = nil
	}
	t.conv.finish()
	if t.f != nil {
		t.f.Close()
	}
	return errors.Join(t.err, t.conv.err())
}
