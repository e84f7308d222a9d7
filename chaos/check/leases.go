package check

import (
	"container/heap"
	"fmt"
	"sort"

	"github.com/allot-dev/allot/chaos/history"
)

type leaseKey struct {
	check, region, quota string
	window               int64
}

type leaseAgg struct {
	tokens int64
	first  history.Event
	why    string
}

// checkLeases: no admission after its lease's deadline or the allocator's
// expiry (by the true clock), none without a lease, no grant overspent.
//
// Admissions that name their grant (the driver's) are checked one by one.
// Admissions that do not (a region agent whose store does not report which
// chunk it debited) are matched to the region's received grants by
// earliest-deadline-first, which finds a valid assignment whenever one
// exists: an admission at t may use a grant received before t whose expiry
// is after t, each grant at most its tokens.
func checkLeases(h history.History) []Violation {
	received := map[string]history.Event{}
	for _, e := range h.Events {
		if e.Kind == history.KindAcquire && e.Outcome == history.OK && e.Tokens > 0 {
			received[e.GrantID] = e
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
	spent := map[string]int64{}
	type rq struct{ region, quota string }
	anonymous := map[rq][]history.Event{}
	for _, e := range h.Events {
		if e.Kind != history.KindAdmit {
			continue
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
	// that reports no grants at all (an agent that does not record its
	// Acquires) is matched against the grants the allocator's ledgers list
	// for it, taken as received when they were made.
	ledger := ledgerGrants(h)
	for k, adm := range anonymous {
		var gs []history.Event
		for _, g := range received {
			if g.Region == k.region && g.Quota == k.quota {
				g.Tokens -= spent[g.GrantID]
				if g.Tokens > 0 {
					gs = append(gs, g)
				}
			}
		}
		if len(gs) == 0 {
			for _, g := range ledger[reqKey{k.region, k.quota}] {
				gs = append(gs, g)
			}
		}
		for _, e := range unmatched(adm, gs) {
			add(CheckUnleased, e, e.Tokens, "no received grant was live for it (earliest-deadline-first matching)")
		}
	}
	var out []Violation
	for k, a := range agg {
		out = append(out, Violation{Check: k.check, Quota: k.quota, Window: k.window, Region: k.region, At: a.first.At,
			Detail: fmt.Sprintf("%d admissions; first: %s", a.tokens, a.why)})
	}
	return out
}

// ledgerGrants collects, per (region, quota), every grant any ledger read
// listed, as events received at their grant time.
func ledgerGrants(h history.History) map[reqKey][]history.Event {
	seen := map[string]bool{}
	out := map[reqKey][]history.Event{}
	for _, e := range h.Events {
		if e.Kind != history.KindGetWindow || e.Outcome != history.OK {
			continue
		}
		for _, g := range e.Grants {
			if seen[g.GrantID] || g.Tokens <= 0 {
				continue
			}
			seen[g.GrantID] = true
			k := reqKey{g.Region, e.Quota}
			out[k] = append(out[k], history.Event{Kind: history.KindAcquire, Region: g.Region, Quota: e.Quota, GrantID: g.GrantID,
				Tokens: g.Tokens, Window: e.Window, At: g.GrantedMs * 1e6, ExpiresMs: g.ExpiresMs, Outcome: history.OK})
		}
	}
	return out
}

// unmatched returns the admissions (split by token) that no grant can
// cover: grants are intervals [received, expiry) with a capacity, each
// admission is a point; taking points in time order and giving each to the
// live grant that expires first is optimal.
func unmatched(adm []history.Event, grants []history.Event) []history.Event {
	sort.SliceStable(adm, func(i, j int) bool { return adm[i].At < adm[j].At })
	sort.Slice(grants, func(i, j int) bool { return grants[i].At < grants[j].At })
	live := &byExpiry{}
	var out []history.Event
	gi := 0
	for _, a := range adm {
		for gi < len(grants) && grants[gi].At <= a.At {
			g := grants[gi]
			heap.Push(live, &g)
			gi++
		}
		need := a.Tokens
		for need > 0 && live.Len() > 0 {
			g := (*live)[0]
			if g.ExpiresMs*1e6 <= a.At || g.Tokens == 0 {
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
	return out
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
