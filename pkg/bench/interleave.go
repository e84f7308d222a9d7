package bench

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
)

// Interleaving compares two targets in one run: time is cut into slices,
// and slice k runs target k%2 on every worker. Runs one after the other
// (-mode sdk,sdk3) meet the machine in different states: on a shared VM
// the same decision's Redis CPU moved by 60% within a minute (2026-12-05),
// more than the 3-rule target's margin. Slices of a fraction of a second,
// alternating, meet the same states in turn, so the ratio of their sums is
// steadier than a ratio of two runs. Each slice is measured after a guard
// (the previous target's calls in flight end in it), from one reading of
// the server's statistics to the next.
type Interleaving struct {
	// Slice is how long each slice lasts, its guard included.
	Slice time.Duration
	// Guard is how long into each slice measuring starts.
	Guard time.Duration
}

// DefaultInterleaving is 200 ms slices measured after 20 ms.
var DefaultInterleaving = Interleaving{Slice: 200 * time.Millisecond, Guard: 20 * time.Millisecond}

// Validate says what is wrong with iv, or returns nil.
func (iv Interleaving) Validate() error {
	if iv.Slice < 10*time.Millisecond || iv.Slice > time.Minute {
		return fmt.Errorf("Slice must be in [10ms, 1m], got %s", iv.Slice)
	}
	if iv.Guard < 0 || iv.Guard > iv.Slice/2 {
		return fmt.Errorf("Guard must be in [0, Slice/2], got %s", iv.Guard)
	}
	return nil
}

// Side is what one target of an interleaved run measured, summed over its
// slices' measured spans.
type Side struct {
	// Name labels the target.
	Name string
	// Decisions made within the measured spans, and those spans' length.
	Decisions int64
	Elapsed   time.Duration
	// PerSecond is Decisions / Elapsed.
	PerSecond float64
	// ScriptUsec, ServerUsec and ProcessUsec are as in Figure.
	ScriptUsec, ServerUsec, ProcessUsec float64
}

// Interleaved is an interleaved run's result.
type Interleaved struct {
	// Sides are the two targets, in slice order (target 0 runs first).
	Sides [2]Side
	// Pairs is how many slices of each target were measured.
	Pairs int
	// PairRatios is, for each pair of slices (one of each target, in
	// turn), target 1's time per decision against target 0's: their
	// spread shows how much the machine moved.
	PairRatios []float64
	// Errors counts the calls that failed, FirstErr is the first.
	Errors   int64
	FirstErr error
}

// sliceReading is one reading of the statistics at a slice's start or end.
type sliceReading struct {
	at                   time.Time
	decisions            [2]int64
	server               float64
	scriptCalls, scriptU float64
	process              time.Duration
}

// Interleave runs targets 0 and 1 in alternate slices on cfg.Workers
// workers until cfg.Duration (after cfg.Warmup, which alternates too) or
// cfg.Requests calls, reading Redis's statistics at each slice's measured
// start and end. A target is one decision per call.
func Interleave(ctx context.Context, client redis.UniversalClient, cfg Config, iv Interleaving, names [2]string, targets [2]Target) (Interleaved, error) {
	if err := errors.Join(cfg.Validate(), iv.Validate()); err != nil {
		return Interleaved{}, err
	}
	if cfg.Rate > 0 || cfg.OpsPerCall > 1 {
		return Interleaved{}, errors.New("bench: Interleave runs closed loops of one decision a call")
	}
	if targets[0] == nil || targets[1] == nil {
		return Interleaved{}, errors.New("bench: nil target")
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.Duration)
	defer cancel()
	var (
		side     atomic.Int32 // the target the slice runs
		done     [2]atomic.Int64
		claimed  atomic.Int64
		errCount atomic.Int64
		errMu    sync.Mutex
		firstErr error
		wg       sync.WaitGroup
	)
	workerCtx, stopWorkers := context.WithCancel(ctx)
	defer stopWorkers()
	for w := 0; w < cfg.Workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := uint64(0); claimed.Add(1) <= cfg.Requests && workerCtx.Err() == nil; i++ {
				s := side.Load()
				if err := targets[s](workerCtx, w, i); err != nil {
					if workerCtx.Err() != nil {
						return
					}
					errCount.Add(1)
					errMu.Lock()
					if firstErr == nil {
						firstErr = err
					}
					errMu.Unlock()
					continue
				}
				done[s].Add(1)
			}
		}()
	}
	read := func() (sliceReading, error) {
		r := sliceReading{at: time.Now(), decisions: [2]int64{done[0].Load(), done[1].Load()}, process: processCPU()}
		var err error
		if r.server, err = serverCPU(ctx, client); err != nil {
			return r, err
		}
		r.scriptCalls, r.scriptU, err = scriptStats(ctx, client)
		return r, err
	}
	sleep := func(d time.Duration) bool {
		t := time.NewTimer(d)
		defer t.Stop()
		select {
		case <-t.C:
			return true
		case <-ctx.Done():
			return false
		}
	}
	out := Interleaved{Sides: [2]Side{{Name: names[0]}, {Name: names[1]}}}
	var (
		script   [2][2]float64 // calls, usec
		server   [2]float64
		process  [2]time.Duration
		last     [2]float64 // the latest slice's time per decision, per side
		measured [2]int
		runErr   error
	)
	warmupEnd := time.Now().Add(cfg.Warmup)
	for k := 0; ; k++ {
		s := k % 2
		side.Store(int32(s))
		if !sleep(iv.Guard) {
			break
		}
		a, err := read()
		if err != nil {
			runErr = err
			break
		}
		if !sleep(iv.Slice - iv.Guard) {
			break // a slice cut short by the end of the run is not counted
		}
		b, err := read()
		if err != nil {
			runErr = err
			break
		}
		if a.at.Before(warmupEnd) {
			continue
		}
		if claimed.Load() > cfg.Requests {
			break // the workers ran out of calls during the slice
		}
		n := b.decisions[s] - a.decisions[s]
		span := b.at.Sub(a.at)
		o := &out.Sides[s]
		o.Decisions += n
		o.Elapsed += span
		server[s] += b.server - a.server
		script[s][0] += b.scriptCalls - a.scriptCalls
		script[s][1] += b.scriptU - a.scriptU
		process[s] += b.process - a.process
		measured[s]++
		if n > 0 {
			last[s] = span.Seconds() / float64(n)
		}
		if s == 1 && last[0] > 0 && last[1] > 0 {
			out.PairRatios = append(out.PairRatios, last[1]/last[0])
		}
	}
	stopWorkers()
	wg.Wait()
	out.Errors = errCount.Load()
	out.FirstErr = firstErr
	out.Pairs = min(measured[0], measured[1])
	for s := range out.Sides {
		o := &out.Sides[s]
		if o.Decisions > 0 {
			o.PerSecond = float64(o.Decisions) / o.Elapsed.Seconds()
			o.ServerUsec = server[s] * 1e6 / float64(o.Decisions)
			o.ProcessUsec = process[s].Seconds() * 1e6 / float64(o.Decisions)
		}
		if script[s][0] > 0 {
			o.ScriptUsec = script[s][1] / script[s][0]
		}
	}
	if runErr != nil {
		return out, runErr
	}
	if out.Pairs == 0 {
		return out, fmt.Errorf("bench: no slice pair measured in %s (slices of %s after %s of warmup)", cfg.Duration, iv.Slice, cfg.Warmup)
	}
	return out, nil
}

// String formats the run: each side on a line, then the comparison of side
// 1 with side 0.
func (r Interleaved) String() string {
	s := ""
	for _, o := range r.Sides {
		s += fmt.Sprintf("%-28s %8.0f/s  decisions %-8d redis cpu/decision: script %.2f us, server %.2f us; this process %.1f us\n",
			o.Name, o.PerSecond, o.Decisions, o.ScriptUsec, o.ServerUsec, o.ProcessUsec)
	}
	a, b := r.Sides[0], r.Sides[1]
	if a.PerSecond <= 0 || b.PerSecond <= 0 {
		return s + "  no comparison: a side made no decision\n"
	}
	ratios := slices.Clone(r.PairRatios)
	slices.Sort(ratios)
	q := func(p float64) float64 {
		if len(ratios) == 0 {
			return math.NaN()
		}
		return ratios[min(len(ratios)-1, int(p*float64(len(ratios))))]
	}
	// x says what b costs against a, or "-" when one was not measured.
	x := func(a, b float64) string {
		if a <= 0 || b <= 0 {
			return "-"
		}
		return fmt.Sprintf("x%.2f", b/a)
	}
	s += fmt.Sprintf("  %s vs %s, interleaved over %d pairs of slices: time per decision x%.2f, script cpu %s, server cpu %s, "+
		"cpu of this process and the server %s (slice pairs: p10 x%.2f, median x%.2f, p90 x%.2f)",
		b.Name, a.Name, r.Pairs, a.PerSecond/b.PerSecond, x(a.ScriptUsec, b.ScriptUsec), x(a.ServerUsec, b.ServerUsec),
		x(a.ProcessUsec+a.ServerUsec, b.ProcessUsec+b.ServerUsec), q(0.1), q(0.5), q(0.9))
	if r.Errors > 0 {
		s += fmt.Sprintf("\n  %d calls failed; the first: %v", r.Errors, r.FirstErr)
	}
	return s
}
