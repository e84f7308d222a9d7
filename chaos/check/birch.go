package check

import (
	"fmt"
	"sort"
	"strings"
	"time"

	"github.com/allot-dev/allot/chaos/history"
)

// checkBirch: a well-behaved quota sees no denials outside fault windows. A
// denial is excused when a fault span that touches its region covers it
// (extended by grace past the span's end), or when the request was sent
// before the region received its first grant of the quota and within
// startup of the region's first request or Acquire of it (start-up: such a
// request waits from a cold start, and its wait may span the first window
// turn, when clamped leases leave a region nothing to spend for a moment;
// a region still without a grant after that is starved, not starting).
// Every reason counts: a
// 429 (limited) and a 503 (the limiter could not decide) alike fail the
// tenant's request; the violation says how many of each. A region that
// sent requests of the quota but never received a grant of it is a
// violation of its own, whatever the faults.
func checkBirch(h history.History, quotas map[string]Quota, grace, startup time.Duration) []Violation {
	first := map[reqKey]int64{} // (region, quota) -> first grant received
	began := map[reqKey]int64{} // (region, quota) -> its first request or Acquire
	requests := map[reqKey]int64{}
	for _, e := range h.Events {
		k := reqKey{e.Region, e.Quota}
		switch e.Kind {
		case history.KindAcquire, history.KindAdmit, history.KindDeny:
			if t, ok := began[k]; !ok || sent(e) < t {
				began[k] = sent(e)
			}
		}
		if e.Kind == history.KindAdmit || e.Kind == history.KindDeny {
			requests[k] += e.Tokens
		}
		if e.Kind == history.KindAcquire && e.Outcome == history.OK && e.Tokens > 0 {
			if t, ok := first[k]; !ok || e.At < t {
				first[k] = e.At
			}
		}
	}
	type key struct {
		region, quota string
		window        int64
	}
	agg := map[key]*Violation{}
	counts := map[key]int64{}
	reasons := map[key]map[string]int64{}
	for _, e := range h.Events {
		q, ok := quotas[e.Quota]
		if e.Kind != history.KindDeny || !ok || !q.Birch {
			continue
		}
		rk := reqKey{e.Region, e.Quota}
		if t, ok := first[rk]; (!ok || e.At < t || sent(e) < t) && sent(e) < began[rk]+int64(startup) {
			continue
		}
		if excused(h.Spans, e.Region, e.At, grace) {
			continue
		}
		k := key{e.Region, e.Quota, trueWindow(e.At, q.WindowMs)}
		counts[k] += e.Tokens
		if reasons[k] == nil {
			reasons[k] = map[string]int64{}
		}
		reasons[k][e.Reason] += e.Tokens
		if agg[k] == nil {
			agg[k] = &Violation{Check: CheckBirch, Quota: e.Quota, Window: k.window, Region: e.Region, At: e.At}
			agg[k].Detail = fmt.Sprintf("first denial at %s (%s), outside every fault window%s", fmtTime(e.At), e.Reason, denialContext(h, e))
		}
	}
	var out []Violation
	for k, n := range requests {
		if !quotas[k.quota].Birch {
			continue
		}
		if _, ok := first[k]; !ok {
			out = append(out, Violation{Check: CheckBirch, Quota: k.quota, Region: k.id, At: began[k],
				Detail: fmt.Sprintf("%d requests from %s on, but the region never received a grant of the quota", n, fmtTime(began[k]))})
		}
	}
	for k, v := range agg {
		var by []string
		for r, n := range reasons[k] {
			by = append(by, fmt.Sprintf("%s %d", r, n))
		}
		sort.Strings(by)
		v.Detail = fmt.Sprintf("%d denials (%s); %s", counts[k], strings.Join(by, ", "), v.Detail)
		out = append(out, *v)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].At < out[j].At })
	return out
}

// sent is when e's request or operation was sent (its answer's time when
// the call time is not recorded).
func sent(e history.Event) int64 {
	if e.Call != 0 {
		return e.Call
	}
	return e.At
}

// contextBefore is how far before a denial's call denialContext looks for
// its region's Acquires of the quota.
const contextBefore = 2 * time.Second

// denialContext says, for a report that must be read without the run's
// logs (a CI failure), when the denied request was sent and which Acquires
// of its quota its region made from contextBefore before that until the
// denial: a renewal that was late, unanswered or never asked is the usual
// story.
func denialContext(h history.History, d history.Event) string {
	var b strings.Builder
	if d.Call != 0 {
		fmt.Fprintf(&b, "; sent at %s, answered after %s", fmtTime(d.Call), time.Duration(d.At-d.Call).Round(time.Millisecond))
	}
	from := d.At - int64(contextBefore)
	if d.Call != 0 {
		from = d.Call - int64(contextBefore)
	}
	var lines []string
	for _, e := range h.Events {
		if e.Kind != history.KindAcquire || e.Region != d.Region || e.Quota != d.Quota || e.Call > d.At || e.At < from {
			continue
		}
		// An Unknown outcome's At is its last attempt's.
		answered := fmt.Sprintf("%s after %s", e.Outcome, time.Duration(e.At-e.Call).Round(time.Millisecond))
		what := "renewal"
		if e.Next {
			what = "pre-grant"
		}
		lines = append(lines, fmt.Sprintf("%s %s asked %d got %d (%s)", fmtTime(e.Call), what, e.Asked, e.Tokens, answered))
	}
	if len(lines) == 0 {
		fmt.Fprintf(&b, "; no Acquire of the quota from %s before", contextBefore)
		return b.String()
	}
	fmt.Fprintf(&b, "; Acquires of the quota from %s before: %s", contextBefore, strings.Join(lines, "; "))
	return b.String()
}

func excused(spans []history.Span, region string, at int64, grace time.Duration) bool {
	for _, s := range spans {
		if s.Skipped == "" && s.Affects(region) && at >= s.Start && at <= s.End+int64(grace) {
			return true
		}
	}
	return false
}

// recovery measures, for each span, how long after RecoverFrom every region
// it touches had a successful Acquire again.
func recovery(h history.History) []time.Duration {
	regions := map[string]bool{}
	for _, e := range h.Events {
		if e.Kind == history.KindAcquire {
			regions[e.Region] = true
		}
	}
	out := make([]time.Duration, len(h.Spans))
	for i, s := range h.Spans {
		if s.Skipped != "" {
			continue
		}
		firstOK := map[string]int64{}
		for _, e := range h.Events {
			if e.Kind != history.KindAcquire || e.Outcome != history.OK || e.At < s.RecoverFrom || !s.Affects(e.Region) {
				continue
			}
			if t, ok := firstOK[e.Region]; !ok || e.At < t {
				firstOK[e.Region] = e.At
			}
		}
		var worst int64
		for r := range regions {
			if !s.Affects(r) {
				continue
			}
			t, ok := firstOK[r]
			if !ok {
				worst = -1
				break
			}
			worst = max(worst, t-s.RecoverFrom)
		}
		out[i] = time.Duration(worst)
	}
	return out
}
