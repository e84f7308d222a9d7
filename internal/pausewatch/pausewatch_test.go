package pausewatch

import (
	"context"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
)

// observed records what a histogram was given.
type observed []float64

func (o *observed) Observe(v float64) { *o = append(*o, v) }

// script runs the watcher on a fake clock whose sleeps take the given
// lengths, one per wake-up, and returns the pauses it reported.
func script(t *testing.T, cfg Config, sleeps []time.Duration) ([]Pause, observed) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	clock := time.Unix(1_700_000_000, 0)
	i := 0
	cfg.now = func() time.Time { return clock }
	var cpu time.Duration
	var gcs uint64
	cfg.usage = func() (time.Duration, uint64) { return cpu, gcs }
	cfg.sleep = func(time.Duration) {
		clock = clock.Add(sleeps[i])
		// The process runs a tenth of each stretch and collects once in
		// each one longer than a second.
		cpu += sleeps[i] / 10
		if sleeps[i] > time.Second {
			gcs++
		}
		i++
		if i == len(sleeps) {
			cancel()
		}
	}
	var got []Pause
	cfg.OnPause = func(p Pause) { got = append(got, p) }
	var h observed
	cfg.Histogram = &h
	if err := Run(ctx, cfg); err != nil {
		t.Fatal(err)
	}
	return got, h
}

func TestPausesAboveThresholdAreReported(t *testing.T) {
	iv := 100 * time.Millisecond
	sleeps := []time.Duration{iv, iv + 20*time.Millisecond, iv + 2*time.Second, iv, iv + 499*time.Millisecond, iv + 500*time.Millisecond, iv}
	got, h := script(t, Config{Interval: iv}, sleeps)
	want := []time.Duration{2 * time.Second, 500 * time.Millisecond}
	if len(got) != len(want) {
		t.Fatalf("pauses %v, want lengths %v", got, want)
	}
	for i, p := range got {
		if p.Length != want[i] {
			t.Errorf("pause %d: length %s, want %s", i, p.Length, want[i])
		}
		if wantCPU := (want[i] + iv) / 10; p.CPU != wantCPU {
			t.Errorf("pause %d: cpu %s, want %s", i, p.CPU, wantCPU)
		}
	}
	if got[0].GCs != 1 || got[1].GCs != 0 {
		t.Errorf("GCs in the pauses: %d and %d, want 1 and 0", got[0].GCs, got[1].GCs)
	}
	// The first pause ended after the first three wake-ups.
	end := time.Unix(1_700_000_000, 0).Add(3*iv + 20*time.Millisecond + 2*time.Second)
	if !got[0].End.Equal(end) {
		t.Errorf("first pause ended at %v, want %v", got[0].End, end)
	}
	if len(h) != 2 || h[0] != 2 || h[1] != 0.5 {
		t.Errorf("histogram observed %v, want [2 0.5] (seconds)", h)
	}
}

// TestProcessUsage: the CPU time read grows with work the process does, and
// the GC count with a collection.
func TestProcessUsage(t *testing.T) {
	cpu0, gc0 := processUsage()
	deadline := time.Now().Add(50 * time.Millisecond)
	x := 0
	for time.Now().Before(deadline) {
		x++
	}
	runtime.GC()
	cpu1, gc1 := processUsage()
	if cpu1 <= cpu0 {
		t.Errorf("cpu %s then %s after 50 ms of work (%d loops)", cpu0, cpu1, x)
	}
	if gc1 <= gc0 {
		t.Errorf("gc count %d then %d across runtime.GC", gc0, gc1)
	}
}

func TestNewHistogram(t *testing.T) {
	h := NewHistogram("allot_test_process_pause_seconds")
	h.Observe(1.5)
	if err := testutil.CollectAndCompare(h, strings.NewReader(`
# HELP allot_test_process_pause_seconds Stretches in which this process did not run (a wake-up late by at least the pause threshold), by length.
# TYPE allot_test_process_pause_seconds histogram
allot_test_process_pause_seconds_bucket{le="0.5"} 0
allot_test_process_pause_seconds_bucket{le="1"} 0
allot_test_process_pause_seconds_bucket{le="2"} 1
allot_test_process_pause_seconds_bucket{le="5"} 1
allot_test_process_pause_seconds_bucket{le="10"} 1
allot_test_process_pause_seconds_bucket{le="30"} 1
allot_test_process_pause_seconds_bucket{le="60"} 1
allot_test_process_pause_seconds_bucket{le="+Inf"} 1
allot_test_process_pause_seconds_sum 1.5
allot_test_process_pause_seconds_count 1
`)); err != nil {
		t.Fatal(err)
	}
}

func TestThresholdIsConfigurable(t *testing.T) {
	iv := 50 * time.Millisecond
	got, _ := script(t, Config{Interval: iv, Threshold: 100 * time.Millisecond}, []time.Duration{iv + 150*time.Millisecond, iv + 60*time.Millisecond})
	if len(got) != 1 || got[0].Length != 150*time.Millisecond {
		t.Fatalf("pauses %v, want one of 150ms", got)
	}
}

// TestRealClock runs the watcher as processes do, on the real clock, for a
// few intervals: it stops with its context and reports no pause of a
// process that keeps running (the threshold is far above a busy machine's
// scheduling delay).
func TestRealClock(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	var got []Pause
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, Config{Interval: 10 * time.Millisecond, Threshold: 10 * time.Second, OnPause: func(p Pause) { got = append(got, p) }})
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after its context ended")
	}
	if len(got) != 0 {
		t.Fatalf("pauses %v on a running process", got)
	}
}
