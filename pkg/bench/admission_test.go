package bench

import (
	"context"
	"fmt"
	"regexp"
	"runtime"
	"strings"
	"testing"
	"time"
)

// TestAdmissionSuiteModes runs every admission mode briefly on a private
// redis-server: each decides without errors, the paced modes run at the
// rate derived from the sdk mode, and the summary attributes each figure
// (the paced raw control is not taken for the raw ceiling).
func TestAdmissionSuiteModes(t *testing.T) {
	figs, out := runSmallSuite(t, func(*SuiteConfig) {})
	if len(figs) != len(Modes()) {
		t.Fatalf("want %d figures, got %d\n%s", len(Modes()), len(figs), out)
	}
	var sdk, paced, pacedRaw, raw, stalls Figure
	for _, f := range figs {
		if f.Stalls != nil {
			stalls = f
			continue
		}
		if f.Calls == 0 || f.Errors != 0 {
			t.Errorf("%s: %d calls, %d errors; want calls and no errors\n%s", f.Name, f.Calls, f.Errors, out)
		}
		if f.ScriptUsec <= 0 {
			t.Errorf("%s: script CPU %v per call, want it measured", f.Name, f.ScriptUsec)
		}
		switch {
		case f.Name == "(b) sdk, 1 rule":
			sdk = f
		case strings.HasPrefix(f.Name, "(b) sdk paced at "):
			paced = f
		case strings.HasPrefix(f.Name, "(a) raw paced at "):
			pacedRaw = f
		case strings.HasPrefix(f.Name, "(a) raw"):
			raw = f
		}
	}
	if paced.Calls == 0 || pacedRaw.Calls == 0 || raw.Calls == 0 {
		t.Fatalf("paced %q and control %q: want both\n%s", paced.Name, pacedRaw.Name, out)
	}
	if stalls.Stalls == nil || len(stalls.Stalls.CPUs) != runtime.NumCPU() || stalls.Stalls.Elapsed <= 0 {
		t.Fatalf("the stalls mode's figure %+v: want one spinner per CPU\n%s", stalls, out)
	}
	for _, f := range []Figure{paced, pacedRaw} {
		if f.Slow.Over != PacedTarget || f.Slow.Spanned == 0 {
			t.Errorf("%s: slow calls %+v, want them counted over %s", f.Name, f.Slow, PacedTarget)
		}
	}
	// Both paced modes run at half of the sdk mode's rate.
	half := sdk.PerSecond / 2
	for _, f := range []Figure{paced, pacedRaw} {
		if want := fmt.Sprintf(" at %.0f/s", half); !strings.HasSuffix(f.Name, want) {
			t.Errorf("%q: want the rate%s (half of %.0f/s)", f.Name, want, sdk.PerSecond)
		}
		if f.Arrival.P50 <= 0 {
			t.Errorf("%s: no arrival latencies recorded", f.Name)
		}
		if f.Fraction != 0.5 {
			t.Errorf("%s: fraction %v, want 0.5", f.Name, f.Fraction)
		}
	}
	var sum strings.Builder
	Summarize(&sum, figs)
	for _, want := range []string{
		fmt.Sprintf("(b)/(a) throughput: %.2f", sdk.PerSecond/raw.PerSecond),
		"cpu of this process and the server x",
		"paced p99: ",
		"paced calls of 2ms and more: ",
		"this machine with its ",
		"the same load without the SDK",
	} {
		if !strings.Contains(sum.String(), want) {
			t.Errorf("summary lacks %q:\n%s", want, sum.String())
		}
	}
}

// TestAdmissionSuiteSweep: with fractions, the paced modes run once per
// fraction of the sdk mode's rate, the SDK and the control side by side,
// and the summary prints them by rate.
func TestAdmissionSuiteSweep(t *testing.T) {
	figs, _ := runSmallSuite(t, func(cfg *SuiteConfig) {
		cfg.Modes = []string{"paced", "sdk", "paced-raw"} // the paced modes wait for sdk
		cfg.Sweep = []float64{0.1, 0.3}
		cfg.Requests, cfg.Duration = 1000, 2*time.Second
	})
	var names []string
	for _, f := range figs {
		names = append(names, f.Name)
	}
	if len(figs) != 5 || figs[0].Name != "(b) sdk, 1 rule" {
		t.Fatalf("figures %q: want sdk, then paced and paced-raw at each of 2 fractions", names)
	}
	sdk := figs[0].PerSecond
	for i, want := range []struct {
		prefix string
		f      float64
	}{{"(b) sdk paced at ", 0.1}, {"(a) raw paced at ", 0.1}, {"(b) sdk paced at ", 0.3}, {"(a) raw paced at ", 0.3}} {
		f := figs[1+i]
		if name := fmt.Sprintf("%s%.0f/s", want.prefix, sdk*want.f); f.Name != name || f.Rate != sdk*want.f || f.Fraction != want.f {
			t.Errorf("step %d: %q at %.0f/s (fraction %v), want %q", i, f.Name, f.Rate, f.Fraction, name)
		}
	}
	var sum strings.Builder
	Summarize(&sum, figs)
	for _, f := range []float64{0.1, 0.3} {
		if row := regexp.MustCompile(fmt.Sprintf(`(?m)^\s*%.0f  `, sdk*f)); !row.MatchString(sum.String()) {
			t.Errorf("summary lacks the row of %.0f/s:\n%s", sdk*f, sum.String())
		}
	}
	if strings.Contains(sum.String(), "paced p99:") {
		t.Errorf("a sweep's summary quotes one paced p99:\n%s", sum.String())
	}
}

// runSmallSuite runs the admission suite briefly (8 workers, 200 keys) on a
// private redis-server, with edit's changes to the config, and returns its
// figures and what it printed.
func runSmallSuite(t *testing.T, edit func(*SuiteConfig)) ([]Figure, string) {
	t.Helper()
	if testing.Short() {
		t.Skip("starts a redis-server")
	}
	client := privateRedis(t)
	cfg := DefaultSuiteConfig()
	cfg.Workers, cfg.Keys, cfg.Requests = 8, 200, 2000
	cfg.Duration, cfg.Warmup = 3*time.Second, 50*time.Millisecond
	edit(&cfg)
	var out strings.Builder
	figs, err := RunSuite(context.Background(), client, cfg, &out)
	if err != nil {
		t.Fatal(err)
	}
	return figs, out.String()
}

// TestAdmissionSuitePaced3: paced3 decides 3 rules at the paced mode's
// rate, and the summary compares the two at that rate.
func TestAdmissionSuitePaced3(t *testing.T) {
	figs, out := runSmallSuite(t, func(cfg *SuiteConfig) {
		cfg.Modes = []string{"sdk", "paced", "paced3"}
		cfg.Requests, cfg.Duration = 1000, 2*time.Second
	})
	if len(figs) != 3 {
		t.Fatalf("%d figures, want 3\n%s", len(figs), out)
	}
	paced, paced3 := figs[1], figs[2]
	if want := fmt.Sprintf("(b) sdk, 3 rules, paced at %.0f/s", paced.Rate); paced3.Name != want || paced3.Rate != paced.Rate {
		t.Errorf("paced3 is %q at %v/s; want %q", paced3.Name, paced3.Rate, want)
	}
	if paced3.Calls == 0 || paced3.Errors != 0 {
		t.Errorf("paced3: %d calls, %d errors", paced3.Calls, paced3.Errors)
	}
	var sum strings.Builder
	Summarize(&sum, figs)
	if want := fmt.Sprintf("3 rules vs 1 at %.0f/s: p50 ", paced.Rate); !strings.Contains(sum.String(), want) {
		t.Errorf("summary lacks %q:\n%s", want, sum.String())
	}
}
