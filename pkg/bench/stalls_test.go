package bench

import (
	"context"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// clockOf returns a clock that reads the given times in turn, then keeps
// adding a microsecond.
func clockOf(readings ...time.Duration) func() time.Duration {
	i := 0
	return func() time.Duration {
		if i < len(readings) {
			i++
			return readings[i-1]
		}
		last := readings[len(readings)-1] + time.Duration(i-len(readings)+1)*time.Microsecond
		i++
		return last
	}
}

func TestSpinCountsGaps(t *testing.T) {
	us, ms := time.Microsecond, time.Millisecond
	// Gaps: 10 µs (no stall), 99 µs (no stall), 100 µs, 600 µs, 1.5 ms, 3 ms.
	clock := clockOf(0, 10*us, 109*us, 209*us, 809*us, 2309*us, 5309*us)
	c := spin(clock, 10*ms, func() bool { return false })
	want := []time.Duration{100 * us, 600 * us, 1500 * us, 3 * ms}
	if len(c.Gaps) != len(want) {
		t.Fatalf("gaps %v, want %v", c.Gaps, want)
	}
	for i := range want {
		if c.Gaps[i] != want[i] {
			t.Fatalf("gaps %v, want %v", c.Gaps, want)
		}
	}
	if got := [3]int{c.Over(500 * us), c.Over(ms), c.Over(2 * ms)}; got != [3]int{3, 2, 1} {
		t.Fatalf("over 0.5/1/2 ms: %v, want [3 2 1]", got)
	}
	// Past 1 ms: 0.5 ms of the 1.5 ms stall and 2 ms of the 3 ms one.
	if b := c.Beyond(ms); b != 2500*us {
		t.Fatalf("beyond 1 ms: %s, want 2.5ms", b)
	}
	if b := c.Beyond(2 * ms); b != ms {
		t.Fatalf("beyond 2 ms: %s, want 1ms", b)
	}
	if c.Max() != 3*ms {
		t.Fatalf("max %s, want 3ms", c.Max())
	}
	s := Stalls{Elapsed: 100 * ms, CPUs: []CPUStalls{c, {Gaps: []time.Duration{4 * ms}}}}
	// The second CPU's 4 ms stall leaves 2 ms past 2 ms: 2% of 100 ms.
	if got := s.ShareBeyond(2 * ms); got < 0.0199 || got > 0.0201 {
		t.Fatalf("share beyond 2 ms: %v, want 0.02 (the larger CPU's)", got)
	}
	if out := s.String(); !strings.Contains(out, "at least 2.00%") || strings.Count(out, "spinner") != 2 {
		t.Fatalf("report:\n%s", out)
	}
}

func TestSpinStopsWhenDone(t *testing.T) {
	calls := 0
	c := spin(clockOf(0), time.Hour, func() bool { calls++; return true })
	if calls != 1 || len(c.Gaps) != 0 {
		t.Fatalf("done asked %d times, gaps %v: want one check, then return", calls, c.Gaps)
	}
}

func TestGapsAreBounded(t *testing.T) {
	var c CPUStalls
	for range maxGaps + 3 {
		c.add(time.Millisecond)
	}
	if len(c.Gaps) != maxGaps || c.Missed != 3 {
		t.Fatalf("kept %d, missed %d; want %d and 3", len(c.Gaps), c.Missed, maxGaps)
	}
	if !strings.Contains(Stalls{Elapsed: time.Second, CPUs: []CPUStalls{c}}.String(), "3 more stalls not counted") {
		t.Fatal("the report hides the stalls it did not count")
	}
}

func TestMeasureStalls(t *testing.T) {
	procs := runtime.GOMAXPROCS(1)
	defer runtime.GOMAXPROCS(procs)
	s, err := MeasureStalls(context.Background(), 30*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	if len(s.CPUs) != runtime.NumCPU() || s.Elapsed < 30*time.Millisecond {
		t.Fatalf("%d spinners for %s; want %d for at least 30ms", len(s.CPUs), s.Elapsed, runtime.NumCPU())
	}
	if got := runtime.GOMAXPROCS(0); got != 1 {
		t.Fatalf("GOMAXPROCS %d after the run, want it put back to 1", got)
	}
	if _, err := MeasureStalls(context.Background(), 0); err == nil {
		t.Fatal("a zero duration was accepted")
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	start := time.Now()
	if _, err := MeasureStalls(ctx, time.Hour); err == nil || time.Since(start) > 10*time.Second {
		t.Fatalf("an ended context: error %v after %s; want its error at once", err, time.Since(start))
	}
}

func TestRunCountsSlowCallsByWindow(t *testing.T) {
	// Four workers whose first calls take 100 ms, together (a stall), and
	// whose other calls take 0.2 ms (sleeping: busy workers would be
	// preempted mid-call; even a loaded machine does not stretch these
	// past 80 ms).
	r, err := Run(context.Background(), Config{Workers: 4, Requests: 1 << 40, Duration: 400 * time.Millisecond, SlowOver: 80 * time.Millisecond},
		func(ctx context.Context, w int, i uint64) error {
			if i == 0 {
				time.Sleep(100 * time.Millisecond)
			} else {
				time.Sleep(200 * time.Microsecond)
			}
			return nil
		})
	if err != nil {
		t.Fatal(err)
	}
	s := r.Slow
	if s.Calls != 4 || s.Windows < 1 || s.Windows > 2 || s.Busiest < 2 || s.Spanned < 39 {
		t.Fatalf("slow calls %+v: want 4, in one or two of ~40 windows", s)
	}
	if !strings.Contains(s.String(), "calls of 80ms and more: 4,") {
		t.Fatalf("report %q", s)
	}
	if (SlowCalls{}).String() != "" {
		t.Fatal("a run without SlowOver reports slow calls")
	}
}

func TestCountSlowPlacesGCCycles(t *testing.T) {
	from := time.Unix(1000, 0)
	slow := make([]atomic.Int32, 12)
	for w, n := range map[int]int32{0: 1, 3: 2, 5: 4, 9: 8} {
		slow[w].Store(n)
	}
	at := func(d time.Duration) uint64 { return uint64(from.Add(d).UnixNano()) }
	ends := []uint64{
		at(42 * time.Millisecond),  // window 4: next to 3 and 5
		at(115 * time.Millisecond), // window 11: next to 10 (empty)
		at(-time.Millisecond),      // before the measured time
		at(time.Second),            // after it
	}
	s := countSlow(slow, from, 12, 2*time.Millisecond, ends)
	want := SlowCalls{Over: 2 * time.Millisecond, Calls: 15, Windows: 4, Spanned: 12, Busiest: 8, NearGC: 6, GCs: 2}
	if s != want {
		t.Fatalf("got %+v, want %+v", s, want)
	}
	if got := countSlow(slow, from, 12, 2*time.Millisecond, nil); got.NearGC != 0 || got.GCs != 0 || got.Calls != 15 {
		t.Fatalf("without cycles: %+v", got)
	}
}
