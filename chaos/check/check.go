// Package check holds the chaos suite's checkers. Each reads a whole
// recorded history (package history) and returns the violations it finds;
// none of them looks at a clock or a network, so each is tested on
// hand-written histories as well as on real runs.
//
//   - Bound: every quota, every window by the true clock: admitted <= G +
//     the stated bound.
//   - Grants: lost grants = 0 (every grant a region received is in every
//     later ledger read of its window) and no request id granted twice
//     (replays return the recorded grant; grant ids are unique).
//   - Leases: no admission after its lease's deadline or the allocator's
//     expiry, no admission without a lease (beyond a fail_mode fallback
//     quota's per-region, per-window fallback allowance), no grant
//     overspent, no grant
//     spendable in the region (its deadline, or its chunk's Redis expiry)
//     past the allocator's expiry, no deposit of unknown outcome outside a
//     fault of its region's store; every fallback allowance a region agent
//     journaled lives in the store only inside its window, never beside
//     another window's, and was deposited while its agent was cut off
//     (fallback.go).
//   - Linearizable: the Acquire/Release/GetWindow history of every quota and
//     window is linearizable against a model of the pool (porcupine), and
//     windows never reopen.
//   - Birch: a well-behaved quota sees no denials outside fault windows.
//
// Stranded capacity and time-to-recover are computed for the report, not
// asserted.
package check

import (
	"fmt"
	"math"
	"sort"
	"strings"
	"time"

	"github.com/allot-dev/allot/chaos/history"
	"github.com/allot-dev/allot/pkg/lease"
)

// Quota is what the checkers know of one leased quota.
type Quota struct {
	// Name of the quota.
	Name string
	// Limit is G per window.
	Limit int64
	// WindowMs is the window length.
	WindowMs int64
	// Bound is the overshoot the run is held to: what GetBound stated, or
	// a claim under test.
	Bound int64
	// Birch marks a well-behaved quota: no denials outside fault windows.
	Birch bool
	// MaxHeldPerRegion is the policy's lease.max_held_per_region (0: no
	// cap): the allocator grants a region at most the cap less what it
	// holds, so a grant may be smaller than min(asked, remaining).
	MaxHeldPerRegion int64
	// FallbackPerRegion is the policy's lease.fallback_per_region (fail_mode
	// fallback; 0: fail closed), or a claim under test. A region's
	// admissions that no grant covers are charged to it, per window of the
	// true clock: at most FallbackPerRegion (the allowance its agent
	// deposits while cut off from the allocators: the bound's fallback
	// term), plus as many again in a window that a fault of the region's
	// store touches (its agent's engine then admits its in-process share,
	// FallbackPerRegion / its one gateway: the store_fallback term). Beyond
	// that they are spent_without_lease. See FallbackAllowance.
	FallbackPerRegion int64
}

// FallbackAllowance is what region may admit of q in window w without a
// grant (see Quota.FallbackPerRegion): the fallback allowance, doubled when
// a span that stops or kills the region's store, extended by grace past
// its end, touches the window.
func FallbackAllowance(q Quota, spans []history.Span, region string, w int64, grace time.Duration) int64 {
	if q.FallbackPerRegion <= 0 {
		return 0
	}
	win := &Window{Start: lease.WindowStart(w, q.WindowMs) * 1e6, End: lease.WindowEnd(w, q.WindowMs) * 1e6}
	for _, s := range spans {
		if s.Store && s.Affects(region) && touches(s, win, grace) {
			return 2 * q.FallbackPerRegion
		}
	}
	return q.FallbackPerRegion
}

// Ceiling is G plus the bound, saturating at math.MaxInt64 (as the bound's
// own Ceiling does) rather than wrapping to a negative ceiling.
func (q Quota) Ceiling() int64 {
	if q.Bound > 0 && q.Limit > math.MaxInt64-q.Bound {
		return math.MaxInt64
	}
	return q.Limit + q.Bound
}

// Params configure a check.
type Params struct {
	// Quotas are the checked quotas.
	Quotas []Quota
	// FaultGrace extends every fault span past its end for the Birch check:
	// the time a healed region may take to be served again.
	FaultGrace time.Duration
	// LinearizabilityTimeout bounds porcupine on one window (default 20s).
	LinearizabilityTimeout time.Duration
	// StartupGrace bounds the Birch check's start-up excuse: a denial of a
	// request sent before its region's first grant of the quota is excused
	// only within this long after the region's first request or Acquire of
	// it (default 5s: a cold start takes a WAN round trip, or a window turn
	// and a starve wait).
	StartupGrace time.Duration
	// ApplyTimeout is how long after its last attempt an unanswered Acquire
	// may still take effect: the allocator's proposal timeout, plus how long
	// the network may hold the request (after a partition heals, TCP's
	// backed-off retransmissions deliver what was sent during it).
	ApplyTimeout time.Duration
	// AnswerDelay is how long after the store decided an agent's admission
	// its answer may be stamped (default 250 ms, the lease margin, which
	// absorbs the same delay for grants the store holds to their expiry):
	// a grant whose deposit failed covers admissions stamped up to this
	// long after the deposit returned.
	AnswerDelay time.Duration
}

// Check names.
const (
	CheckBound        = "bound"
	CheckLostGrant    = "lost_grant"
	CheckDoubleGrant  = "double_grant"
	CheckUnverified   = "ledger_unread"
	CheckLateSpend    = "spent_after_deadline"
	CheckUnleased     = "spent_without_lease"
	CheckOverspent    = "grant_overspent"
	CheckLinearizable = "linearizability"
	CheckReopened     = "window_reopened"
	CheckBirch        = "birch_denied"
	CheckRelease      = "release_rejected"
	CheckDepositLate  = "deposit_outlives_lease"
	// CheckDepositUnknown: a deposit whose outcome is unknown (a late copy
	// may outlive its lease, unboundedly) outside every fault of its
	// region's store.
	CheckDepositUnknown = "deposit_unknown"
	// CheckFallbackWindow: a fallback allowance's chunk (a region agent's
	// journaled KindFallback) may be spendable in the store outside its
	// window, by the true clock: sent before the window started, or its
	// store expiry bound after the window ended (spilling into the next).
	CheckFallbackWindow = "fallback_outside_window"
	// CheckFallbackOverlap: two fallback allowances of one region and
	// quota, of different windows, may be spendable in the store at once.
	CheckFallbackOverlap = "fallback_overlap"
	// CheckFallbackNotCutOff: a fallback allowance deposited while its
	// agent process did not count itself cut off: the last Acquire attempt
	// it ended before the deposit was answered (or it had ended none).
	CheckFallbackNotCutOff = "fallback_not_cut_off"
)

// Checks lists every check, in the report's order.
var Checks = []string{CheckBound, CheckLostGrant, CheckDoubleGrant, CheckUnverified, CheckLateSpend, CheckUnleased, CheckOverspent,
	CheckLinearizable, CheckReopened, CheckBirch, CheckRelease, CheckDepositLate, CheckDepositUnknown,
	CheckFallbackWindow, CheckFallbackOverlap, CheckFallbackNotCutOff}

// Violation is one broken invariant.
type Violation struct {
	// Check names the checker (Check* constants).
	Check string
	// Quota, Window and Region locate it (when they apply).
	Quota  string
	Window int64
	Region string
	// At is when (true Unix ns), when it applies.
	At int64
	// Detail explains it, with the ledgers and the fault timeline for a
	// bound violation.
	Detail string
}

// String renders the violation on one line (its detail may add more).
func (v Violation) String() string {
	var loc []string
	if v.Quota != "" {
		loc = append(loc, "quota "+v.Quota)
	}
	if v.Window != 0 {
		loc = append(loc, fmt.Sprintf("window %d", v.Window))
	}
	if v.Region != "" {
		loc = append(loc, "region "+v.Region)
	}
	if v.At != 0 {
		loc = append(loc, "at "+fmtTime(v.At))
	}
	return fmt.Sprintf("%s [%s]: %s", v.Check, strings.Join(loc, ", "), v.Detail)
}

// RegionWindow is one region's numbers in one window of a quota.
type RegionWindow struct {
	// Offered = Admitted + Denied, by the true clock.
	Admitted, Denied int64
	// Granted is what the region received for this window (its view);
	// LedgerGranted what the allocator's ledger says (last read).
	Granted, LedgerGranted int64
	// Stranded is tokens of this window's grants that expired unspent;
	// Released those handed back.
	Stranded, Released int64
	// Fallback is the admissions no grant covers, charged to the region's
	// fallback allowance (Quota.FallbackPerRegion; at most
	// FallbackAllowance).
	Fallback int64
}

// Window is one window of one quota.
type Window struct {
	// Quota and Index identify it.
	Quota string
	Index int64
	// Start and End in true Unix ns.
	Start, End int64
	// Admitted is the total admitted by the true clock.
	Admitted int64
	// Stranded is the total stranded of this window's grants.
	Stranded int64
	// Fallback is the total admitted from the regions' fallback
	// allowances (RegionWindow.Fallback).
	Fallback int64
	// Regions are the per-region numbers.
	Regions map[string]*RegionWindow
	// LedgerRead says the allocator's ledger was read after the window's
	// last grant was received.
	LedgerRead bool
}

// Result is the outcome of Run.
type Result struct {
	// Windows per quota, by index.
	Windows map[string][]*Window
	// Violations of every check.
	Violations []Violation
	// Linearizability per quota.
	Linearizability map[string]LinResult
	// Grants is the number of grants received; Replays the replays checked;
	// LedgerReads the ledger reads grants were checked against.
	Grants, Replays, LedgerReads int
	// Unresolved counts Acquires never answered (their effect is unknown)
	// and ledger grants no region knows of.
	Unresolved, Unclaimed int
	// ReplayedAdmissions counts admissions answered as replays of an
	// earlier decision (placed from their first send: see checkLeases).
	ReplayedAdmissions int
	// DegradedAdmissions counts admissions an agent's fail mode decided
	// (history.Event.Degraded: its store did not answer in time).
	DegradedAdmissions int
	// DepositsChecked counts the grants whose Deadline (an agent's store
	// expiry bound, a driver's own deadline) was held to the allocator's
	// expiry; DepositsUnknown the deposits whose outcome was unknown, and
	// DepositsExcused those of them a fault of their region's store covers.
	DepositsChecked, DepositsUnknown, DepositsExcused int
	// Fallbacks counts the fallback allowances region agents journaled
	// (KindFallback) and the fallback checks held; FallbackTokens what
	// those that were made added to their stores.
	Fallbacks      int
	FallbackTokens int64
	// Recovery per span (same order as the history's spans); negative when
	// not every affected region was served again before the end.
	Recovery []time.Duration
}

// OK says no check failed.
func (r *Result) OK() bool { return len(r.Violations) == 0 }

// Vacuous lists what the checkers had nothing of to check (empty when
// every check had something): a run that lists anything proved nothing of
// it.
func (r *Result) Vacuous() []string {
	var out []string
	if r.Grants == 0 {
		out = append(out, "no grant received")
	}
	if r.LedgerReads == 0 {
		out = append(out, "no ledger read")
	}
	if r.Replays == 0 {
		out = append(out, "no replay checked")
	}
	if r.Grants > 0 && r.DepositsChecked == 0 {
		out = append(out, fmt.Sprintf("no grant's deposit deadline checked against its expiry (of %d grants received)", r.Grants))
	}
	return out
}

// Count returns how many violations of check there are (all if check is "").
func (r *Result) Count(check string) int {
	n := 0
	for _, v := range r.Violations {
		if check == "" || v.Check == check {
			n++
		}
	}
	return n
}

// Run runs every checker over h.
func Run(h history.History, p Params) *Result {
	if p.LinearizabilityTimeout <= 0 {
		p.LinearizabilityTimeout = 20 * time.Second
	}
	if p.ApplyTimeout <= 0 {
		p.ApplyTimeout = 5 * time.Second
	}
	if p.StartupGrace <= 0 {
		p.StartupGrace = 5 * time.Second
	}
	if p.AnswerDelay <= 0 {
		p.AnswerDelay = 250 * time.Millisecond
	}
	r := &Result{Windows: map[string][]*Window{}, Linearizability: map[string]LinResult{}}
	quotas := map[string]Quota{}
	for _, q := range p.Quotas {
		quotas[q.Name] = q
	}
	windows := tally(h, quotas)
	for name, ws := range windows {
		r.Windows[name] = ws
	}
	r.Violations = append(r.Violations, checkBound(h, quotas, windows)...)
	r.Violations = append(r.Violations, checkGrants(h, quotas, windows, r)...)
	lv, strands, fallbacks := checkLeases(h, quotas, p.AnswerDelay, p.FaultGrace, r)
	r.Violations = append(r.Violations, lv...)
	r.Violations = append(r.Violations, checkDeposits(h, p.FaultGrace, r)...)
	r.Violations = append(r.Violations, checkFallbacks(h, quotas, r)...)
	addStrands(windows, quotas, strands)
	addFallbacks(windows, fallbacks)
	r.Violations = append(r.Violations, checkBirch(h, quotas, p.FaultGrace, p.StartupGrace)...)
	for _, q := range p.Quotas {
		lr, vs := checkLinearizable(h, q, p)
		r.Linearizability[q.Name] = lr
		r.Violations = append(r.Violations, vs...)
	}
	r.Recovery = recovery(h)
	sort.SliceStable(r.Violations, func(i, j int) bool {
		a, b := r.Violations[i], r.Violations[j]
		if a.Check != b.Check {
			return a.Check < b.Check
		}
		if a.Quota != b.Quota {
			return a.Quota < b.Quota
		}
		return a.Window < b.Window
	})
	return r
}

// tally builds the per-window numbers of every known quota.
func tally(h history.History, quotas map[string]Quota) map[string][]*Window {
	idx := map[string]map[int64]*Window{}
	get := func(quota string, w int64) *Window {
		q := quotas[quota]
		m := idx[quota]
		if m == nil {
			m = map[int64]*Window{}
			idx[quota] = m
		}
		win := m[w]
		if win == nil {
			win = &Window{Quota: quota, Index: w, Start: lease.WindowStart(w, q.WindowMs) * 1e6, End: lease.WindowEnd(w, q.WindowMs) * 1e6, Regions: map[string]*RegionWindow{}}
			m[w] = win
		}
		return win
	}
	region := func(win *Window, r string) *RegionWindow {
		rw := win.Regions[r]
		if rw == nil {
			rw = &RegionWindow{}
			win.Regions[r] = rw
		}
		return rw
	}
	for _, e := range h.Events {
		q, ok := quotas[e.Quota]
		if !ok {
			continue
		}
		switch e.Kind {
		case history.KindAdmit:
			win := get(e.Quota, trueWindow(replayStart(e), q.WindowMs)) // a replay: its first send's window
			win.Admitted += e.Tokens
			region(win, e.Region).Admitted += e.Tokens
		case history.KindDeny:
			region(get(e.Quota, trueWindow(e.At, q.WindowMs)), e.Region).Denied += e.Tokens
		case history.KindAcquire:
			if e.Outcome == history.OK && e.Tokens > 0 {
				region(get(e.Quota, e.Window), e.Region).Granted += e.Tokens
			}
		case history.KindStrand:
			win := get(e.Quota, e.Window)
			win.Stranded += e.Tokens
			region(win, e.Region).Stranded += e.Tokens
		case history.KindRelease:
			if e.Outcome == history.OK {
				region(get(e.Quota, e.Window), e.Region).Released += e.Returned
			}
		case history.KindGetWindow:
			if e.Outcome != history.OK {
				continue
			}
			win := get(e.Quota, e.Window)
			per := map[string]int64{}
			for _, g := range e.Grants {
				per[g.Region] += g.Tokens
			}
			for r, n := range per {
				region(win, r).LedgerGranted = n
			}
		}
	}
	out := map[string][]*Window{}
	for name, m := range idx {
		for _, w := range m {
			out[name] = append(out[name], w)
		}
		sort.Slice(out[name], func(i, j int) bool { return out[name][i].Index < out[name][j].Index })
	}
	return out
}

// addStrands adds estimated strands (see checkLeases) to the windows of
// regions that report none themselves.
func addStrands(windows map[string][]*Window, quotas map[string]Quota, strands []history.Event) {
	for _, e := range strands {
		if _, ok := quotas[e.Quota]; !ok {
			continue
		}
		for _, w := range windows[e.Quota] {
			if w.Index != e.Window {
				continue
			}
			w.Stranded += e.Tokens
			rw := w.Regions[e.Region]
			if rw == nil {
				rw = &RegionWindow{}
				w.Regions[e.Region] = rw
			}
			rw.Stranded += e.Tokens
		}
	}
}

// addFallbacks adds the admissions charged to fallback allowances (see
// checkLeases) to their windows.
func addFallbacks(windows map[string][]*Window, uses []fallbackUse) {
	for _, u := range uses {
		for _, w := range windows[u.quota] {
			if w.Index != u.window {
				continue
			}
			w.Fallback += u.tokens
			rw := w.Regions[u.region]
			if rw == nil {
				rw = &RegionWindow{}
				w.Regions[u.region] = rw
			}
			rw.Fallback += u.tokens
		}
	}
}

// trueWindow is the window holding true instant ns.
func trueWindow(ns, windowMs int64) int64 {
	return lease.WindowIndex(floorDiv(ns, 1e6), windowMs)
}

func floorDiv(a, b int64) int64 {
	q := a / b
	if a%b != 0 && (a < 0) != (b < 0) {
		q--
	}
	return q
}

func fmtTime(ns int64) string {
	return time.Unix(0, ns).UTC().Format("15:04:05.000")
}

// checkBound: admitted <= G + bound in every window by the true clock.
func checkBound(h history.History, quotas map[string]Quota, windows map[string][]*Window) []Violation {
	var out []Violation
	for name, ws := range windows {
		q := quotas[name]
		for _, w := range ws {
			if w.Admitted <= q.Ceiling() {
				continue
			}
			out = append(out, Violation{Check: CheckBound, Quota: name, Window: w.Index, At: w.Start,
				Detail: fmt.Sprintf("admitted %d > G %d + bound %d = %d in [%s, %s)\n%s%s",
					w.Admitted, q.Limit, q.Bound, q.Ceiling(), fmtTime(w.Start), fmtTime(w.End), Ledgers(w), Timeline(h, w.Start-int64(q.WindowMs)*1e6, w.End+int64(q.WindowMs)*1e6))})
		}
	}
	return out
}

// Ledgers renders a window's per-region ledger.
func Ledgers(w *Window) string {
	var b strings.Builder
	fmt.Fprintf(&b, "  %-8s %9s %9s %9s %9s %9s %9s %9s\n", "region", "admitted", "denied", "granted", "ledger", "released", "stranded", "fallback")
	names := make([]string, 0, len(w.Regions))
	for r := range w.Regions {
		names = append(names, r)
	}
	sort.Strings(names)
	for _, r := range names {
		x := w.Regions[r]
		fmt.Fprintf(&b, "  %-8s %9d %9d %9d %9d %9d %9d %9d\n", r, x.Admitted, x.Denied, x.Granted, x.LedgerGranted, x.Released, x.Stranded, x.Fallback)
	}
	return b.String()
}

// Timeline renders the fault timeline between from and to (true ns).
func Timeline(h history.History, from, to int64) string {
	var b strings.Builder
	b.WriteString("  fault timeline:\n")
	n := 0
	for _, f := range h.Faults {
		if f.At < from || f.At > to {
			continue
		}
		fmt.Fprintf(&b, "    %s %-18s %-8s %s\n", fmtTime(f.At), f.Scenario, f.Action, f.Detail)
		n++
	}
	if n == 0 {
		b.WriteString("    (no fault near this window)\n")
	}
	return b.String()
}
