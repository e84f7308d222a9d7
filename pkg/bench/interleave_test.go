package bench

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// TestInterleaveAttributesEachSide: two targets of known cost (one sleeps
// 5 ms a call, the other 15 ms), run in alternate slices: each side counts
// only its own calls, its rate is its cost's, and the ratio comes out near
// 3 in total and slice by slice (loose bounds: a loaded machine's timers
// fire late).
func TestInterleaveAttributesEachSide(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a redis-server")
	}
	client := privateRedis(t)
	var calls [2]atomic.Int64
	target := func(side int, d time.Duration) Target {
		return func(ctx context.Context, w int, i uint64) error {
			calls[side].Add(1)
			select {
			case <-time.After(d):
				return nil
			case <-ctx.Done():
				return ctx.Err()
			}
		}
	}
	cfg := Config{Workers: 8, Requests: 1_000_000, Duration: 2 * time.Second, Warmup: 100 * time.Millisecond}
	iv := Interleaving{Slice: 100 * time.Millisecond, Guard: 10 * time.Millisecond}
	r, err := Interleave(context.Background(), client, cfg, iv, [2]string{"fast", "slow"},
		[2]Target{target(0, 5*time.Millisecond), target(1, 15*time.Millisecond)})
	if err != nil {
		t.Fatal(err)
	}
	if r.Pairs < 5 || len(r.PairRatios) < 5 || r.Errors != 0 {
		t.Fatalf("%d pairs, %d pair ratios, %d errors: want several pairs and no error\n%s", r.Pairs, len(r.PairRatios), r.Errors, r)
	}
	fast, slow := r.Sides[0], r.Sides[1]
	if fast.Name != "fast" || slow.Name != "slow" {
		t.Fatalf("sides %q, %q", fast.Name, slow.Name)
	}
	for i, s := range r.Sides {
		if s.Decisions <= 0 || s.Decisions > calls[i].Load() {
			t.Errorf("%s: %d decisions measured of %d made", s.Name, s.Decisions, calls[i].Load())
		}
		// Each side runs half the time, less the guards.
		if s.Elapsed < 600*time.Millisecond || s.Elapsed > time.Second {
			t.Errorf("%s: measured %s of a 2 s run", s.Name, s.Elapsed)
		}
	}
	// 8 workers at 5 ms a call make at most 1,600/s (timers run late, so
	// less); at 15 ms, a third of that.
	if fast.PerSecond > 1600 || fast.PerSecond < 400 {
		t.Errorf("fast side at %.0f/s, want at most 1,600/s and not far below", fast.PerSecond)
	}
	if ratio := fast.PerSecond / slow.PerSecond; ratio < 1.8 || ratio > 4 {
		t.Errorf("time per decision x%.2f, want about 3 (5 ms against 15 ms a call)\n%s", ratio, r)
	}
	for i, pr := range r.PairRatios {
		if pr < 1.2 || pr > 6 {
			t.Errorf("pair %d: x%.2f, want about 3", i, pr)
		}
	}
	if s := r.String(); !strings.Contains(s, "slow vs fast, interleaved over ") {
		t.Errorf("String() = %q", s)
	}
}

func TestInterleavingValidate(t *testing.T) {
	for _, bad := range []Interleaving{{Slice: time.Millisecond}, {Slice: 2 * time.Minute}, {Slice: time.Second, Guard: -1}, {Slice: time.Second, Guard: 600 * time.Millisecond}} {
		if err := bad.Validate(); err == nil {
			t.Errorf("%+v: no error", bad)
		}
	}
	if err := DefaultInterleaving.Validate(); err != nil {
		t.Error(err)
	}
}

// TestAdmissionSuiteInterleaved: the sdk13 mode decides 1 and 3 rules in
// turn without errors, and the summary compares them.
func TestAdmissionSuiteInterleaved(t *testing.T) {
	figs, out := runSmallSuite(t, func(cfg *SuiteConfig) {
		cfg.Modes = []string{"sdk13"}
		cfg.Requests, cfg.Duration = 1_000_000, 2*time.Second
		cfg.Interleave = Interleaving{Slice: 100 * time.Millisecond, Guard: 10 * time.Millisecond}
	})
	if len(figs) != 2 || figs[0].Name != interleaved1 || figs[1].Name != interleaved3 {
		t.Fatalf("figures %+v, want the two sides\n%s", figs, out)
	}
	for _, f := range figs {
		if f.Decisions == 0 || f.Errors != 0 || f.ScriptUsec <= 0 || f.ServerUsec <= 0 {
			t.Errorf("%s: %d decisions, %d errors, script %.2f us, server %.2f us\n%s", f.Name, f.Decisions, f.Errors, f.ScriptUsec, f.ServerUsec, out)
		}
	}
	// Three rules cost the script more than one.
	if figs[1].ScriptUsec <= figs[0].ScriptUsec {
		t.Errorf("script %.2f us for 3 rules, %.2f us for 1\n%s", figs[1].ScriptUsec, figs[0].ScriptUsec, out)
	}
	var sum strings.Builder
	Summarize(&sum, figs)
	if !strings.Contains(sum.String(), "3 rules vs 1 (interleaved): time per decision x") {
		t.Errorf("summary:\n%s", sum.String())
	}
}
