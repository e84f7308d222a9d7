package bench

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"time"
)

// Stalls is what MeasureStalls saw: how often, and for how long, threads
// that never block stopped running. A thread that spins on the clock sees
// every moment the machine took its CPU away (another task, an interrupt,
// the hypervisor running something else) as a gap between two readings, as
// jHiccup measures a JVM's. One spinner per CPU keeps every CPU busy, as
// the paced benchmark keeps both of a 2-CPU machine's (Redis on one, the
// client on the other), so the gaps are the stalls a busy process there
// suffers whatever it runs. A decision in flight during a stall of its
// client's or its Redis's CPU waits at least that long: on a machine whose
// busy CPUs spend 1% of their time in stalls of a millisecond and more, no
// client keeps its p99 under a millisecond.
type Stalls struct {
	// Elapsed is how long the spinners ran.
	Elapsed time.Duration
	// CPUs holds each spinner's stalls.
	CPUs []CPUStalls
}

// CPUStalls is one spinner's stalls: the gaps of at least stallFloor
// between two of its clock readings, in the order they came.
type CPUStalls struct {
	Gaps []time.Duration
	// Missed counts the stalls not kept in Gaps, which holds at most
	// maxGaps (a machine that stalls that often needs no statistics).
	Missed int
}

// stallFloor is the shortest gap counted as a stall: far above a clock
// reading (tens of ns) and a timer interrupt's handling (a few µs).
const stallFloor = 100 * time.Microsecond

// maxGaps bounds CPUStalls.Gaps (8 MB).
const maxGaps = 1 << 20

// add counts a gap between two readings.
func (c *CPUStalls) add(gap time.Duration) {
	switch {
	case gap < stallFloor:
	case len(c.Gaps) < maxGaps:
		c.Gaps = append(c.Gaps, gap)
	default:
		c.Missed++
	}
}

// Over counts the stalls of at least d.
func (c CPUStalls) Over(d time.Duration) int {
	n := 0
	for _, g := range c.Gaps {
		if g >= d {
			n++
		}
	}
	return n
}

// Beyond is the time in which the CPU was to stay stalled for d or more:
// the sum of each stall's length past d. A call that needs the CPU and
// arrives in that time waits at least d, so Beyond(d) over the elapsed time
// is a floor on the share of evenly paced calls that take d or more.
func (c CPUStalls) Beyond(d time.Duration) time.Duration {
	var t time.Duration
	for _, g := range c.Gaps {
		t += max(g-d, 0)
	}
	return t
}

// Max is the longest stall.
func (c CPUStalls) Max() time.Duration {
	var m time.Duration
	for _, g := range c.Gaps {
		m = max(m, g)
	}
	return m
}

// spin reads now until it returns at least d, counting the gaps between
// consecutive readings, and checks done every 4096 readings.
func spin(now func() time.Duration, d time.Duration, done func() bool) CPUStalls {
	var c CPUStalls
	last := now()
	end := last + d
	for i := 1; ; i++ {
		t := now()
		c.add(t - last)
		last = t
		if t >= end || (i%4096 == 0 && done()) {
			return c
		}
	}
}

// MeasureStalls runs one spinner per CPU on a thread of its own for d (or
// until ctx ends) and returns their stalls. It raises GOMAXPROCS to the
// number of CPUs while it runs, so that no spinner waits for another's
// processor, and puts it back after.
func MeasureStalls(ctx context.Context, d time.Duration) (Stalls, error) {
	if d <= 0 {
		return Stalls{}, errors.New("bench: stalls: the duration must be positive")
	}
	n := runtime.NumCPU()
	defer runtime.GOMAXPROCS(runtime.GOMAXPROCS(max(n, runtime.GOMAXPROCS(0))))
	base := time.Now()
	now := func() time.Duration { return time.Since(base) } // monotonic
	done := func() bool { return ctx.Err() != nil }
	out := make(chan CPUStalls, n)
	for range n {
		go func() {
			runtime.LockOSThread()
			defer runtime.UnlockOSThread()
			out <- spin(now, d, done)
		}()
	}
	s := Stalls{CPUs: make([]CPUStalls, 0, n)}
	for range n {
		s.CPUs = append(s.CPUs, <-out)
	}
	s.Elapsed = time.Since(base)
	return s, ctx.Err()
}

// ShareBeyond is the largest share, over the CPUs, of the time in which a
// CPU was to stay stalled for d or more (CPUStalls.Beyond): a floor on the
// share of a paced run's calls that take d or more on this machine, when
// every call needs each CPU (a client on one, its Redis on the other).
func (s Stalls) ShareBeyond(d time.Duration) float64 {
	if s.Elapsed <= 0 {
		return 0
	}
	var most time.Duration
	for _, c := range s.CPUs {
		most = max(most, c.Beyond(d))
	}
	return float64(most) / float64(s.Elapsed)
}

// String formats the stalls on one line per CPU after a summary line.
func (s Stalls) String() string {
	var b strings.Builder
	secs := s.Elapsed.Seconds()
	share := func(t time.Duration) float64 { return 100 * float64(t) / float64(s.Elapsed) }
	per := func(n int) float64 {
		if secs <= 0 {
			return 0
		}
		return float64(n) / secs
	}
	fmt.Fprintf(&b, "%-28s %d CPUs busy for %s; calls delayed %s or more by stalls alone: at least %.2f%%",
		stallsName, len(s.CPUs), round(s.Elapsed), PacedTarget, 100*s.ShareBeyond(PacedTarget))
	for i, c := range s.CPUs {
		fmt.Fprintf(&b, "\n%-28s spinner %d: stalls >= 0.5 ms %.1f/s, >= 1 ms %.1f/s, >= 2 ms %.1f/s, max %s; stalled 1 ms or more ahead %.2f%% of the time, %s or more %.2f%%",
			"", i, per(c.Over(500*time.Microsecond)), per(c.Over(time.Millisecond)), per(c.Over(2*time.Millisecond)), round(c.Max()),
			share(c.Beyond(time.Millisecond)), PacedTarget, share(c.Beyond(PacedTarget)))
		if c.Missed > 0 {
			fmt.Fprintf(&b, " (%d more stalls not counted)", c.Missed)
		}
	}
	return b.String()
}
