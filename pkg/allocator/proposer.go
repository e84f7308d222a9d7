package allocator

import (
	"context"
	"fmt"
	"sync"
	"time"
	"unicode/utf8"

	"github.com/allot-dev/allot/fsm"
)

// proposer group-commits concurrent Acquire and Release calls. One
// dispatcher collects calls into the next batch while the previous batch is
// in Raft, and proposes the batch (up to fsm.MaxBatch commands, fsm.MaxWants
// wants and maxEntryBytes of encoded commands as ONE Raft entry; a call that
// would take the batch past either of the last two waits for the next one)
// as soon as nothing else is in flight. Only a full batch may overtake
// and be proposed beside others, up to maxProposalsInFlight. Under load one
// entry serves many callers, so the allocator's rate is not capped by the
// rate of Raft entries and each entry's fixed cost (log encoding, BoltDB put
// and fsync on every replica) is shared; a lone caller still gets a
// single-command entry at once.
//
// Measured on the 2-core benchmark machine (64 callers, BenchmarkAllocator):
// one batch in flight gave ~24 calls per entry and the most calls per second;
// 16 independent in-flight batches gave ~3 calls per entry and half the rate;
// two partial batches in flight (each held for the commit delay) gave ~21
// calls per entry and fewer calls per second than one batch. A 1 ms commit
// delay under load raised calls per entry to ~29 and calls per second by
// 12-19%.
type proposer struct {
	// apply proposes one entry and waits for its result (Node.applyNow).
	apply func(fsm.Command) (any, error)
	// delay and siblings are Config.CommitDelay and CommitSiblings.
	delay    time.Duration
	siblings int
	queue    chan *proposal
	stop     chan struct{}
	// drained is closed by close once every call the dispatcher took or
	// the queue held has been answered.
	drained chan struct{}
	// wg counts the dispatcher and the batches in flight, until their
	// callers are answered.
	wg sync.WaitGroup
}

// proposal is one caller's command waiting to be group-committed.
type proposal struct {
	ctx  context.Context
	cmd  fsm.Command
	done chan proposalResult // buffered: the dispatcher never blocks on it
	// size bounds the bytes cmd adds to an entry (encodedSize), taken by
	// the caller's goroutine, not the dispatcher's.
	size int
}

// maxEntryBytes bounds the encoded commands of one group-committed entry:
// a call that would take a batch past it waits for the next entry, so only
// an entry of one command is larger (a single Acquire of MaxWantsPerCall
// long quota names, a few MiB). Every entry is written to every replica's
// log and applied with the state machine's lock held: a batch of large
// commands must not make one entry of many megabytes. Calls of ordinary
// size (about 200 bytes) fill fsm.MaxBatch long before this.
const maxEntryBytes = 1 << 20

// weight is what the proposal adds to an entry, in wants: a call that would
// take a batch past fsm.MaxWants wants waits for the next entry, so one
// entry carries at most MaxWants wants, or one Acquire alone.
func (pr *proposal) weight() int {
	if pr.cmd.Acquire != nil {
		return len(pr.cmd.Acquire.Wants)
	}
	return 1
}

// encodedSize bounds the bytes fsm.Encode writes for cmd as an element of
// a batch: its JSON object, at the widest numbers, with every string
// escaped as encoding/json escapes it, and the separating comma.
func encodedSize(cmd fsm.Command) int {
	const (
		// {"type":2,"now_unix_ms":N,"release":{"region":"","grant_id":"",
		// "tokens":N,"request_id":""}}, and its comma, is 131 bytes with
		// every number at its widest; the rest covers the batch's own
		// {"type":5,"now_unix_ms":N,"batch":[]} (56 bytes) in any batch.
		perCommand = 160
		// {"quota":"","tokens":N,"demand_per_second":F,"next":true}, is
		// at most 100 bytes.
		perWant = 112
	)
	n := perCommand
	switch {
	case cmd.Acquire != nil:
		a := cmd.Acquire
		n += jsonStringSize(a.Region) + jsonStringSize(a.RequestID) + perWant*len(a.Wants)
		for _, w := range a.Wants {
			n += jsonStringSize(w.Quota)
		}
	case cmd.Release != nil:
		r := cmd.Release
		n += jsonStringSize(r.Region) + jsonStringSize(r.GrantID) + jsonStringSize(r.RequestID)
	}
	return n
}

// jsonStringSize is the length of s as encoding/json writes it, quotes
// excluded: control characters, '"', '\\', and the HTML-sensitive '<',
// '>' and '&' are escaped, as are U+2028 and U+2029, and each byte of
// invalid UTF-8 becomes "\ufffd".
func jsonStringSize(s string) int {
	n := 0
	for i := 0; i < len(s); {
		b := s[i]
		if b < utf8.RuneSelf {
			switch {
			case b == '"' || b == '\\' || b == '\n' || b == '\r' || b == '\t' || b == '\b' || b == '\f':
				n += 2
			case b < 0x20 || b == '<' || b == '>' || b == '&':
				n += 6 // \u00XX
			default:
				n++
			}
			i++
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 || r == '\u2028' || r == '\u2029' {
			n += 6
		} else {
			n += size
		}
		i += size
	}
	return n
}

type proposalResult struct {
	res any
	err error
}

// maxProposalsInFlight bounds the full batches proposed beside each other
// when calls arrive faster than one batch per Raft round can carry.
const maxProposalsInFlight = 4

func newProposer(n *Node) *proposer {
	return startProposer(n.applyNow, n.cfg.CommitDelay, n.cfg.CommitSiblings)
}

// startProposer starts a dispatcher proposing through apply.
func startProposer(apply func(fsm.Command) (any, error), delay time.Duration, siblings int) *proposer {
	p := &proposer{apply: apply, delay: delay, siblings: max(siblings, 1), queue: make(chan *proposal, 4*fsm.MaxBatch),
		stop: make(chan struct{}), drained: make(chan struct{})}
	p.wg.Add(1)
	go p.run()
	return p
}

// errShuttingDown is what queued callers get when the node closes.
func errShuttingDown() error { return fmt.Errorf("apply: %w: shutting down", ErrNotLeader) }

// close stops the dispatcher, waits for the batches in flight to be
// answered and fails the calls still queued. Calls that come after, or
// that raced it into the queue after the drain, fail at once (propose).
func (p *proposer) close() {
	close(p.stop)
	p.wg.Wait()
	for {
		select {
		case pr := <-p.queue:
			pr.done <- proposalResult{err: errShuttingDown()}
		default:
			close(p.drained)
			return
		}
	}
}

// propose queues cmd and waits for its own result.
func (p *proposer) propose(ctx context.Context, cmd fsm.Command) (any, error) {
	// A select picks among ready cases at random: once stopped, never
	// queue (a call queued after close's drain would wait for nothing).
	select {
	case <-p.stop:
		return nil, errShuttingDown()
	default:
	}
	pr := &proposal{ctx: ctx, cmd: cmd, done: make(chan proposalResult, 1), size: encodedSize(cmd)}
	select {
	case p.queue <- pr:
	case <-ctx.Done():
		return nil, fmt.Errorf("apply: %w", ctx.Err())
	case <-p.stop:
		return nil, errShuttingDown()
	}
	select {
	case r := <-pr.done:
		return r.res, r.err
	case <-ctx.Done():
		// The entry may still commit; the caller retries with the same request id.
		return nil, fmt.Errorf("apply: %w", ctx.Err())
	case <-p.drained:
		// Every call the dispatcher or the drain took has been answered;
		// one that has no answer now was queued after the drain (racing
		// close) and was never proposed.
		select {
		case r := <-pr.done:
			return r.res, r.err
		default:
			return nil, errShuttingDown()
		}
	}
}

// run is the dispatcher: it gathers the next batch and proposes it when
// nothing is in flight, or when it is full and fewer than
// maxProposalsInFlight batches are. With a commit delay (Config.CommitDelay)
// a batch that could go because nothing is in flight waits up to the delay
// for companions, but only under load: when the previous entry carried at
// least Config.CommitSiblings calls (PostgreSQL's commit_delay and
// commit_siblings). A lone caller is never delayed, and the wait ends as
// soon as as many calls are waiting as the previous entry carried plus those
// that waited beside it while it was in Raft: under a steady load those are
// all the callers back again, and waiting longer would only lengthen the
// round (the timer also fires late, Go's timers being coarse on an idle P).
// Waiting for the previous entry's callers alone settles into two groups of
// callers that take turns, each caller riding every other entry.
func (p *proposer) run() {
	defer p.wg.Done()
	var (
		next       = make([]*proposal, 0, fsm.MaxBatch)
		wants      int       // the wants in next
		size       int       // the encoded size of next (bounded)
		over       *proposal // taken from the queue, but too large to join next: it opens the batch after
		inFlight   int
		finished   = make(chan struct{})
		delay      = p.delay
		siblings   = p.siblings
		lastBatch  int // calls in the last batch proposed
		holdFor    int // calls a held batch waits for: the last batch's and those waiting beside it
		linger     *time.Timer
		lingerC    <-chan time.Time // armed while next waits for companions
		lingerDone bool
	)
	defer func() {
		if linger != nil {
			linger.Stop()
		}
	}()
	for {
		full := over != nil || len(next) >= fsm.MaxBatch || wants >= fsm.MaxWants || size >= maxEntryBytes
		idle := inFlight == 0 && (full || delay <= 0 || lastBatch < siblings || lingerDone || len(next) >= holdFor)
		if len(next) > 0 && (idle || full && inFlight < maxProposalsInFlight) {
			batch := next
			next, wants, size = make([]*proposal, 0, fsm.MaxBatch), 0, 0
			if over != nil {
				next, wants, size, over = append(next, over), over.weight(), over.size, nil
			}
			lastBatch, lingerDone = len(batch), false
			if lingerC != nil {
				linger.Stop()
				lingerC = nil
			}
			inFlight++
			p.wg.Add(1)
			go func() {
				defer p.wg.Done()
				results := p.commit(batch)
				// finished is unbuffered: once it is received, the
				// dispatcher has counted the calls that waited beside this
				// batch, and only then are its callers answered (and free
				// to queue their next calls, which must not be counted).
				finished <- struct{}{}
				deliver(batch, results)
			}()
			continue
		}
		if len(next) > 0 && inFlight == 0 && lingerC == nil && !lingerDone {
			if linger == nil {
				linger = time.NewTimer(delay)
			} else {
				linger.Reset(delay)
			}
			lingerC = linger.C
		}
		in := p.queue
		if full {
			in = nil // the batch is full: wait for room in flight
		}
		select {
		case pr := <-in:
			if len(next) > 0 && (wants+pr.weight() > fsm.MaxWants || size+pr.size > maxEntryBytes) {
				over = pr // the batch is full: pr goes in the next one
				continue
			}
			next = append(next, pr)
			wants += pr.weight()
			size += pr.size
		case <-finished:
			inFlight--
			holdFor = min(lastBatch+len(next), fsm.MaxBatch)
		case <-lingerC:
			lingerC, lingerDone = nil, true
		case <-p.stop:
			if over != nil {
				next = append(next, over)
			}
			for _, pr := range next {
				pr.done <- proposalResult{err: errShuttingDown()}
			}
			for ; inFlight > 0; inFlight-- {
				<-finished
			}
			return
		}
	}
}

// commit proposes the live proposals of batch as one entry and returns each
// proposal's result in batch order, for deliver to hand out. Proposals whose
// context has ended are not proposed.
func (p *proposer) commit(batch []*proposal) []proposalResult {
	out := make([]proposalResult, len(batch))
	live := make([]int, 0, len(batch)) // indexes into batch
	for i, pr := range batch {
		if pr.ctx.Err() != nil {
			out[i] = proposalResult{err: fmt.Errorf("apply: %w", pr.ctx.Err())}
			continue
		}
		live = append(live, i)
	}
	switch len(live) {
	case 0:
		return out
	case 1:
		res, err := p.apply(batch[live[0]].cmd)
		out[live[0]] = proposalResult{res: res, err: err}
		return out
	}
	cmd := fsm.Command{Type: fsm.CmdBatch, Batch: make([]fsm.Command, len(live))}
	for j, i := range live {
		cmd.Batch[j] = batch[i].cmd
	}
	res, err := p.apply(cmd)
	if err == nil {
		if br, ok := res.(*fsm.BatchResult); !ok || len(br.Results) != len(live) {
			err = fmt.Errorf("apply: batch of %d answered with %T", len(live), res)
		} else {
			for j, i := range live {
				if e, isErr := br.Results[j].(error); isErr {
					out[i] = proposalResult{err: e}
				} else {
					out[i] = proposalResult{res: br.Results[j]}
				}
			}
			return out
		}
	}
	for _, i := range live {
		out[i] = proposalResult{err: err}
	}
	return out
}

// deliver hands each caller of batch its result.
func deliver(batch []*proposal, results []proposalResult) {
	for i, pr := range batch {
		pr.done <- results[i]
	}
}
