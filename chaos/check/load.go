package check

import (
	"fmt"
	"slices"
	"time"

	"github.com/allot-dev/allot/chaos/history"
)

// Denied is the total denied in the window (every reason), by the true
// clock of the answers.
func (w *Window) Denied() int64 {
	var n int64
	for _, rw := range w.Regions {
		n += rw.Denied
	}
	return n
}

// Offered is the load the window was offered as measured: every answered
// request, admitted or denied, by the true clock of its answer, over every
// region (not the configured demand, which a starved load generator or a
// region that never started would not reach).
func (w *Window) Offered() int64 { return w.Admitted + w.Denied() }

// touches says whether span s, extended by grace past its end, overlaps w.
// A skipped span touches nothing.
func touches(s history.Span, w *Window, grace time.Duration) bool {
	return s.Skipped == "" && w.End > s.Start && w.Start <= s.End+int64(grace)
}

// CalmWindows returns quota's windows, in index order, that no fault span
// (extended by grace past its end) touches: the windows in which every part
// of the system was up. Unlike the report's calm row it keeps windows that
// admitted nothing.
func CalmWindows(h history.History, r *Result, quota string, grace time.Duration) []*Window {
	var out []*Window
	for _, w := range r.Windows[quota] {
		if !slices.ContainsFunc(h.Spans, func(s history.Span) bool { return touches(s, w, grace) }) {
			out = append(out, w)
		}
	}
	return out
}

// Load is what one quota's load came to over a run, measured from the
// history.
type Load struct {
	// Quota is the quota; Ceiling its G + bound.
	Quota   string
	Ceiling int64
	// Calm is the number of calm windows (CalmWindows) that answered any
	// request of the quota.
	Calm int
	// MedianOffered and MaxOffered are the measured offered load
	// (Window.Offered) of the calm windows.
	MedianOffered, MaxOffered int64
	// Contended counts the calm windows offered more than the ceiling in
	// which some requests were denied: the windows in which the bound check
	// could have failed, and the limiter said no. A quota without one was
	// never pushed against its limit outside a fault, and its bound check
	// proved nothing of the calm case.
	Contended int
	// Admitted is the total admitted per region over the whole run.
	Admitted map[string]int64
}

// MeasureLoad measures q's load over the run (grace extends every fault span
// past its end, as for the report).
func MeasureLoad(h history.History, r *Result, q Quota, grace time.Duration) Load {
	l := Load{Quota: q.Name, Ceiling: q.Ceiling(), Admitted: map[string]int64{}}
	for _, w := range r.Windows[q.Name] {
		for name, rw := range w.Regions {
			l.Admitted[name] += rw.Admitted
		}
	}
	var offered []int64
	for _, w := range CalmWindows(h, r, q.Name, grace) {
		o := w.Offered()
		if o == 0 {
			continue // before the load started or after it stopped
		}
		offered = append(offered, o)
		if o > l.Ceiling && w.Denied() > 0 {
			l.Contended++
		}
	}
	l.Calm = len(offered)
	if len(offered) > 0 {
		slices.Sort(offered)
		l.MedianOffered, l.MaxOffered = offered[len(offered)/2], offered[len(offered)-1]
	}
	return l
}

// String renders the load for the report.
func (l Load) String() string {
	return fmt.Sprintf("offered %s (measured: answers by the true clock, admitted + denied) in %d calm windows: median %d, max %d per window; %d above G + bound = %d with denials",
		l.Quota, l.Calm, l.MedianOffered, l.MaxOffered, l.Contended, l.Ceiling)
}

// Fallback is what one quota's regions admitted from their fallback
// allowances over a run (Quota.FallbackPerRegion), measured from the
// result.
type Fallback struct {
	// Quota is the quota; PerRegion its allowance per region per window.
	Quota     string
	PerRegion int64
	// Tokens is the total admitted from the allowances; RegionWindows the
	// (region, window) pairs that admitted from one, Max the most one of
	// them did.
	Tokens        int64
	RegionWindows int
	Max           int64
	// CutOffSpans counts the spans that cut regions off from the
	// allocators (Span.CutOff) and ran. CutOff counts the region-windows
	// that admitted from the allowance and that such a span touches
	// (extended by grace past its end) and affects; Elsewhere the others,
	// and Calm those of them that no span at all touches (an agent whose
	// Acquire failed outside every fault, or a store slower than the
	// agent's store timeout).
	CutOffSpans, CutOff, Elsewhere, Calm int
}

// MeasureFallback measures q's fallback admissions over the run.
func MeasureFallback(h history.History, r *Result, q Quota, grace time.Duration) Fallback {
	f := Fallback{Quota: q.Name, PerRegion: q.FallbackPerRegion}
	var cuts []history.Span
	for _, s := range h.Spans {
		if s.CutOff && s.Skipped == "" {
			cuts = append(cuts, s)
		}
	}
	f.CutOffSpans = len(cuts)
	for _, w := range r.Windows[q.Name] {
		for name, rw := range w.Regions {
			if rw.Fallback <= 0 {
				continue
			}
			f.Tokens += rw.Fallback
			f.RegionWindows++
			f.Max = max(f.Max, rw.Fallback)
			if slices.ContainsFunc(cuts, func(s history.Span) bool { return s.Affects(name) && touches(s, w, grace) }) {
				f.CutOff++
			} else {
				f.Elsewhere++
				if !slices.ContainsFunc(h.Spans, func(s history.Span) bool { return touches(s, w, grace) }) {
					f.Calm++
				}
			}
		}
	}
	return f
}

// String renders the fallback admissions for the report.
func (f Fallback) String() string {
	return fmt.Sprintf("fallback %s: %d per region per window (doubled in a fault of the region's store); admitted from it %d in %d region-windows "+
		"(most in one %d), %d of them in a cut-off from the allocators (%d cut-off spans ran), %d elsewhere (%d outside every fault)",
		f.Quota, f.PerRegion, f.Tokens, f.RegionWindows, f.Max, f.CutOff, f.CutOffSpans, f.Elsewhere, f.Calm)
}
