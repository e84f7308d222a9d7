package bound

import (
	"cmp"
	"maps"
	"slices"
	"strings"
)

// Observation is what one or more regions report for one window of a quota.
// Several observations of the same window are summed region by region, so
// each region may report on its own.
type Observation struct {
	// WindowIndex is floor(window start / Window) since the epoch.
	WindowIndex int64
	// Admitted is the tokens admitted against the quota, per region
	// (including fallback admissions).
	Admitted map[string]int64
	// Granted is the tokens the allocator granted, per region; optional.
	Granted map[string]int64
	// Unspent is the granted tokens that expired unspent (stranded), per
	// region; optional. Stranded capacity is reported only when present.
	Unspent map[string]int64
}

// RegionLedger is one region's counts in one window.
type RegionLedger struct {
	// Region is the region's name.
	Region string
	// Admitted is the tokens the region admitted.
	Admitted int64
	// Granted is the tokens granted to the region, if reported.
	Granted int64
	// Unspent is the granted tokens that expired unspent, if reported.
	Unspent int64
}

// WindowReport is the reconciliation of one window.
type WindowReport struct {
	// WindowIndex is the window.
	WindowIndex int64
	// Admitted is the total admitted by all regions.
	Admitted int64
	// Overshoot is how far Admitted exceeds G (0 if it does not).
	Overshoot int64
	// Violation says Admitted exceeds the bound's ceiling, G + Total: the
	// stated bound was broken, so a term's assumption failed or there is a bug.
	Violation bool
	// Regions is the per-region ledger, sorted by region.
	Regions []RegionLedger
	// StrandedKnown says some region reported Unspent for this window.
	StrandedKnown bool
	// Stranded is the total unspent tokens, when known.
	Stranded int64
	// StrandedPercent is Stranded as a percentage of G, when known.
	StrandedPercent float64
}

// InvalidCount is a reported count that cannot be a count: a negative
// number of tokens.
type InvalidCount struct {
	// WindowIndex is the window the count was reported for.
	WindowIndex int64
	// Region is the region it was reported for.
	Region string
	// Field is "admitted", "granted" or "unspent".
	Field string
	// Value is the count as reported.
	Value int64
}

// Report is the reconciliation of observed admissions against a bound.
type Report struct {
	// Limit is G.
	Limit int64
	// Ceiling is G plus the bound's total, the most any window may admit.
	Ceiling int64
	// Windows are the observed windows in ascending order.
	Windows []WindowReport
	// Violations are the windows that broke the bound, in ascending order.
	Violations []WindowReport
	// MaxOvershoot is the largest Overshoot of any window.
	MaxOvershoot int64
	// Invalid lists the negative counts found in the observations, in the
	// order of the observations and then by region and field. They are left
	// out of every sum (a negative count must not hide another region's
	// admissions), and a report with any is not OK: the observations are
	// broken, so the reconciliation cannot vouch for the bound.
	Invalid []InvalidCount
}

// OK reports whether no window broke the bound and every count was valid.
func (r Report) OK() bool { return len(r.Violations) == 0 && len(r.Invalid) == 0 }

// Reconcile checks every observed window against b: a window whose total
// admissions exceed b.Ceiling() is a violation, listed with its per-region
// ledger. Counts are summed as given, saturating at MaxInt64 (a total that
// large is a violation of any bound); negative counts are listed in
// Report.Invalid and left out of the sums.
func Reconcile(b Bound, observed []Observation) Report {
	type acc struct {
		regions map[string]*RegionLedger
		unspent bool
	}
	byWindow := make(map[int64]*acc)
	ledger := func(a *acc, region string) *RegionLedger {
		l, ok := a.regions[region]
		if !ok {
			l = &RegionLedger{Region: region}
			a.regions[region] = l
		}
		return l
	}
	r := Report{Limit: b.Limit, Ceiling: b.Ceiling()}
	// valid lists the negative counts of one field of one observation in
	// region order, and reports whether v may be summed.
	var bad []InvalidCount
	valid := func(w int64, region, field string, v int64) bool {
		if v < 0 {
			bad = append(bad, InvalidCount{WindowIndex: w, Region: region, Field: field, Value: v})
		}
		return v >= 0
	}
	for _, o := range observed {
		a, ok := byWindow[o.WindowIndex]
		if !ok {
			a = &acc{regions: make(map[string]*RegionLedger)}
			byWindow[o.WindowIndex] = a
		}
		bad = bad[:0]
		for region, v := range o.Admitted {
			if valid(o.WindowIndex, region, "admitted", v) {
				l := ledger(a, region)
				l.Admitted = satAdd(l.Admitted, v)
			}
		}
		for region, v := range o.Granted {
			if valid(o.WindowIndex, region, "granted", v) {
				l := ledger(a, region)
				l.Granted = satAdd(l.Granted, v)
			}
		}
		for region, v := range o.Unspent {
			if valid(o.WindowIndex, region, "unspent", v) {
				l := ledger(a, region)
				l.Unspent = satAdd(l.Unspent, v)
				a.unspent = true
			}
		}
		slices.SortFunc(bad, func(x, y InvalidCount) int {
			return cmp.Or(strings.Compare(x.Region, y.Region), strings.Compare(x.Field, y.Field))
		})
		r.Invalid = append(r.Invalid, bad...)
	}

	for _, w := range slices.Sorted(maps.Keys(byWindow)) {
		a := byWindow[w]
		wr := WindowReport{WindowIndex: w, StrandedKnown: a.unspent}
		for _, region := range slices.Sorted(maps.Keys(a.regions)) {
			l := *a.regions[region]
			wr.Regions = append(wr.Regions, l)
			wr.Admitted = satAdd(wr.Admitted, l.Admitted)
			wr.Stranded = satAdd(wr.Stranded, l.Unspent)
		}
		wr.Overshoot = max(0, wr.Admitted-b.Limit)
		wr.Violation = wr.Admitted > r.Ceiling
		if wr.StrandedKnown && b.Limit > 0 {
			wr.StrandedPercent = float64(wr.Stranded) * 100 / float64(b.Limit)
		}
		r.MaxOvershoot = max(r.MaxOvershoot, wr.Overshoot)
		r.Windows = append(r.Windows, wr)
		if wr.Violation {
			r.Violations = append(r.Violations, wr)
		}
	}
	return r
}
