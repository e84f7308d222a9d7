package check

import (
	"fmt"
	"hash/fnv"
	"sort"
	"strings"
	"time"

	"github.com/anishathalye/porcupine"

	"github.com/allot-dev/allot/chaos/history"
	"github.com/allot-dev/allot/pkg/lease"
)

// ReadCurrent marks (in Event.Reason) a GetWindow of the current window;
// ReadPast one of a named earlier window.
const (
	ReadCurrent = "current"
	ReadPast    = "past"
)

// LinResult is the linearizability verdict for one quota.
type LinResult struct {
	// Windows is how many windows were checked, Ops how many operations.
	Windows, Ops int
	// Illegal lists windows whose history is not linearizable.
	Illegal []int64
	// Unknown lists windows porcupine could not decide in time.
	Unknown []int64
	// Longest is the longest time porcupine took on one window.
	Longest time.Duration
}

// opKind is what a pool operation does.
type opKind int

const (
	opAcquire opKind = iota // grants min(asked, remaining) under a new request id
	opReplay                // a re-sent request id: must replay the recorded grant
	opRelease               // returns tokens of one grant to the pool (or 0 after the window)
	opRead                  // GetWindow: remaining, granted, released
)

type poolInput struct {
	kind   opKind
	id     string
	asked  int64
	tokens int64 // release: tokens handed back
	// grant is the grant an answered Acquire made (its tokens are tracked
	// in the state) or the grant a Release hands tokens back to.
	grant string
	// pre marks a pre-grant (an Acquire of the next window): the allocator
	// also caps it at the quota's chunk minus what the region already
	// holds of the window, which this model does not track, so an answered
	// one may grant anything up to min(asked, remaining). An unanswered one
	// is taken to have granted nothing, min(asked, remaining) (the agent
	// asks at most a chunk and once per window, so it held nothing of it),
	// or nothing under a recorded id (an ask applied too early).
	pre bool
}

type poolOutput struct {
	unknown                     bool // no response: the effect may or may not have happened
	tokens                      int64
	returned                    int64
	remaining, granted, release int64
}

// poolState is one window's pool: what remains, what was granted and
// released, the request ids it has granted (with their tokens) and the
// answered grants with their tokens not yet released, each in a canonical
// "key=tokens;" form sorted by key, so states compare with ==.
type poolState struct {
	remaining, granted, released int64
	ids                          string
	unreleased                   string // grant id = tokens not yet released
}

// lookupIn finds key in a canonical "key=tokens;" list.
func lookupIn(list, key string) (int64, bool) {
	for _, kv := range strings.Split(list, ";") {
		if k, v, ok := strings.Cut(kv, "="); ok && k == key {
			var n int64
			fmt.Sscan(v, &n)
			return n, true
		}
	}
	return 0, false
}

// setIn sets key to tokens in a canonical "key=tokens;" list.
func setIn(list, key string, tokens int64) string {
	parts := []string{}
	for _, kv := range strings.Split(strings.TrimSuffix(list, ";"), ";") {
		if k, _, ok := strings.Cut(kv, "="); ok && k != key {
			parts = append(parts, kv)
		}
	}
	parts = append(parts, fmt.Sprintf("%s=%d", key, tokens))
	sort.Strings(parts)
	return strings.Join(parts, ";") + ";"
}

func (s poolState) lookup(id string) (int64, bool) { return lookupIn(s.ids, id) }

func (s poolState) with(id string, tokens int64) poolState {
	s.ids = setIn(s.ids, id, tokens)
	return s
}

// poolModel is the allocator's pool of one quota in one window under the
// demand strategy: an Acquire with a new request id gets min(asked,
// remaining); a known id replays; a Release in the window returns its tokens,
// at most what its grant has not released yet (when the window's history
// holds the grant), and never lifts remaining above G; a read sees the
// totals. Unanswered operations may or may not have applied.
//
// With a per-region cap (maxHeld > 0, the policy's
// lease.max_held_per_region) the allocator grants min(asked, remaining,
// cap - what the region holds), and what a region holds counts unexpired
// grants of the previous, current and next windows, which a model of one
// window without time cannot know: an Acquire may then be granted anything
// up to min(asked, remaining, cap), and an unanswered one may have taken
// any such amount (one branch per amount: correct, but a capped quota's
// windows with many unanswered Acquires may exhaust porcupine's time).
//
// Out of the model's scope: a pool reset, when a published policy changes a
// window and the allocator opens the pool less the old pool's grants whose
// leases reach the new window (fsm WindowView.Carried), so that remaining starts below G. The
// suite publishes its policy once, before any grant; a run that republished
// would need the carried tokens in the model's initial state.
func poolModel(limit, maxHeld int64) porcupine.Model {
	// most is the most a new Acquire could be granted.
	most := func(s poolState, in poolInput) int64 {
		n := min(in.asked, s.remaining)
		if maxHeld > 0 {
			n = min(n, maxHeld)
		}
		return n
	}
	grant := func(s poolState, in poolInput) poolState {
		n := min(in.asked, s.remaining)
		s.remaining -= n
		s.granted += n
		if in.grant != "" && n > 0 {
			s.unreleased = setIn(s.unreleased, in.grant, n)
		}
		return s.with(in.id, n)
	}
	nm := porcupine.NondeterministicModel{
		Init: func() []any { return []any{poolState{remaining: limit}} },
		Step: func(st, inp, outp any) []any {
			s, in, out := st.(poolState), inp.(poolInput), outp.(poolOutput)
			switch in.kind {
			case opAcquire:
				if _, seen := s.lookup(in.id); seen {
					if out.unknown {
						return []any{s} // an unanswered re-send of a granted id: replayed
					}
					return nil // a second grant for one request id
				}
				if out.unknown && maxHeld > 0 {
					// Cut short by the region's cap, it may have taken
					// any amount up to the most (none: recorded empty).
					next := []any{s}
					for n := range most(s, in) + 1 {
						in.asked = n
						next = append(next, grant(s, in))
					}
					return next
				}
				if out.unknown {
					if in.pre {
						// Applied in the first half of the window before
						// its target (sent before a turn, delivered after
						// it), a pre-grant is recorded with no tokens.
						return []any{s, grant(s, in), s.with(in.id, 0)}
					}
					return []any{s, grant(s, in)}
				}
				if in.pre || maxHeld > 0 {
					// A pre-grant is also capped at a chunk less what the
					// region holds of its window, and a capped quota's
					// grant at the cap less what the region holds.
					if out.tokens < 0 || out.tokens > most(s, in) {
						return nil
					}
					in.asked = out.tokens
					return []any{grant(s, in)}
				}
				if out.tokens != min(in.asked, s.remaining) {
					return nil
				}
				return []any{grant(s, in)}
			case opReplay:
				if n, seen := s.lookup(in.id); !seen || n != out.tokens {
					return nil
				}
				return []any{s}
			case opRelease:
				back := s
				back.remaining += in.tokens
				back.released += in.tokens
				// A grant hands back at most what it has not released yet
				// (a grant released twice pushes the pool past G), and the
				// pool never holds more than G. A grant the window's
				// history does not hold (its Acquire unanswered, or not
				// recorded) is held to the second rule only.
				legal := back.remaining <= limit
				if left, known := lookupIn(s.unreleased, in.grant); known {
					legal = legal && in.tokens <= left
					back.unreleased = setIn(s.unreleased, in.grant, left-in.tokens)
				}
				switch {
				case out.unknown && legal:
					return []any{s, back}
				case out.unknown:
					return []any{s}
				case out.returned == 0:
					return []any{s} // the window had ended: nothing goes back
				case out.returned == in.tokens && legal:
					return []any{back}
				}
				return nil
			case opRead:
				if out.remaining == s.remaining && out.granted == s.granted && out.release == s.released {
					return []any{s}
				}
				return nil
			}
			return nil
		},
		Equal: func(a, b any) bool { return a.(poolState) == b.(poolState) },
		Hash: func(st any) uint64 {
			s := st.(poolState)
			h := fnv.New64a()
			fmt.Fprintf(h, "%d/%d/%d/%s/%s", s.remaining, s.granted, s.released, s.ids, s.unreleased)
			return h.Sum64()
		},
		DescribeOperation: func(inp, outp any) string {
			in, out := inp.(poolInput), outp.(poolOutput)
			switch in.kind {
			case opAcquire:
				if out.unknown {
					return fmt.Sprintf("acquire(%s, %d) -> ?", in.id, in.asked)
				}
				return fmt.Sprintf("acquire(%s, %d) -> %d", in.id, in.asked, out.tokens)
			case opReplay:
				return fmt.Sprintf("replay(%s) -> %d", in.id, out.tokens)
			case opRelease:
				return fmt.Sprintf("release(%s, %d) -> %d", in.grant, in.tokens, out.returned)
			}
			return fmt.Sprintf("read -> rem %d gr %d rel %d", out.remaining, out.granted, out.release)
		},
		DescribeState: func(st any) string {
			s := st.(poolState)
			return fmt.Sprintf("rem %d gr %d rel %d", s.remaining, s.granted, s.released)
		},
	}
	return nm.ToModel()
}

// checkLinearizable splits q's history by window (each window's pool is an
// independent object, so the whole history is linearizable iff every window's
// is) and runs porcupine on each. Acquires and reads carry their window in
// the response; a Release belongs to its grant's window; an Acquire or a
// probe that was never answered is put into every window it could have
// reached (a probe that arrives after its id's retention is a new Acquire). It also
// checks that windows never reopen: an operation invoked after another
// returned never reports an older window.
func checkLinearizable(h history.History, q Quota, p Params) (LinResult, []Violation) {
	parts := map[int64][]porcupine.Operation{}
	type stamped struct {
		call, ret, window int64
		what              string
	}
	var ordered []stamped
	client := map[string]int{}
	cid := func(name string) int {
		if id, ok := client[name]; ok {
			return id
		}
		client[name] = len(client)
		return client[name]
	}
	for _, e := range h.Events {
		if e.Quota != q.Name {
			continue
		}
		switch e.Kind {
		case history.KindAcquire:
			in := poolInput{kind: opAcquire, id: e.RequestID, asked: e.Asked, pre: e.Next}
			switch e.Outcome {
			case history.OK:
				in.grant = e.GrantID
				parts[e.Window] = append(parts[e.Window], porcupine.Operation{ClientId: cid(e.Region), Input: in, Call: e.Call, Output: poolOutput{tokens: e.Tokens}, Return: e.At})
				// A pre-grant is of the window after the current one: it
				// shows that the current one was at least its predecessor.
				cur := e.Window
				if e.NotBeforeMs > 0 {
					cur--
				}
				ordered = append(ordered, stamped{e.Call, e.At, cur, "acquire " + e.RequestID})
			case history.Unknown:
				from, to := reach(e, q, p)
				for w := from; w <= to; w++ {
					parts[w] = append(parts[w], porcupine.Operation{ClientId: cid(e.Region), Input: in, Call: e.Call, Output: poolOutput{unknown: true}, Return: history.Never})
				}
			}
		case history.KindProbe:
			switch {
			case e.Outcome == history.OK && e.Replayed:
				parts[e.Window] = append(parts[e.Window], porcupine.Operation{ClientId: cid(e.Region), Input: poolInput{kind: opReplay, id: e.RequestID}, Call: e.Call, Output: poolOutput{tokens: e.Tokens}, Return: e.At})
			case e.Outcome == history.Unknown:
				// An unanswered re-send is replayed if it reaches the
				// allocator within the id's retention, and is a new
				// Acquire if it arrives later (a partition's TCP
				// retransmissions deliver it after the heal).
				in := poolInput{kind: opAcquire, id: e.RequestID, asked: e.Asked, pre: e.Next}
				from, to := reach(e, q, p)
				for w := from; w <= to; w++ {
					parts[w] = append(parts[w], porcupine.Operation{ClientId: cid(e.Region), Input: in, Call: e.Call, Output: poolOutput{unknown: true}, Return: history.Never})
				}
			}
		case history.KindRelease:
			in := poolInput{kind: opRelease, tokens: e.Tokens, grant: e.GrantID}
			switch e.Outcome {
			case history.OK:
				parts[e.Window] = append(parts[e.Window], porcupine.Operation{ClientId: cid(e.Region), Input: in, Call: e.Call, Output: poolOutput{returned: e.Returned}, Return: e.At})
			case history.Unknown:
				parts[e.Window] = append(parts[e.Window], porcupine.Operation{ClientId: cid(e.Region), Input: in, Call: e.Call, Output: poolOutput{unknown: true}, Return: history.Never})
			}
		case history.KindGetWindow:
			if e.Outcome != history.OK {
				continue
			}
			parts[e.Window] = append(parts[e.Window], porcupine.Operation{ClientId: cid("observer"), Input: poolInput{kind: opRead}, Call: e.Call,
				Output: poolOutput{remaining: e.Remaining, granted: e.Granted, release: e.Released}, Return: e.At})
			if e.Reason == ReadCurrent {
				// A read of a named past window legitimately reports an
				// older window; only reads of the current one take part in
				// the never-reopen check.
				ordered = append(ordered, stamped{e.Call, e.At, e.Window, "read"})
			}
		}
	}
	var res LinResult
	var out []Violation
	model := poolModel(q.Limit, q.MaxHeldPerRegion)
	idx := make([]int64, 0, len(parts))
	for w := range parts {
		idx = append(idx, w)
	}
	sort.Slice(idx, func(i, j int) bool { return idx[i] < idx[j] })
	for _, w := range idx {
		ops := parts[w]
		res.Windows++
		res.Ops += len(ops)
		start := time.Now()
		verdict, info := porcupine.CheckOperationsVerbose(model, ops, p.LinearizabilityTimeout)
		res.Longest = max(res.Longest, time.Since(start))
		switch verdict {
		case porcupine.Illegal:
			res.Illegal = append(res.Illegal, w)
			out = append(out, Violation{Check: CheckLinearizable, Quota: q.Name, Window: w, At: lease.WindowStart(w, q.WindowMs) * 1e6,
				Detail: fmt.Sprintf("the window's %d operations have no linearization; longest linearizable prefix:\n%s%s", len(ops), describePrefix(model, ops, info), Timeline(h, lease.WindowStart(w, q.WindowMs)*1e6, lease.WindowEnd(w, q.WindowMs)*1e6))})
		case porcupine.Unknown:
			res.Unknown = append(res.Unknown, w)
		}
	}
	// Windows never reopen.
	sort.Slice(ordered, func(i, j int) bool { return ordered[i].call < ordered[j].call })
	byRet := append([]stamped(nil), ordered...)
	sort.Slice(byRet, func(i, j int) bool { return byRet[i].ret < byRet[j].ret })
	var maxW int64 = -1 << 62
	var maxWhat string
	j := 0
	for _, o := range ordered {
		for j < len(byRet) && byRet[j].ret < o.call {
			if byRet[j].window > maxW {
				maxW, maxWhat = byRet[j].window, byRet[j].what
			}
			j++
		}
		if o.window < maxW {
			out = append(out, Violation{Check: CheckReopened, Quota: q.Name, Window: o.window, At: o.call,
				Detail: fmt.Sprintf("%s invoked at %s reports window %d after %s had returned window %d", o.what, fmtTime(o.call), o.window, maxWhat, maxW)})
		}
	}
	return res, out
}

// reach returns the windows an unanswered Acquire (or probe) e could have
// been granted from: those its call and the allocator's apply timeout span,
// or for a pre-grant their successors.
func reach(e history.Event, q Quota, p Params) (from, to int64) {
	from = trueWindow(e.Call, q.WindowMs)
	to = trueWindow(e.At+int64(p.ApplyTimeout), q.WindowMs)
	if e.Next {
		from, to = from+1, to+1
	}
	return from, to
}

func describePrefix(model porcupine.Model, ops []porcupine.Operation, info porcupine.LinearizationInfo) string {
	var b strings.Builder
	partials := info.PartialLinearizationsOperations()
	if len(partials) == 0 || len(partials[0]) == 0 {
		return "  (none)\n"
	}
	longest := partials[0][0]
	for _, p := range partials[0] {
		if len(p) > len(longest) {
			longest = p
		}
	}
	for _, op := range longest {
		fmt.Fprintf(&b, "  %s  %s\n", fmtTime(op.Call), model.DescribeOperation(op.Input, op.Output))
	}
	fmt.Fprintf(&b, "  (%d of %d operations linearized)\n", len(longest), len(ops))
	return b.String()
}
