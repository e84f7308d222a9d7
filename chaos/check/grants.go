package check

import (
	"fmt"
	"sort"

	"github.com/allot-dev/allot/chaos/history"
)

type reqKey struct{ id, quota string }

type winKey struct {
	quota  string
	window int64
}

// checkGrants: lost grants = 0 and no request id granted twice.
//
// Every grant a region received must be in every ledger read (GetWindow,
// answered by the leader after a barrier) of its window that was invoked
// after the grant was received: reads are taken at every window's end and
// after every fault, so this holds across every failover of the run. A
// request id re-sent on purpose (a probe) must be replayed with the same
// grant, and a grant id must belong to one request id.
func checkGrants(h history.History, quotas map[string]Quota, windows map[string][]*Window, r *Result) []Violation {
	var out []Violation
	grants := map[string]history.Event{}
	byReq := map[reqKey]history.Event{}
	byWin := map[winKey][]history.Event{}
	for _, e := range h.Events {
		if e.Kind != history.KindAcquire {
			continue
		}
		if _, ok := quotas[e.Quota]; !ok {
			continue
		}
		if e.Outcome == history.Unknown {
			r.Unresolved++
			continue
		}
		if e.Outcome != history.OK {
			continue
		}
		k := reqKey{e.RequestID, e.Quota}
		if prev, dup := byReq[k]; dup && (prev.GrantID != e.GrantID || prev.Tokens != e.Tokens) {
			out = append(out, Violation{Check: CheckDoubleGrant, Quota: e.Quota, Window: e.Window, Region: e.Region, At: e.At,
				Detail: fmt.Sprintf("request id %s answered twice differently: %s x%d, then %s x%d", e.RequestID, prev.GrantID, prev.Tokens, e.GrantID, e.Tokens)})
		}
		byReq[k] = e
		if e.Tokens == 0 {
			continue
		}
		r.Grants++
		if prev, dup := grants[e.GrantID]; dup && (prev.RequestID != e.RequestID || prev.Quota != e.Quota) {
			out = append(out, Violation{Check: CheckDoubleGrant, Quota: e.Quota, Window: e.Window, Region: e.Region, At: e.At,
				Detail: fmt.Sprintf("grant id %s returned for request %s/%s and %s/%s", e.GrantID, prev.RequestID, prev.Quota, e.RequestID, e.Quota)})
			continue
		}
		grants[e.GrantID] = e
		byWin[winKey{e.Quota, e.Window}] = append(byWin[winKey{e.Quota, e.Window}], e)
	}
	for _, e := range h.Events {
		if e.Kind == history.KindRelease && e.Outcome == history.Failed && e.Reason != "not_found" {
			// The region releases a grant's whole rest once: any rejection
			// other than "window no longer retained" means the allocator
			// disagrees about what was granted or released.
			out = append(out, Violation{Check: CheckRelease, Quota: e.Quota, Window: e.Window, Region: e.Region, At: e.At,
				Detail: fmt.Sprintf("release of %d tokens of grant %s rejected: %s", e.Tokens, e.GrantID, e.Err)})
		}
		if e.Kind != history.KindProbe || e.Outcome != history.OK {
			continue
		}
		orig, ok := byReq[reqKey{e.RequestID, e.Quota}]
		if !ok {
			continue
		}
		r.Replays++
		switch {
		case !e.Replayed:
			out = append(out, Violation{Check: CheckDoubleGrant, Quota: e.Quota, Window: e.Window, Region: e.Region, At: e.At,
				Detail: fmt.Sprintf("request id %s re-sent and granted anew (%s x%d; first answer %s x%d)", e.RequestID, e.GrantID, e.Tokens, orig.GrantID, orig.Tokens)})
		case e.GrantID != orig.GrantID || e.Tokens != orig.Tokens:
			out = append(out, Violation{Check: CheckDoubleGrant, Quota: e.Quota, Window: e.Window, Region: e.Region, At: e.At,
				Detail: fmt.Sprintf("request id %s replayed as %s x%d but first answered %s x%d", e.RequestID, e.GrantID, e.Tokens, orig.GrantID, orig.Tokens)})
		}
	}
	for k := range byWin {
		sort.Slice(byWin[k], func(i, j int) bool { return byWin[k][i].At < byWin[k][j].At })
	}

	reads := map[winKey][]history.Event{}
	for _, e := range h.Events {
		if e.Kind == history.KindGetWindow && e.Outcome == history.OK {
			if _, ok := quotas[e.Quota]; ok {
				reads[winKey{e.Quota, e.Window}] = append(reads[winKey{e.Quota, e.Window}], e)
			}
		}
	}
	unclaimed := map[string]bool{}
	lost := map[string]bool{}
	for k, rs := range reads {
		for _, read := range rs {
			r.LedgerReads++
			in := make(map[string]history.LedgerGrant, len(read.Grants))
			for _, g := range read.Grants {
				in[g.GrantID] = g
				if _, known := grants[g.GrantID]; !known && g.Tokens > 0 {
					unclaimed[g.GrantID] = true
				}
			}
			for _, g := range byWin[k] {
				if g.At >= read.Call {
					break
				}
				lg, ok := in[g.GrantID]
				if ok && lg.Region == g.Region && lg.Tokens == g.Tokens {
					continue
				}
				if lost[g.GrantID] {
					continue // reported once
				}
				lost[g.GrantID] = true
				what := "missing from"
				if ok {
					what = fmt.Sprintf("recorded as %s x%d in", lg.Region, lg.Tokens)
				}
				out = append(out, Violation{Check: CheckLostGrant, Quota: k.quota, Window: k.window, Region: g.Region, At: read.Call,
					Detail: fmt.Sprintf("grant %s x%d received at %s is %s the ledger read at %s (%d grants)\n%s",
						g.GrantID, g.Tokens, fmtTime(g.At), what, fmtTime(read.Call), len(read.Grants), Timeline(h, g.At, read.At))})
			}
		}
	}
	r.Unclaimed = len(unclaimed)
	// Coverage: a window whose grants no later read saw was not checked.
	for k, gs := range byWin {
		last := gs[len(gs)-1].At
		read := false
		for _, rd := range reads[k] {
			if rd.Call > last {
				read = true
				break
			}
		}
		for _, w := range windows[k.quota] {
			if w.Index == k.window {
				w.LedgerRead = read
			}
		}
		if !read {
			out = append(out, Violation{Check: CheckUnverified, Quota: k.quota, Window: k.window, At: last,
				Detail: fmt.Sprintf("no ledger read after the window's last grant (%s): its %d grants were not checked", fmtTime(last), len(gs))})
		}
	}
	return out
}
