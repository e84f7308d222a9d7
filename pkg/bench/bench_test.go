package bench

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

func TestRunBoundedByCount(t *testing.T) {
	var n atomic.Int64
	r, err := Run(context.Background(), Config{Name: "count", Workers: 8, Requests: 1000, Duration: time.Minute},
		func(ctx context.Context, w int, i uint64) error {
			n.Add(1)
			return nil
		})
	if err != nil {
		t.Fatal(err)
	}
	if n.Load() != 1000 || r.Calls != 1000 || r.Decisions != 1000 || r.Errors != 0 {
		t.Fatalf("calls %d, result %+v; want exactly 1000", n.Load(), r)
	}
	if r.P50 > r.P99 || r.P99 > r.Max || !strings.Contains(r.String(), "count") {
		t.Fatalf("percentiles out of order: %s", r)
	}
}

func TestRunBoundedByTime(t *testing.T) {
	r, err := Run(context.Background(), Config{Workers: 2, Requests: 1 << 40, Duration: 50 * time.Millisecond, OpsPerCall: 16},
		func(ctx context.Context, w int, i uint64) error {
			select {
			case <-time.After(time.Millisecond):
			case <-ctx.Done():
			}
			return nil
		})
	if err != nil {
		t.Fatal(err)
	}
	if r.Calls == 0 || r.Calls > 200 || r.Decisions != 16*r.Calls {
		t.Fatalf("result %+v: want a short run bounded by its duration", r)
	}
}

func TestRunPacedAndErrors(t *testing.T) {
	boom := errors.New("boom")
	r, err := Run(context.Background(), Config{Workers: 4, Requests: 40, Duration: 10 * time.Second, Rate: 400},
		func(ctx context.Context, w int, i uint64) error {
			if i == 0 && w == 0 {
				return boom
			}
			return nil
		})
	if err != nil {
		t.Fatal(err)
	}
	// 40 calls at 400/s take about 0.1 s; open loop cannot go faster. The
	// failed call is no decision.
	if r.Calls != 39 || r.Errors != 1 || !errors.Is(r.FirstErr, boom) || r.PerSecond > 800 {
		t.Fatalf("result %+v", r)
	}
}

// TestPacedArrivalKeepsStalls: latencies from arrival leave out the
// generator's timer lateness but still count every call queued behind a
// stall from its scheduled start (no coordinated omission).
func TestPacedArrivalKeepsStalls(t *testing.T) {
	const stall = 30 * time.Millisecond
	r, err := Run(context.Background(), Config{Workers: 1, Requests: 100, Duration: 10 * time.Second, Rate: 500},
		func(ctx context.Context, w int, i uint64) error {
			if i == 20 {
				time.Sleep(stall) // the 14 calls due meanwhile queue behind it
			}
			return nil
		})
	if err != nil {
		t.Fatal(err)
	}
	if r.Calls != 100 {
		t.Fatalf("%d calls, want 100", r.Calls)
	}
	if r.Arrival.Max < stall || r.Arrival.P90 < 5*time.Millisecond {
		t.Fatalf("from arrival %+v: the calls queued behind the %s stall must count their wait", r.Arrival, stall)
	}
	if r.Arrival.P50 > r.P50 || r.Arrival.P99 > r.P99 || r.Arrival.Max > r.Max {
		t.Fatalf("from arrival %+v exceeds from the scheduled start %+v", r.Arrival, r)
	}
	if r.Lag.P50 <= 0 || r.Lag.P50 > r.P50 {
		t.Fatalf("timer lag %+v: want the sleeping calls' lateness, within their latency (p50 %s)", r.Lag, r.P50)
	}
	if !strings.Contains(r.ArrivalLine(), "from arrival") {
		t.Fatalf("arrival line %q", r.ArrivalLine())
	}
}

func TestConfigValidate(t *testing.T) {
	tests := []struct {
		name string
		give Config
		want string
	}{
		{"no workers", Config{Requests: 1, Duration: time.Second}, "Workers"},
		{"unbounded count", Config{Workers: 1, Duration: time.Second}, "Requests"},
		{"unbounded time", Config{Workers: 1, Requests: 1}, "Duration"},
		{"warmup", Config{Workers: 1, Requests: 1, Duration: time.Second, Warmup: time.Minute}, "Warmup"},
		{"rate", Config{Workers: 1, Requests: 1, Duration: time.Second, Rate: -1}, "Rate"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := tt.give.Validate(); err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Validate = %v, want an error naming %s", err, tt.want)
			}
		})
	}
}

func TestHistogram(t *testing.T) {
	var h histogram
	for v := int64(1); v <= 1_000_000; v++ {
		h.record(time.Duration(v))
	}
	for _, tc := range []struct {
		q    float64
		want int64
	}{{0.5, 500_000}, {0.99, 990_000}, {1, 1_000_000}} {
		got := int64(h.quantile(tc.q))
		if got < tc.want || float64(got) > float64(tc.want)*1.04 {
			t.Errorf("quantile(%v) = %d, want within 4%% above %d", tc.q, got, tc.want)
		}
	}
	for i := 0; i < len(h.counts)-1; i++ {
		if bucketOf(upper(i)) != i || bucketOf(upper(i)+1) != i+1 {
			t.Fatalf("bucket %d: upper %d maps to %d, next to %d", i, upper(i), bucketOf(upper(i)), bucketOf(upper(i)+1))
		}
	}
}

// TestSummarizeAgentBrackets: each mode is compared with the (a)s measured
// next to it, their mean when there are two.
func TestSummarizeAgentBrackets(t *testing.T) {
	fig := func(name string, rate float64) Figure {
		return Figure{Result: Result{Name: name, PerSecond: rate}}
	}
	if got, want := Bracket([]string{"raw", "connect-lean", "envoy"}), []string{"raw", "connect-lean", "raw", "envoy", "raw"}; !slices.Equal(got, want) {
		t.Fatalf("Bracket: %v, want %v", got, want)
	}
	var out strings.Builder
	SummarizeAgent(&out, []Figure{
		fig("(a) raw", 100), fig("(cl) lean", 52.5), fig("(a) raw", 110), fig("(d) envoy", 44), fig("(a) raw", 90),
		fig("(dl) envoy lean", 45),
	})
	for _, want := range []string{
		"(cl) lean / (a): 0.50 (target >= 0.5; (a) 100/s before, 110/s after: 10% apart)",
		"(d) envoy / (a): 0.44 (target >= 0.5; (a) 110/s before, 90/s after: 20% apart)",
		"(dl) envoy lean / (a): 0.50 (target >= 0.5)\n",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("summary lacks %q:\n%s", want, out.String())
		}
	}
}

// TestSummarizeRulePairs: repeated 1-rule and 3-rule runs are compared pair
// by pair, in the order they ran, and the median of each ratio is printed.
func TestSummarizeRulePairs(t *testing.T) {
	fig := func(name string, rate, script, server, process float64) Figure {
		return Figure{Result: Result{Name: name, PerSecond: rate}, ScriptUsec: script, ServerUsec: server, ProcessUsec: process}
	}
	var out strings.Builder
	Summarize(&out, []Figure{
		fig("(b) sdk, 1 rule", 100, 8, 10, 6), fig("(b) sdk, 3 rules", 70, 12, 14, 7),
		fig("(b) sdk, 1 rule", 60, 12, 16, 8), fig("(b) sdk, 3 rules", 50, 16, 20, 8),
		fig("(b) sdk, 1 rule", 100, 8, 10, 6), fig("(b) sdk, 3 rules", 62.5, 13, 15, 9),
	})
	for _, want := range []string{
		"3 rules vs 1, pair 1: time per decision x1.43, script cpu x1.50, server cpu x1.40, cpu of this process and the server x1.31",
		"3 rules vs 1, pair 2: time per decision x1.20, script cpu x1.33, server cpu x1.25, cpu of this process and the server x1.17",
		"3 rules vs 1, pair 3: time per decision x1.60, script cpu x1.62, server cpu x1.50, cpu of this process and the server x1.50",
		"3 rules vs 1, median of 3 pairs: time per decision x1.43, script cpu x1.50, server cpu x1.40, cpu of this process and the server x1.31",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("summary lacks %q:\n%s", want, out.String())
		}
	}
	if got := median([]float64{4, 1, 3, 2}); got != 2.5 {
		t.Errorf("median of 1..4 = %v, want 2.5", got)
	}
}

// TestSummarizePacedRuns: paced runs repeated at half of the sdk rate before
// each are counted against the target; a sweep's other fractions, a run at
// a set -rate and a run without calls are not.
func TestSummarizePacedRuns(t *testing.T) {
	paced := func(rate float64, fraction float64, p99 time.Duration, calls int64) Figure {
		return Figure{Result: Result{Name: fmt.Sprintf("(b) sdk paced at %.0f/s", rate), P99: p99, Calls: calls}, Rate: rate, Fraction: fraction}
	}
	var out strings.Builder
	Summarize(&out, []Figure{
		paced(50000, 0.5, 1500*time.Microsecond, 100),
		paced(25000, 0.25, 9*time.Millisecond, 100), // a sweep's other fraction
		paced(48000, 0.5, 2*time.Millisecond, 100),  // at the target: not under it
		paced(45000, 0, 1*time.Millisecond, 100),    // -rate set
		paced(47000, 0.5, 3*time.Millisecond, 0),    // no call measured
		paced(52000, 0.5, 1100*time.Microsecond, 100),
	})
	want := "paced p99 at half of the sdk rate before it: under 2ms in 2 of 3 runs (1.5ms, 2ms, 1.1ms; median 1.5ms)"
	if !strings.Contains(out.String(), want) {
		t.Errorf("summary lacks %q:\n%s", want, out.String())
	}
	out.Reset()
	Summarize(&out, []Figure{paced(50000, 0.5, time.Millisecond, 100), paced(25000, 0.25, time.Millisecond, 100)})
	if strings.Contains(out.String(), "runs (") {
		t.Errorf("one run at half the rate is no count of runs:\n%s", out.String())
	}
}
