package check

import (
	"container/heap"
	"fmt"
	"sort"
	"time"

	"github.com/allot-dev/allot/chaos/history"
	"github.com/allot-dev/allot/pkg/lease"
)

type leaseKey struct {
	check, region, quota string
	window               int64
}

// fallbackUse is what one region admitted of one quota in one window
// from its fallback allowance.
type fallbackUse struct {
	region, quota string
	window        int64
	tokens        int64
}

type leaseAgg struct {
	tokens int64
	first  history.Event
	why    string
}

// checkLeases: no admission after its lease's deadline or the allocator's
// expiry (by the true clock), none without a lease, no grant overspent, and
// no grant kept spendable past the allocator's expiry.
//
// Admissions that name their grant (the driver's) are checked one by one.
// Admissions that do not (a region agent: its Redis does not report which
// chunk a decision debited) are matched to the region's received grants by
// earliest-deadline-first, which finds a valid assignment whenever one
// exists: an admission at t may use a grant received before t whose expiry
// is after t, each grant at most its tokens. A grant whose tokens the
// region handed back (Release, whatever its outcome) counts only the tokens
// it kept: a region releases tokens it has taken out of its store (the
// agent withdraws them atomically first) or never put there. (Agent
// admissions are stamped when the answer arrives, a little after the store
// decided; the lease margin between a chunk's Redis expiry and the
// allocator's expiry absorbs that delay.)
//
// An acquire event's Deadline is the moment the region stops spending the
// grant: the driver's deadline, or, for an agent, an upper bound of the
// chunk's expiry in Redis (the deposit's end plus the TTL it gave Redis,
// whose clock is the machine's, on the true clock). The agent's admission
// script never spends a chunk past its Redis expiry (conformance-tested in
// pkg/admission), so a Deadline at or before the allocator's expiry, for
// every grant, means no spend after the lease (deposit_outlives_lease).
//
// It also returns the stranded tokens of anonymous admissions' grants as
// the matching leaves them (expired unspent, per grant): an estimate,
// exact when the store spends earliest-expiring chunks first, as the
// agent's script does.
//
// A grant whose deposit failed after sending an attempt (a region agent's
// deposit event, Outcome Failed) has nothing spendable in the store after
// the deposit returned, its Deadline: the matching lets it cover
// admissions stamped up to answerDelay later (decided by the store before
// the deposit returned, answered after), never after. Counted in r:
// DepositsChecked, the grants whose Deadline was held to the allocator's
// expiry.
//
// A quota with a fallback allowance (Quota.FallbackPerRegion: fail_mode
// fallback) lets a region admit without a grant: its agent deposits the
// allowance into the store while cut off from the allocators (a chunk its
// lease journal lists: history.KindFallback), and its engine admits a
// share in process while the store fails. In a region whose agent journals
// its deposits (any KindDeposit or KindFallback event), the journaled
// allowances take part in the matching as grants (fallbackChunks: live
// from the send until the store expiry bound plus answerDelay, at most the
// tokens each added); what they leave is charged to the in-process share
// only, FallbackPerRegion in a window (true clock) that a fault of the
// region's store touches, or for an admission the agent reported as its
// engine's fail mode's (history.Event.Degraded: its store did not answer
// in time, whoever made it slow), none elsewhere; and what a region admits
// from both in one window is held to FallbackAllowance (twice
// FallbackPerRegion for a degraded admission). In a region without a
// journal, the anonymous admissions the matching leaves uncovered are
// charged to the region's allowance of their window (by the true clock;
// FallbackAllowance), in time order. Both are returned as the fallback
// uses; only what exceeds them is spent_without_lease. (The agent places
// an allowance by the leader's clock and ends it the lease margin before
// the window does, so its admissions, answered within the margin, fall in
// that window of the true clock: fallback_outside_window checks it.) Named
// admissions (the driver's) are never charged to it: the driver has no
// fallback.
func checkLeases(h history.History, quotas map[string]Quota, answerDelay, grace time.Duration, r *Result) ([]Violation, []history.Event, []fallbackUse) {
	received := map[string]history.Event{}
	failed := map[string]bool{} // grant id -> its deposit failed after an attempt was sent
	for _, e := range h.Events {
		switch {
		case e.Kind == history.KindAcquire && e.Outcome == history.OK && e.Tokens > 0:
			received[e.GrantID] = e
		case e.Kind == history.KindDeposit && e.Outcome == history.Failed && e.Deadline != 0:
			failed[e.GrantID] = true
		}
	}
	released := map[string]int64{} // grant id -> tokens handed back
	for _, e := range h.Events {
		if e.Kind == history.KindRelease && e.Tokens > 0 {
			released[e.GrantID] += e.Tokens
		}
	}
	var lastAt int64
	for _, e := range h.Events {
		if e.At != history.Never {
			lastAt = max(lastAt, e.At)
		}
	}
	agg := map[leaseKey]*leaseAgg{}
	add := func(check string, e history.Event, tokens int64, why string) {
		k := leaseKey{check, e.Region, e.Quota, e.Window}
		a := agg[k]
		if a == nil {
			a = &leaseAgg{first: e, why: why}
			agg[k] = a
		}
		a.tokens += tokens
	}
	for _, g := range received {
		if g.Deadline != 0 && g.ExpiresMs != 0 {
			r.DepositsChecked++
		}
		if g.Deadline != 0 && g.ExpiresMs != 0 && g.Deadline > g.ExpiresMs*1e6 {
			add(CheckDepositLate, g, g.Tokens, fmt.Sprintf("grant %s x%d spendable until %s, %.1f ms after the allocator's expiry %s",
				g.GrantID, g.Tokens, fmtTime(g.Deadline), float64(g.Deadline-g.ExpiresMs*1e6)/1e6, fmtTime(g.ExpiresMs*1e6)))
		}
	}
	spent := map[string]int64{}
	type rq struct{ region, quota string }
	anonymous := map[rq][]history.Event{}
	for _, e := range h.Events {
		if e.Kind != history.KindAdmit {
			continue
		}
		if e.Replayed {
			r.ReplayedAdmissions++
		}
		if e.Degraded {
			r.DegradedAdmissions++
		}
		if e.GrantID == "" {
			anonymous[rq{e.Region, e.Quota}] = append(anonymous[rq{e.Region, e.Quota}], e)
			continue
		}
		g, ok := received[e.GrantID]
		switch {
		case !ok || g.Region != e.Region || g.Quota != e.Quota:
			add(CheckUnleased, e, e.Tokens, fmt.Sprintf("grant %s was not received by %s for %s", e.GrantID, e.Region, e.Quota))
			continue
		case e.At < g.At:
			add(CheckUnleased, e, e.Tokens, fmt.Sprintf("grant %s spent at %s before it was received at %s", e.GrantID, fmtTime(e.At), fmtTime(g.At)))
		case e.At < g.NotBeforeMs*1e6:
			add(CheckUnleased, e, e.Tokens, fmt.Sprintf("pre-grant %s spent at %s before its window started at %s", e.GrantID, fmtTime(e.At), fmtTime(g.NotBeforeMs*1e6)))
		case e.At >= g.ExpiresMs*1e6:
			add(CheckLateSpend, e, e.Tokens, fmt.Sprintf("grant %s spent at %s, %.1f ms after the allocator's expiry %s (region deadline %s)",
				e.GrantID, fmtTime(e.At), float64(e.At-g.ExpiresMs*1e6)/1e6, fmtTime(g.ExpiresMs*1e6), fmtTime(e.Deadline)))
		case e.Deadline != 0 && e.At >= e.Deadline:
			add(CheckLateSpend, e, e.Tokens, fmt.Sprintf("grant %s spent at %s after the region's own deadline %s", e.GrantID, fmtTime(e.At), fmtTime(e.Deadline)))
		}
		spent[e.GrantID] += e.Tokens
		if spent[e.GrantID] > g.Tokens {
			add(CheckOverspent, e, e.Tokens, fmt.Sprintf("grant %s of %d tokens spent %d times", e.GrantID, g.Tokens, spent[e.GrantID]))
		}
	}
	// Anonymous admissions: EDF over what the named ones left. A region
	// that reports no grants of the quota at all (an agent that does not
	// record its Acquires) is matched against the grants the allocator's
	// ledgers list for it, taken as received when they were made, less what
	// the ledgers say was released. A region that reports grants is held to
	// them, even when all of them were released.
	ledger := ledgerGrants(h)
	var strands []history.Event
	used := map[leaseKey]int64{}      // check field unused: (region, quota, window) -> charged to the allowance
	inProcess := map[leaseKey]int64{} // of used: charged to the in-process share (regions with a journal)
	agentJournal := map[string]bool{} // regions whose agents journal their deposits
	for _, e := range h.Events {
		if e.Kind == history.KindDeposit || e.Kind == history.KindFallback {
			agentJournal[e.Region] = true
		}
	}
	for k, adm := range anonymous {
		var gs []history.Event
		journaled := false // the region reported grants of the quota
		for _, g := range received {
			if g.Region == k.region && g.Quota == k.quota {
				journaled = true
				g.Tokens -= spent[g.GrantID]
				g.Tokens -= released[g.GrantID]
				// A pre-grant covers nothing before its window starts.
				g.At = max(g.At, g.NotBeforeMs*1e6)
				if failed[g.GrantID] && g.Deadline != 0 {
					// Nothing of it is spendable after its deposit
					// returned: it covers answers up to answerDelay
					// later (rounded up to the millisecond).
					end := g.Deadline + int64(answerDelay)
					g.ExpiresMs = min(g.ExpiresMs, (end+1e6-1)/1e6)
				}
				if g.Tokens > 0 {
					gs = append(gs, g)
				}
			}
		}
		fromLedger := false
		if !journaled {
			gs = append(gs, ledger[reqKey{k.region, k.quota}]...)
			fromLedger = true
		}
		q := quotas[k.quota]
		// A region whose agent journals its deposits journals its
		// fallback allowances too: its admissions are matched to those
		// chunks, each live from its send until its store expiry bound
		// (plus answerDelay), beside the grants.
		perChunk := q.FallbackPerRegion > 0 && q.WindowMs > 0 && agentJournal[k.region]
		chunkTokens := map[string]int64{}
		if perChunk {
			for _, c := range fallbackChunks(h, k.region, k.quota, q, answerDelay) {
				chunkTokens[c.GrantID] = c.Tokens
				gs = append(gs, c)
			}
		}
		miss, left := unmatched(adm, gs)
		if perChunk {
			chunkUsed := map[int64]history.Event{} // window -> its chunks, Tokens = what they covered
			for _, g := range left {
				if g.Kind != history.KindFallback {
					continue
				}
				c, ok := chunkUsed[g.Window]
				if !ok {
					c = *g
					c.Tokens = 0
				}
				c.Tokens += chunkTokens[g.GrantID] - g.Tokens
				chunkUsed[g.Window] = c
			}
			for w, c := range chunkUsed {
				uk := leaseKey{region: k.region, quota: k.quota, window: w}
				used[uk] += c.Tokens
				if allow := FallbackAllowance(q, h.Spans, k.region, w, grace); used[uk] > allow {
					add(CheckUnleased, c, used[uk]-allow, fmt.Sprintf("the fallback allowances of window %d deposited into the store covered %d admissions no grant covers, "+
						"more than the region's allowance of the window, %d", w, used[uk], allow))
				}
			}
		}
		for _, e := range miss {
			why := "no received grant was live for it (earliest-deadline-first matching)"
			if perChunk {
				// The agent's engine admits an in-process share while
				// the store fails: FallbackPerRegion more in a window a
				// fault of the region's store touches, none elsewhere.
				uk := leaseKey{region: k.region, quota: k.quota, window: trueWindow(replayStart(e), q.WindowMs)}
				allow := FallbackAllowance(q, h.Spans, k.region, uk.window, grace)
				if e.Degraded {
					// The agent reported its engine's fail mode: its store
					// did not answer in time, a fault of the run's or not
					// (an agent just restarted into a burst of retries, a
					// machine too busy). The in-process share is the
					// bound's store_fallback term all the same.
					allow = max(allow, 2*q.FallbackPerRegion)
				}
				share := allow - q.FallbackPerRegion
				take := min(e.Tokens, max(share-inProcess[uk], 0), max(allow-used[uk], 0))
				inProcess[uk] += take
				used[uk] += take
				if e.Tokens -= take; e.Tokens == 0 {
					continue
				}
				e.Window = uk.window
				why = fmt.Sprintf("neither a received grant nor a journaled fallback allowance was live for it (earliest-deadline-first matching), "+
					"and the in-process share of window %d while the region's store fails, %d, was spent (with the allowances, %d of %d)", uk.window, share, used[uk], allow)
			} else if q.FallbackPerRegion > 0 && q.WindowMs > 0 {
				uk := leaseKey{region: k.region, quota: k.quota, window: trueWindow(replayStart(e), q.WindowMs)}
				allow := FallbackAllowance(q, h.Spans, k.region, uk.window, grace)
				take := min(e.Tokens, max(allow-used[uk], 0))
				used[uk] += take
				if e.Tokens -= take; e.Tokens == 0 {
					continue
				}
				e.Window = uk.window
				why = fmt.Sprintf("no received grant was live for it (earliest-deadline-first matching), and the region's fallback allowance of window %d, %d, was spent", uk.window, allow)
			}
			add(CheckUnleased, e, e.Tokens, why)
		}
		if fromLedger {
			continue
		}
		for _, g := range left {
			if g.Kind != history.KindFallback && g.Tokens > 0 && g.ExpiresMs*1e6 <= lastAt {
				strands = append(strands, history.Event{Kind: history.KindStrand, Region: g.Region, Quota: g.Quota, At: g.ExpiresMs * 1e6,
					GrantID: g.GrantID, Tokens: g.Tokens, Window: g.Window, ExpiresMs: g.ExpiresMs})
			}
		}
	}
	var uses []fallbackUse
	for k, n := range used {
		if n > 0 {
			uses = append(uses, fallbackUse{region: k.region, quota: k.quota, window: k.window, tokens: n})
		}
	}
	var out []Violation
	for k, a := range agg {
		what := "admissions"
		if k.check == CheckDepositLate {
			what = "tokens"
		}
		out = append(out, Violation{Check: k.check, Quota: k.quota, Window: k.window, Region: k.region, At: a.first.At,
			Detail: fmt.Sprintf("%d %s; first: %s", a.tokens, what, a.why)})
	}
	return out, strands, uses
}

// fallbackChunks are the fallback allowances region journaled for quota q
// that added tokens to its store, as grants for the matching (Kind
// KindFallback): each covers admissions from its send (At) until its store
// expiry bound plus answerDelay (ExpiresMs, rounded up to the
// millisecond): for a failed deposit its return, for one of unknown outcome
// its window's end (a late copy is deposit_unknown's).
func fallbackChunks(h history.History, region, quota string, q Quota, answerDelay time.Duration) []history.Event {
	var out []history.Event
	for _, e := range h.Events {
		if e.Kind != history.KindFallback || e.Region != region || e.Quota != quota || e.Tokens <= 0 {
			continue
		}
		end := e.Deadline
		if e.Outcome == history.Unknown {
			end = lease.WindowEnd(e.Window, q.WindowMs) * 1e6
		}
		end += int64(answerDelay)
		out = append(out, history.Event{Kind: history.KindFallback, Region: region, Quota: quota, GrantID: e.GrantID, Tokens: e.Tokens,
			Window: e.Window, At: fallbackFrom(e), ExpiresMs: (end + 1e6 - 1) / 1e6, Outcome: e.Outcome})
	}
	return out
}

// ledgerGrants collects, per (region, quota), every grant any ledger read
// listed, as events received at their grant time.
func ledgerGrants(h history.History) map[reqKey][]history.Event {
	at := map[string]int{} // grant id -> its index in out[k]
	released := map[string]int64{}
	out := map[reqKey][]history.Event{}
	for _, e := range h.Events {
		if e.Kind != history.KindGetWindow || e.Outcome != history.OK {
			continue
		}
		for _, g := range e.Grants {
			// Releases only grow, and a region hands back only tokens it
			// did not spend: what any read says was released was never
			// spendable.
			released[g.GrantID] = max(released[g.GrantID], g.Released)
			if _, seen := at[g.GrantID]; seen || g.Tokens <= 0 {
				continue
			}
			k := reqKey{g.Region, e.Quota}
			at[g.GrantID] = len(out[k])
			out[k] = append(out[k], history.Event{Kind: history.KindAcquire, Region: g.Region, Quota: e.Quota, GrantID: g.GrantID,
				Tokens: g.Tokens, Window: e.Window, At: g.GrantedMs * 1e6, ExpiresMs: g.ExpiresMs, Outcome: history.OK})
		}
	}
	for k, gs := range out {
		for i := range gs {
			gs[i].Tokens -= released[gs[i].GrantID]
		}
		out[k] = gs
	}
	return out
}

// unmatched returns the admissions (split by token) that no grant can
// cover, and the grants with what the admissions left of them: grants are
// intervals [received, expiry) with a capacity, each admission is a point
// (At), or, when it is a replay, an interval [Call, At] (decided by an
// earlier attempt whose answer was lost). Taking admissions in the order of
// their ends and giving each to the grant live within it that expires first
// is optimal: a grant that expires later serves every later admission the
// earlier one could.
func unmatched(adm []history.Event, grants []history.Event) ([]history.Event, []*history.Event) {
	sort.SliceStable(adm, func(i, j int) bool { return adm[i].At < adm[j].At })
	sort.Slice(grants, func(i, j int) bool { return grants[i].At < grants[j].At })
	all := make([]*history.Event, len(grants))
	for i := range grants {
		g := grants[i]
		all[i] = &g
	}
	live := &byExpiry{}
	var gone []*history.Event // expired before the current admission, tokens left: for replays
	var out []history.Event
	gi := 0
	for _, a := range adm {
		for gi < len(all) && all[gi].At <= a.At {
			heap.Push(live, all[gi])
			gi++
		}
		for live.Len() > 0 && ((*live)[0].ExpiresMs*1e6 <= a.At || (*live)[0].Tokens == 0) {
			g := heap.Pop(live).(*history.Event)
			if g.Tokens > 0 {
				gone = append(gone, g)
			}
		}
		need := a.Tokens
		if from := replayStart(a); from < a.At {
			// Grants that expired within [from, At), earliest expiry
			// first, before the live ones, which expire later.
			for need > 0 {
				var best *history.Event
				for _, g := range gone {
					if g.Tokens > 0 && g.ExpiresMs*1e6 > from && (best == nil || g.ExpiresMs < best.ExpiresMs) {
						best = g
					}
				}
				if best == nil {
					break
				}
				take := min(need, best.Tokens)
				best.Tokens -= take
				need -= take
			}
		}
		for need > 0 && live.Len() > 0 { // every grant left expires after At
			g := (*live)[0]
			if g.Tokens == 0 {
				heap.Pop(live)
				continue
			}
			take := min(need, g.Tokens)
			g.Tokens -= take
			need -= take
		}
		if need > 0 {
			miss := a
			miss.Tokens = need
			out = append(out, miss)
		}
	}
	return out, all
}

// replayStart is the earliest instant admission a can have been decided:
// its first send when it is a replay (history.Event.Replayed), else At.
func replayStart(a history.Event) int64 {
	if a.Replayed && a.Call > 0 && a.Call < a.At {
		return a.Call
	}
	return a.At
}

type byExpiry []*history.Event

func (b byExpiry) Len() int           { return len(b) }
func (b byExpiry) Less(i, j int) bool { return b[i].ExpiresMs < b[j].ExpiresMs }
func (b byExpiry) Swap(i, j int)      { b[i], b[j] = b[j], b[i] }
func (b *byExpiry) Push(x any)        { *b = append(*b, x.(*history.Event)) }
func (b *byExpiry) Pop() any {
	old := *b
	x := old[len(old)-1]
	*b = old[:len(old)-1]
	return x
}

// checkDeposits: a region agent's deposit whose outcome is unknown (an
// attempt may have reached the store, and the agent could not withdraw it)
// may land late and count its TTL from its arrival: the chunk then stays
// spendable past the allocator's expiry, by as long as it was late, and
// nothing bounds that. The same holds of a fallback allowance's deposit
// (KindFallback), whose late copy may outlive its window. Each is a violation, unless a fault span that stops
// or kills its region's store (Span.Store) comes within grace of the
// deposit, from its send to its return: the attempt, or the withdrawal that
// follows the return (bounded by the agent's Acquire timeout, 2 s), may
// then have met a dead store, and a copy the store had is lost with it.
// Counted in r: DepositsUnknown, and DepositsExcused of them.
func checkDeposits(h history.History, grace time.Duration, r *Result) []Violation {
	var out []Violation
	for _, e := range h.Events {
		if (e.Kind != history.KindDeposit && e.Kind != history.KindFallback) || e.Outcome != history.Unknown {
			continue
		}
		r.DepositsUnknown++
		from := e.Call
		if from == 0 {
			from = e.At
		}
		if storeFault(h.Spans, e.Region, from, e.At, grace) {
			r.DepositsExcused++
			continue
		}
		detail := fmt.Sprintf("deposit of grant %s x%d (sent %s, returned %s) has an unknown outcome: a copy may land late and stay spendable "+
			"past the allocator's expiry %s, and no fault of the region's store covers it", e.GrantID, e.Tokens, fmtTime(from), fmtTime(e.At), fmtTime(e.ExpiresMs*1e6))
		if e.Kind == history.KindFallback {
			detail = fmt.Sprintf("deposit of fallback allowance %s x%d (sent %s, returned %s) has an unknown outcome: a copy may land late and stay spendable "+
				"past the end of its window %d, and no fault of the region's store covers it", e.GrantID, e.Tokens, fmtTime(from), fmtTime(e.At), e.Window)
		}
		if e.Err != "" {
			detail += " (" + e.Err + ")"
		}
		out = append(out, Violation{Check: CheckDepositUnknown, Quota: e.Quota, Window: e.Window, Region: e.Region, At: e.At, Detail: detail})
	}
	return out
}

// storeFault reports whether a span that stops or kills region's store
// comes within grace of [from, to].
func storeFault(spans []history.Span, region string, from, to int64, grace time.Duration) bool {
	for _, s := range spans {
		if s.Store && s.Skipped == "" && s.Affects(region) && from <= s.End+int64(grace) && to >= s.Start-int64(grace) {
			return true
		}
	}
	return false
}
