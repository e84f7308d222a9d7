package bench

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"
)

// TestAdmissionSuiteModes runs every admission mode briefly on a private
// redis-server: each decides without errors, the paced modes run at the
// rate derived from the sdk mode, and the summary attributes each figure
// (the paced raw control is not taken for the raw ceiling).
func TestAdmissionSuiteModes(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a redis-server")
	}
	client := privateRedis(t)
	cfg := DefaultSuiteConfig()
	cfg.Workers, cfg.Keys, cfg.Requests = 8, 200, 2000
	cfg.Duration, cfg.Warmup = 3*time.Second, 50*time.Millisecond
	var out strings.Builder
	figs, err := RunSuite(context.Background(), client, cfg, &out)
	if err != nil {
		t.Fatal(err)
	}
	if len(figs) != len(Modes()) {
		t.Fatalf("want %d figures, got %d\n%s", len(Modes()), len(figs), out.String())
	}
	var sdk, paced, pacedRaw, raw Figure
	for _, f := range figs {
		if f.Calls == 0 || f.Errors != 0 {
			t.Errorf("%s: %d calls, %d errors; want calls and no errors\n%s", f.Name, f.Calls, f.Errors, out.String())
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
		t.Fatalf("paced %q and control %q: want both\n%s", paced.Name, pacedRaw.Name, out.String())
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
	}
	var sum strings.Builder
	Summarize(&sum, figs)
	for _, want := range []string{
		fmt.Sprintf("(b)/(a) throughput: %.2f", sdk.PerSecond/raw.PerSecond),
		"cpu of this process and the server x",
		"paced p99: ",
		"the same load without the SDK",
	} {
		if !strings.Contains(sum.String(), want) {
			t.Errorf("summary lacks %q:\n%s", want, sum.String())
		}
	}
}
