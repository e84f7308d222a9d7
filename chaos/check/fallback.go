package check

import (
	"fmt"
	"sort"
	"strings"

	"github.com/allot-dev/allot/chaos/history"
	"github.com/allot-dev/allot/pkg/lease"
)

// checkFallbacks holds every fallback allowance a region agent journaled
// (history.KindFallback: a fail_mode fallback quota's allowance, deposited
// into the region's store while cut off from the allocators) to what the
// agent promises of it:
//
//   - fallback_outside_window: its chunk is spendable in the store only
//     inside its window by the true clock (the allocators' clocks are the
//     machine's: the true clock here). It was sent no earlier than the
//     window's start, and its store expiry bound (Deadline: the return plus
//     the TTL it gave the store, or the return of a failed one) is no later
//     than the window's end: it never spills into the next window, where
//     the region's next allowance (or a fresh pool) is due. Checked for
//     chunks that added tokens; a deposit of unknown outcome bounds nothing
//     and is deposit_unknown's (checkDeposits), whose end is not checked
//     here (its start is).
//   - fallback_overlap: no region holds two windows' allowances of a quota
//     at once: the lifetimes [Call, Deadline] (send to store-expiry bound,
//     the most the chunk can live) of two chunks of different windows,
//     across the region's agent processes, do not overlap.
//   - fallback_not_cut_off: an allowance is deposited only while the agent
//     counts itself cut off: the last Acquire attempt its process ended
//     before the deposit was sent went unanswered (history.Event
//     LastAcquire; the agent sets its cut-off state on an unanswered or
//     unusable answer and clears it on an answer, and deposits an allowance
//     only in a round that found it set). The criterion is the agent's own,
//     read from its journal, not a fault span: allocators become
//     unreachable in leader faults too (isolate-leader, stop-leader, the
//     kills), where a cut-off agent rightly deposits its allowance, and a
//     span's edges say nothing of when an agent noticed.
//
// Counted in r: Fallbacks, FallbackTokens.
func checkFallbacks(h history.History, quotas map[string]Quota, r *Result) []Violation {
	var out []Violation
	type rq struct{ region, quota string }
	chunks := map[rq][]history.Event{}
	for _, e := range h.Events {
		if e.Kind != history.KindFallback {
			continue
		}
		r.Fallbacks++
		if e.Outcome == history.OK {
			r.FallbackTokens += e.Tokens
		}
		if v, ok := fallbackCutOff(e); !ok {
			out = append(out, v)
		}
		if e.Tokens <= 0 {
			continue // no chunk of its own
		}
		if e.Outcome != history.Unknown {
			chunks[rq{e.Region, e.Quota}] = append(chunks[rq{e.Region, e.Quota}], e)
		}
		q, known := quotas[e.Quota]
		if !known || q.WindowMs <= 0 {
			continue
		}
		start, end := lease.WindowStart(e.Window, q.WindowMs)*1e6, lease.WindowEnd(e.Window, q.WindowMs)*1e6
		var why []string
		if e.Call != 0 && e.Call < start {
			why = append(why, fmt.Sprintf("sent at %s, %.1f ms before its window started at %s", fmtTime(e.Call), float64(start-e.Call)/1e6, fmtTime(start)))
		}
		if e.Outcome != history.Unknown && e.Deadline > end {
			why = append(why, fmt.Sprintf("spendable in the store until %s, %.1f ms after its window ended at %s", fmtTime(e.Deadline), float64(e.Deadline-end)/1e6, fmtTime(end)))
		}
		if len(why) > 0 {
			out = append(out, Violation{Check: CheckFallbackWindow, Quota: e.Quota, Window: e.Window, Region: e.Region, At: e.Call,
				Detail: fmt.Sprintf("%s: %s (%s)", fallbackName(e), strings.Join(why, "; "), fallbackClock(e))})
		}
	}
	for _, cs := range chunks {
		sort.SliceStable(cs, func(i, j int) bool { return fallbackFrom(cs[i]) < fallbackFrom(cs[j]) })
		for i, a := range cs {
			for _, b := range cs[i+1:] {
				if fallbackFrom(b) >= a.Deadline {
					break // b starts after a ends, and so does every later one
				}
				if a.Window == b.Window {
					continue
				}
				out = append(out, Violation{Check: CheckFallbackOverlap, Quota: a.Quota, Window: b.Window, Region: a.Region, At: fallbackFrom(b),
					Detail: fmt.Sprintf("%s, sent %s, was spendable in the store until %s, after %s was sent at %s: two windows' allowances at once for %.1f ms",
						fallbackName(a), fmtTime(fallbackFrom(a)), fmtTime(a.Deadline), fallbackName(b), fmtTime(fallbackFrom(b)),
						float64(min(a.Deadline, b.Deadline)-fallbackFrom(b))/1e6)})
			}
		}
	}
	return out
}

// fallbackCutOff checks that fallback e was deposited while its agent
// counted itself cut off (see checkFallbacks), returning the violation
// when it was not.
func fallbackCutOff(e history.Event) (Violation, bool) {
	la := e.LastAcquire
	if la != nil && la.Outcome == history.Unknown {
		return Violation{}, true
	}
	why := "its agent process had ended no Acquire attempt before it (it cannot have measured the leader's clock, nor found the allocators unreachable)"
	if la != nil {
		why = fmt.Sprintf("the last Acquire attempt its agent process ended before it, %s, was answered at %s, %.1f ms before: the agent was not cut off",
			la.RequestID, fmtTime(la.At), float64(fallbackFrom(e)-la.At)/1e6)
	}
	return Violation{Check: CheckFallbackNotCutOff, Quota: e.Quota, Window: e.Window, Region: e.Region, At: fallbackFrom(e),
		Detail: fmt.Sprintf("%s, sent at %s: %s", fallbackName(e), fmtTime(fallbackFrom(e)), why)}, false
}

// fallbackFrom is when fallback e's chunk may first be in the store: its
// send (its return when no send is known).
func fallbackFrom(e history.Event) int64 {
	if e.Call != 0 {
		return e.Call
	}
	return e.At
}

// fallbackName names fallback e in violations.
func fallbackName(e history.Event) string {
	return fmt.Sprintf("fallback allowance %s x%d (%s)", e.GrantID, e.Tokens, e.Outcome)
}

// fallbackClock says where the agent placed fallback e: its estimate of
// the leader's clock at the send against the true clock.
func fallbackClock(e history.Event) string {
	if e.LeaderNowMs == 0 || e.Call == 0 {
		return "no estimate of the leader's clock journaled"
	}
	return fmt.Sprintf("the agent's estimate of the leader's clock at the send %s, the true clock %s", fmtTime(e.LeaderNowMs*1e6), fmtTime(e.Call))
}
