package bound

import (
	"maps"
	"slices"
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
}

// OK reports whether no window broke the bound.
func (r Report) OK() bool { return len(r.Violations) == 0 }

// Reconcile checks every observed window against b: a window whose total
// admissions exceed b.Ceiling() is a violation, listed with its per-region
// ledger. Values are summed as given.
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
	for _, o := range observed {
		a, ok := byWindow[o.WindowIndex]
		if !ok {
			a = &acc{regions: make(map[string]*RegionLedger)}
			byWindow[o.WindowIndex] = a
		}
		for region, v := range o.Admitted {
			ledger(a, region).Admitted += v
		}
		for region, v := range o.Granted {
			ledger(a, region).Granted += v
		}
		for region, v := range o.Unspent {
			ledger(a, region).Unspent += v
			a.unspent = true
		}
	}

	r := Report{Limit: b.Limit, Ceiling: b.Ceiling()}
	for _, w := range slices.Sorted(maps.Keys(byWindow)) {
		a := byWindow[w]
		wr := WindowReport{WindowIndex: w, StrandedKnown: a.unspent}
		for _, region := range slices.Sorted(maps.Keys(a.regions)) {
			l := *a.regions[region]
			wr.Regions = append(wr.Regions, l)
			wr.Admitted += l.Admitted
			wr.Stranded += l.Unspent
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
