package check

import (
	"fmt"
	"testing"

	"github.com/allot-dev/allot/chaos/history"
)

var cedarFB = Quota{Name: "cedar", Limit: 100, WindowMs: 1000, Bound: 30, FallbackPerRegion: 10}

// fb is a fallback allowance region's agent journaled for window w: sent at
// call, returned at at, its store expiry bound deadline (Failed: at;
// Unknown: none), the agent's last Acquire attempt before it last.
func fb(region string, w, tokens, call, at, deadline int64, o history.Outcome, last *history.Attempt) history.Event {
	e := history.Event{Kind: history.KindFallback, Region: region, Quota: "cedar", GrantID: fmt.Sprintf("fb-%s-%d", region, w), Tokens: tokens,
		Window: w, Call: call, At: at, Deadline: deadline, Outcome: o, LeaderNowMs: call / ms, LastAcquire: last}
	switch o {
	case history.Failed:
		e.Deadline = at
	case history.Unknown:
		e.Deadline = 0
	}
	return e
}

// cut is an unanswered Acquire attempt ending at at: the agent is cut off.
func cut(at int64) *history.Attempt {
	return &history.Attempt{RequestID: "r-cut", At: at, Outcome: history.Unknown}
}

// fallbackCounts counts the violations of the fallback checks and of
// deposit_unknown.
func fallbackCounts(r *Result) string {
	return fmt.Sprintf("window %d, overlap %d, not cut off %d, unknown %d", r.Count(CheckFallbackWindow), r.Count(CheckFallbackOverlap),
		r.Count(CheckFallbackNotCutOff), r.Count(CheckDepositUnknown))
}

// TestFallbackJournal: every fallback allowance a region agent journaled
// lives in the store only inside its window by the true clock
// (fallback_outside_window), no region holds two windows' allowances at
// once (fallback_overlap), each was deposited while its agent counted
// itself cut off (fallback_not_cut_off), and one of unknown outcome is
// deposit_unknown unless a fault of the region's store covers it.
func TestFallbackJournal(t *testing.T) {
	ok, failed, unknown := history.OK, history.Failed, history.Unknown
	good := fb("eu", 10, 10, 10*sec+100*ms, 10*sec+105*ms, 10*sec+700*ms, ok, cut(10*sec+50*ms))
	next := fb("eu", 11, 10, 11*sec+100*ms, 11*sec+105*ms, 11*sec+700*ms, ok, cut(11*sec+50*ms))
	storeFault := history.Span{Scenario: "restart-store", Start: 12 * sec, End: 12*sec + 100*ms, Regions: []string{"eu"}, Store: true}
	tests := []struct {
		name   string
		events []history.Event
		spans  []history.Span
		quotas []Quota
		want   string
	}{
		{name: "two windows' allowances, each inside its window", events: []history.Event{good, next},
			want: "window 0, overlap 0, not cut off 0, unknown 0"},
		{name: "ending on the window's end", events: []history.Event{fb("eu", 10, 10, 10*sec, 10*sec+5*ms, 11*sec, ok, cut(10*sec-ms)), next},
			want: "window 0, overlap 0, not cut off 0, unknown 0"},
		{name: "spills into the next window", events: []history.Event{fb("eu", 10, 10, 10*sec+100*ms, 10*sec+105*ms, 11*sec+ms, ok, cut(10*sec+50*ms))},
			want: "window 1, overlap 0, not cut off 0, unknown 0"},
		{name: "a failed deposit withdrawn after the window's end", events: []history.Event{fb("eu", 10, 10, 10*sec+900*ms, 11*sec+200*ms, 0, failed, cut(10*sec+50*ms))},
			want: "window 1, overlap 0, not cut off 0, unknown 0"},
		{name: "sent before its window started (placed by a leader's clock estimate ahead)", events: []history.Event{fb("eu", 11, 10, 10*sec+950*ms, 10*sec+955*ms, 11*sec+500*ms, ok, cut(10*sec+900*ms))},
			want: "window 1, overlap 0, not cut off 0, unknown 0"},
		{name: "one that added nothing has no chunk to check", events: []history.Event{fb("eu", 10, 0, 10*sec+950*ms, 10*sec+955*ms, 11*sec+500*ms, ok, cut(10*sec+900*ms))},
			want: "window 0, overlap 0, not cut off 0, unknown 0"},
		{name: "window 10's chunk alive when window 11's is sent", events: []history.Event{
			fb("eu", 10, 10, 10*sec+100*ms, 10*sec+105*ms, 11*sec+200*ms, ok, cut(10*sec+50*ms)), next},
			want: "window 1, overlap 1, not cut off 0, unknown 0"},
		{name: "overlap of a quota the checks know no window of", quotas: []Quota{atlas}, events: []history.Event{
			fb("eu", 10, 10, 10*sec+100*ms, 10*sec+105*ms, 11*sec+200*ms, ok, cut(10*sec+50*ms)), next},
			want: "window 0, overlap 1, not cut off 0, unknown 0"},
		{name: "other regions' allowances may overlap", events: []history.Event{
			fb("us", 10, 10, 10*sec+100*ms, 10*sec+105*ms, 10*sec+700*ms, ok, cut(10*sec+50*ms)), good},
			want: "window 0, overlap 0, not cut off 0, unknown 0"},
		{name: "the last attempt before it was answered", events: []history.Event{
			fb("eu", 10, 10, 10*sec+100*ms, 10*sec+105*ms, 10*sec+700*ms, ok, &history.Attempt{RequestID: "r9", At: 10*sec + 90*ms, Outcome: history.OK})},
			want: "window 0, overlap 0, not cut off 1, unknown 0"},
		{name: "no attempt before it", events: []history.Event{fb("eu", 10, 0, 10*sec+100*ms, 10*sec+105*ms, 10*sec+700*ms, ok, nil)},
			want: "window 0, overlap 0, not cut off 1, unknown 0"},
		{name: "a failed one is held to being cut off too", events: []history.Event{
			fb("eu", 10, 10, 10*sec+100*ms, 10*sec+105*ms, 0, failed, &history.Attempt{RequestID: "r9", At: 10*sec + 90*ms, Outcome: history.OK})},
			want: "window 0, overlap 0, not cut off 1, unknown 0"},
		{name: "unknown outcome", events: []history.Event{fb("eu", 12, 10, 12*sec+200*ms, 12*sec+700*ms, 0, unknown, cut(12*sec+100*ms))},
			want: "window 0, overlap 0, not cut off 0, unknown 1"},
		{name: "unknown outcome in a fault of the region's store", events: []history.Event{fb("eu", 12, 10, 12*sec+200*ms, 12*sec+700*ms, 0, unknown, cut(12*sec+100*ms))},
			spans: []history.Span{storeFault}, want: "window 0, overlap 0, not cut off 0, unknown 0"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			qs := tt.quotas
			if qs == nil {
				qs = []Quota{cedarFB}
			}
			r := run(t, history.History{Events: tt.events, Spans: tt.spans}, qs...)
			if got := fallbackCounts(r); got != tt.want {
				t.Fatalf("%s, want %s: %v", got, tt.want, r.Violations)
			}
			if r.Fallbacks != len(tt.events) {
				t.Fatalf("%d fallbacks counted, want %d", r.Fallbacks, len(tt.events))
			}
		})
	}
}

// TestFallbackChunks: in a region whose agent journals its deposits, the
// admissions no grant covers are matched to the fallback allowances it
// journaled, each from its send until its store expiry bound (plus
// AnswerDelay), at most the tokens it added; beyond them, only the
// in-process share of a window a fault of the region's store touches, or
// of an admission the agent reported degraded (its engine's fail mode
// decided it), is excused, and never more than the per-window allowance
// in all. A region
// without a journal keeps the per-window accounting (TestFallbackAllowance).
func TestFallbackChunks(t *testing.T) {
	anon := func(region string, n, at int64) history.Event {
		return history.Event{Kind: history.KindAdmit, Region: region, Quota: "cedar", Tokens: n, At: at}
	}
	q := func(e history.Event) history.Event { e.Quota = "cedar"; return e }
	degraded := func(e history.Event) history.Event { e.Degraded = true; return e }
	g1 := q(acquire("eu", "r1", 60, 60, 10, 10*sec, 10*sec+50*ms, 10_400, "g1")) // expires at 10.4 s
	base := []history.Event{
		g1,
		q(deposit(g1, history.OK, 10*sec+51*ms, 10*sec+52*ms)), // the region's agent journals its deposits
		q(read(10, 11*sec, 11*sec+ms, 40, 60, 0, history.LedgerGrant{GrantID: "g1", Region: "eu", Tokens: 60})),
		anon("eu", 60, 10*sec+200*ms),
	}
	chunk := fb("eu", 10, 10, 10*sec+500*ms, 10*sec+505*ms, 10*sec+700*ms, history.OK, cut(10*sec+450*ms)) // live 10.5-10.7 s (+250 ms)
	storeFault := history.Span{Scenario: "restart-store", Start: 10*sec + 100*ms, End: 10*sec + 200*ms, Regions: []string{"eu"}, Store: true}
	tests := []struct {
		name     string
		events   []history.Event
		spans    []history.Span
		unleased int64
		fallback int64
	}{
		{name: "covered by the allowance's chunk", events: []history.Event{chunk, anon("eu", 10, 10*sec+600*ms)}, fallback: 10},
		{name: "answered within the answer delay of its expiry", events: []history.Event{chunk, anon("eu", 10, 10*sec+940*ms)}, fallback: 10},
		{name: "after its chunk expired (the per-window accounting let it pass)", events: []history.Event{chunk, anon("eu", 10, 10*sec+960*ms)},
			unleased: 10},
		{name: "before its chunk was sent", events: []history.Event{chunk, anon("eu", 4, 10*sec+450*ms), anon("eu", 6, 10*sec+600*ms)},
			unleased: 4, fallback: 6},
		{name: "beyond its tokens", events: []history.Event{chunk, anon("eu", 12, 10*sec+600*ms)}, unleased: 2, fallback: 10},
		{name: "no allowance journaled", events: []history.Event{anon("eu", 1, 10*sec+600*ms)}, unleased: 1},
		{name: "one that added nothing covers nothing", events: []history.Event{fb("eu", 10, 0, 10*sec+500*ms, 10*sec+505*ms, 10*sec+700*ms, history.OK, cut(10*sec+450*ms)),
			anon("eu", 1, 10*sec+600*ms)}, unleased: 1},
		{name: "a failed one covers until its return", events: []history.Event{fb("eu", 10, 10, 10*sec+500*ms, 10*sec+520*ms, 0, history.Failed, cut(10*sec+450*ms)),
			anon("eu", 5, 10*sec+600*ms), anon("eu", 5, 10*sec+800*ms)}, unleased: 5, fallback: 5},
		{name: "a store fault adds the in-process share", events: []history.Event{chunk, anon("eu", 20, 10*sec+600*ms), anon("eu", 5, 10*sec+980*ms)},
			spans: []history.Span{storeFault}, unleased: 5, fallback: 20},
		{name: "the in-process share alone", events: []history.Event{anon("eu", 12, 10*sec+300*ms)}, spans: []history.Span{storeFault}, unleased: 2, fallback: 10},
		{name: "the engine's fail mode, reported, adds the in-process share", events: []history.Event{degraded(anon("eu", 10, 10*sec+300*ms))},
			fallback: 10},
		{name: "the reported share is the in-process one only", events: []history.Event{degraded(anon("eu", 12, 10*sec+300*ms))},
			unleased: 2, fallback: 10},
		{name: "with the allowance's chunk", events: []history.Event{chunk, anon("eu", 10, 10*sec+600*ms), degraded(anon("eu", 12, 10*sec+800*ms))},
			unleased: 2, fallback: 20},
		{name: "a fault of the region's store adds no more to it", events: []history.Event{degraded(anon("eu", 12, 10*sec+300*ms))},
			spans: []history.Span{storeFault}, unleased: 2, fallback: 10},
		{name: "two allowances of one window", events: []history.Event{chunk, anon("eu", 10, 10*sec+600*ms),
			fb("eu", 10, 10, 10*sec+750*ms, 10*sec+755*ms, 10*sec+900*ms, history.OK, cut(10*sec+450*ms)), anon("eu", 10, 10*sec+800*ms)},
			unleased: 10, fallback: 20},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := run(t, history.History{Events: append(append([]history.Event(nil), base...), tt.events...), Spans: tt.spans}, cedarFB)
			var unleased int64
			for _, v := range r.Violations {
				switch v.Check {
				case CheckUnleased:
					var n int64
					fmt.Sscanf(v.Detail, "%d", &n)
					unleased += n
				case CheckBound:
				default:
					t.Errorf("unexpected violation %v", v)
				}
			}
			if unleased != tt.unleased || r.Count(CheckUnleased) > 0 != (tt.unleased > 0) {
				t.Fatalf("unleased tokens %d, want %d: %v", unleased, tt.unleased, r.Violations)
			}
			var got int64
			for _, w := range r.Windows["cedar"] {
				if rw := w.Regions["eu"]; rw != nil {
					got += rw.Fallback
				}
			}
			if got != tt.fallback {
				t.Fatalf("fallback admissions %d, want %d", got, tt.fallback)
			}
			var reported int
			for _, e := range tt.events {
				if e.Degraded {
					reported++
				}
			}
			if r.DegradedAdmissions != reported {
				t.Fatalf("%d admissions counted as a fail mode's, want %d", r.DegradedAdmissions, reported)
			}
		})
	}

	// A region without a journal (no deposit, no allowance journaled: a
	// driver, or an agent that journals nothing) keeps the per-window
	// allowance: the same late admission passes.
	h := history.History{Events: []history.Event{g1, base[2], base[3], anon("eu", 10, 10*sec+960*ms)}}
	if r := run(t, h, cedarFB); !r.OK() {
		t.Fatalf("a region without a journal: %v", r.Violations)
	}
}
