// Package bench is allot's load generator. It drives a Target — a function
// that decides one request (or one batch) — from concurrent workers, bounded
// both in count and in time, either as fast as it answers (closed loop) or
// paced to a fixed total rate (open loop, latency measured from each
// request's scheduled start so that a stall is not hidden, and also from
// its arrival, which leaves out the generator's own timer lateness), and
// reports throughput and latency percentiles.
//
// The target is just a function, so the same runner measures the admission
// SDK against Redis, the raw script through go-redis, and later the region
// agent's Connect and Envoy RLS endpoints.
//
// # Usage
//
//  1. Write a Target: decide one request for worker w, sequence number i
//     (use them to pick a key), and return an error only for a failed call.
//  2. Fill a Config: Workers, and both bounds (Requests and Duration). Set
//     Rate for an open-loop run.
//  3. Run it and print the Result.
package bench

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"runtime"
	"sync"
	"sync/atomic"
	"time"
)

// Target decides one call's worth of requests (Config.OpsPerCall of them)
// for worker w; i numbers the worker's calls from 0. It returns an error only
// when the call failed.
type Target func(ctx context.Context, w int, i uint64) error

// Config bounds and shapes a run.
type Config struct {
	// Name labels the result.
	Name string
	// Workers is the number of concurrent callers.
	Workers int
	// Requests stops the run after this many calls in total.
	Requests int64
	// Duration stops the run after this long, whatever the count.
	Duration time.Duration
	// Warmup runs the target this long before measuring (bounded by
	// Requests too); 0 for none.
	Warmup time.Duration
	// Rate paces the calls to this many per second in total (open loop);
	// 0 runs each worker as fast as the target answers (closed loop).
	Rate float64
	// OpsPerCall is how many decisions one call makes (e.g. a pipeline of
	// 16); throughput is reported in decisions. 0 means 1.
	OpsPerCall int
	// SlowOver, when set, counts the measured calls at least this slow by
	// the 10 ms window they ended in (Result.Slow): whether a tail comes
	// from steady queueing (slow calls everywhere) or from stalls (slow
	// calls bunched in a few windows).
	SlowOver time.Duration
}

// Validate says what is wrong with c, or returns nil.
func (c Config) Validate() error {
	var errs []error
	if c.Workers < 1 || c.Workers > 100_000 {
		errs = append(errs, fmt.Errorf("Workers must be in [1, 100000], got %d", c.Workers))
	}
	if c.Requests < 1 {
		errs = append(errs, fmt.Errorf("Requests must be positive (every run is bounded in count), got %d", c.Requests))
	}
	if c.Duration <= 0 || c.Duration > time.Hour {
		errs = append(errs, fmt.Errorf("Duration must be in (0, 1h] (every run is bounded in time), got %s", c.Duration))
	}
	if c.Warmup < 0 || c.Warmup > c.Duration {
		errs = append(errs, fmt.Errorf("Warmup must be in [0, Duration], got %s", c.Warmup))
	}
	if c.Rate < 0 || math.IsNaN(c.Rate) || math.IsInf(c.Rate, 0) {
		errs = append(errs, fmt.Errorf("Rate must be a finite non-negative number, got %v", c.Rate))
	}
	if c.OpsPerCall < 0 {
		errs = append(errs, fmt.Errorf("OpsPerCall must not be negative, got %d", c.OpsPerCall))
	}
	if len(errs) > 0 {
		return fmt.Errorf("bench config: %w", errors.Join(errs...))
	}
	return nil
}

// Result is what one run measured.
type Result struct {
	// Name is Config.Name.
	Name string
	// Calls counts the target calls that succeeded after the warmup and
	// Errors those that failed; a failed call is no decision and is not in
	// the latencies.
	Calls, Errors int64
	// Decisions is Calls x OpsPerCall.
	Decisions int64
	// Elapsed is the measured time.
	Elapsed time.Duration
	// PerSecond is decisions per second.
	PerSecond float64
	// Mean and the percentiles are call latencies (for a paced run, from
	// the scheduled start) of the calls that succeeded and ended within the
	// run. A percentile is the upper edge of its histogram bucket (32 per
	// power of two), so it reads up to 3.1% above the true value: the safe
	// side for a target such as p99 < 2 ms, and the last digits printed are
	// that bucket edge. Mean and Max are exact.
	Mean, P50, P90, P99, P999, Max time.Duration
	// Paced runs only. Arrival holds the latencies from each call's
	// arrival: the scheduled start when its worker was still busy with an
	// earlier call (so a stall still counts for every call queued behind
	// it), the moment the worker woke when it slept until the call was due.
	// That leaves out the generator's own timer lateness, which Lag
	// measures over the calls whose worker slept (Go's timers fire up to
	// about a millisecond late when the process is idle).
	Arrival Quantiles
	Lag     Quantiles
	// Slow counts the calls over Config.SlowOver by window.
	Slow SlowCalls
	// FirstErr is the first error a call returned.
	FirstErr error
}

// SlowCalls says how the calls at least Over slow fell into the measured
// time's 10 ms windows.
type SlowCalls struct {
	Over time.Duration
	// Calls counts them; Windows the windows holding one or more, of
	// Spanned windows measured; Busiest is the most in one window.
	Calls                     int64
	Windows, Spanned, Busiest int
	// NearGC counts the calls in windows next to the end of one of this
	// process's GC cycles (the window it ended in, and the ones before and
	// after), and GCs the cycles that ended in the measured time.
	NearGC int64
	GCs    int
}

// slowWindow is the width of SlowCalls' windows.
const slowWindow = 10 * time.Millisecond

// String formats the count; "" when Over is not set.
func (s SlowCalls) String() string {
	if s.Over <= 0 {
		return ""
	}
	return fmt.Sprintf("calls of %s and more: %d, ending in %d of %d %s windows (the busiest held %d); %d of them next to the end of one of the %d GC cycles",
		s.Over, s.Calls, s.Windows, s.Spanned, slowWindow, s.Busiest, s.NearGC, s.GCs)
}

// Quantiles summarizes one latency distribution.
type Quantiles struct {
	P50, P90, P99, P999, Max time.Duration
}

func (h *histogram) quantiles() Quantiles {
	return Quantiles{h.quantile(0.50), h.quantile(0.90), h.quantile(0.99), h.quantile(0.999), time.Duration(h.max)}
}

// String formats the result on one line.
func (r Result) String() string {
	s := fmt.Sprintf("%-28s %10.0f/s  calls %-8d errors %-5d p50 %-9s p90 %-9s p99 %-9s p99.9 %-9s max %s",
		r.Name, r.PerSecond, r.Calls, r.Errors, round(r.P50), round(r.P90), round(r.P99), round(r.P999), round(r.Max))
	if r.FirstErr != nil {
		s += fmt.Sprintf("  first error: %v", r.FirstErr)
	}
	return s
}

// ArrivalLine formats a paced run's latencies from arrival and the
// generator's timer lag on one line; "" for a closed-loop run.
func (r Result) ArrivalLine() string {
	if r.Arrival.Max == 0 {
		return ""
	}
	return fmt.Sprintf("%-28s from arrival: p50 %-9s p90 %-9s p99 %-9s p99.9 %-9s max %s; timer lag p50 %s p99 %s",
		"", round(r.Arrival.P50), round(r.Arrival.P90), round(r.Arrival.P99), round(r.Arrival.P999), round(r.Arrival.Max),
		round(r.Lag.P50), round(r.Lag.P99))
}

func round(d time.Duration) time.Duration {
	switch {
	case d >= time.Millisecond:
		return d.Round(10 * time.Microsecond)
	case d >= time.Microsecond:
		return d.Round(100 * time.Nanosecond)
	}
	return d
}

// pastDeadline reports whether ctx's deadline is at or before now.
func pastDeadline(ctx context.Context, now time.Time) bool {
	d, ok := ctx.Deadline()
	return ok && !now.Before(d)
}

// Run drives target as cfg says and returns what it measured. It stops at
// the first of Requests calls, Duration, or ctx's end.
func Run(ctx context.Context, cfg Config, target Target) (Result, error) {
	if err := cfg.Validate(); err != nil {
		return Result{}, err
	}
	if target == nil {
		return Result{}, errors.New("bench: nil target")
	}
	ops := int64(max(cfg.OpsPerCall, 1))
	ctx, cancel := context.WithTimeout(ctx, cfg.Duration)
	defer cancel()

	var (
		claimed   atomic.Int64
		measuring atomic.Bool
		errMu     sync.Mutex
		firstErr  error
		hists     = make([]*histogram, cfg.Workers)
		arrivals  = make([]*histogram, cfg.Workers) // paced runs only
		lags      = make([]*histogram, cfg.Workers) // paced runs only
		errCounts = make([]int64, cfg.Workers)
		calls     = make([]int64, cfg.Workers)
		slow      []atomic.Int32 // calls over SlowOver, by slowWindow since measureFrom
		wg        sync.WaitGroup
	)
	if cfg.SlowOver > 0 {
		slow = make([]atomic.Int32, max(int((cfg.Duration-cfg.Warmup)/slowWindow), 0)+2)
	}
	start := time.Now()
	measureFrom := start.Add(cfg.Warmup)
	measuring.Store(cfg.Warmup == 0)
	var interval time.Duration
	if cfg.Rate > 0 {
		interval = time.Duration(float64(cfg.Workers) / cfg.Rate * float64(time.Second))
	}
	for w := 0; w < cfg.Workers; w++ {
		hists[w] = &histogram{}
		if interval > 0 {
			arrivals[w], lags[w] = &histogram{}, &histogram{}
		}
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			h := hists[w]
			var timer *time.Timer // reused by a paced worker
			defer func() {
				if timer != nil {
					timer.Stop()
				}
			}()
			next := start
			if interval > 0 {
				next = start.Add(interval * time.Duration(w) / time.Duration(cfg.Workers))
			}
			for i := uint64(0); ; i++ {
				if claimed.Add(1) > cfg.Requests {
					return
				}
				var woke time.Time // when the worker slept until the call was due
				if interval > 0 {
					if d := time.Until(next); d > 0 {
						if timer == nil {
							timer = time.NewTimer(d)
						} else {
							timer.Reset(d)
						}
						select {
						case <-timer.C:
						case <-ctx.Done():
							return
						}
						woke = time.Now()
					}
				}
				if ctx.Err() != nil {
					return
				}
				t := time.Now()
				arrived := t
				if interval > 0 {
					t = next // latency from the scheduled start
					if woke.IsZero() || woke.Before(next) {
						arrived = next
					} else {
						arrived = woke
					}
					next = next.Add(interval)
				}
				err := target(ctx, w, i)
				end := time.Now()
				if !measuring.Load() {
					if end.Before(measureFrom) {
						continue
					}
					measuring.Store(true)
				}
				if err != nil {
					if ctx.Err() != nil || pastDeadline(ctx, end) {
						// A call cut short by the end of the run (or refused
						// by a client that saw the deadline pass before the
						// context's own timer fired).
						return
					}
					errCounts[w]++
					errMu.Lock()
					if firstErr == nil {
						firstErr = err
					}
					errMu.Unlock()
					continue // a failed call is no decision
				}
				calls[w]++
				took := end.Sub(t)
				h.record(took)
				if slow != nil && took >= cfg.SlowOver {
					i := int(max(end.Sub(measureFrom), 0) / slowWindow)
					slow[min(i, len(slow)-1)].Add(1)
				}
				if interval > 0 {
					arrivals[w].record(end.Sub(arrived))
					if !woke.IsZero() {
						lags[w].record(max(woke.Sub(t), 0))
					}
				}
			}
		}(w)
	}
	wg.Wait()
	elapsed := time.Since(start)
	if cfg.Warmup > 0 && elapsed > cfg.Warmup {
		elapsed -= cfg.Warmup
	}
	total, arrival, lag := &histogram{}, &histogram{}, &histogram{}
	r := Result{Name: cfg.Name, Elapsed: elapsed, FirstErr: firstErr}
	for w := range hists {
		total.merge(hists[w])
		if interval > 0 {
			arrival.merge(arrivals[w])
			lag.merge(lags[w])
		}
		r.Calls += calls[w]
		r.Errors += errCounts[w]
	}
	r.Decisions = r.Calls * ops
	if elapsed > 0 {
		r.PerSecond = float64(r.Decisions) / elapsed.Seconds()
	}
	r.Mean = total.mean()
	r.P50, r.P90, r.P99, r.P999 = total.quantile(0.50), total.quantile(0.90), total.quantile(0.99), total.quantile(0.999)
	r.Max = time.Duration(total.max)
	if interval > 0 {
		r.Arrival, r.Lag = arrival.quantiles(), lag.quantiles()
	}
	if slow != nil {
		r.Slow = countSlow(slow, measureFrom, int((elapsed+slowWindow-1)/slowWindow), cfg.SlowOver, gcEnds())
	}
	return r, nil
}

// gcEnds returns when the collector's last cycles (up to 256) ended, in
// Unix nanoseconds.
func gcEnds() []uint64 {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	ends := make([]uint64, 0, min(ms.NumGC, 256))
	for i := uint32(0); i < min(ms.NumGC, 256); i++ {
		ends = append(ends, ms.PauseEnd[(ms.NumGC-1-i)%256])
	}
	return ends
}

// countSlow sums slow, the counts of slow calls by window since from, and
// places them against ends, the ends of GC cycles (Unix nanoseconds): a
// call is next to a cycle when it ended in the cycle's window, the one
// before or the one after.
func countSlow(slow []atomic.Int32, from time.Time, spanned int, over time.Duration, ends []uint64) SlowCalls {
	gc := make([]bool, len(slow))
	s := SlowCalls{Over: over, Spanned: spanned}
	for _, e := range ends {
		at := int64(e) - from.UnixNano()
		if at < 0 {
			continue
		}
		w := int(at / int64(slowWindow))
		if w >= len(slow) {
			continue
		}
		s.GCs++
		for _, v := range []int{w - 1, w, w + 1} {
			if v >= 0 && v < len(gc) {
				gc[v] = true
			}
		}
	}
	for i := range slow {
		if n := int(slow[i].Load()); n > 0 {
			s.Calls += int64(n)
			s.Windows++
			s.Busiest = max(s.Busiest, n)
			if gc[i] {
				s.NearGC += int64(n)
			}
		}
	}
	return s
}

// histogram is a log-linear latency histogram in nanoseconds: exact below
// 64 ns, then 32 buckets per power of two (at most ~3% error), no allocation
// per sample.
type histogram struct {
	counts [64 + 40*32]uint64
	n      uint64
	sum    float64
	max    int64
}

func bucketOf(v int64) int {
	if v < 64 {
		return int(max(v, 0))
	}
	e := bits.Len64(uint64(v)) - 6
	m := int(uint64(v) >> e) // 32..63
	return min(64+(e-1)*32+(m-32), len(histogram{}.counts)-1)
}

// upper is the largest value in bucket i.
func upper(i int) int64 {
	if i < 64 {
		return int64(i)
	}
	e := (i-64)/32 + 1
	m := int64((i-64)%32 + 32)
	return (m+1)<<e - 1
}

func (h *histogram) record(d time.Duration) {
	v := int64(d)
	h.counts[bucketOf(v)]++
	h.n++
	h.sum += float64(v)
	h.max = max(h.max, v)
}

func (h *histogram) merge(o *histogram) {
	for i, c := range o.counts {
		h.counts[i] += c
	}
	h.n += o.n
	h.sum += o.sum
	h.max = max(h.max, o.max)
}

func (h *histogram) mean() time.Duration {
	if h.n == 0 {
		return 0
	}
	return time.Duration(h.sum / float64(h.n))
}

// quantile returns the upper bound of the bucket holding quantile q.
func (h *histogram) quantile(q float64) time.Duration {
	if h.n == 0 {
		return 0
	}
	rank := uint64(math.Ceil(q * float64(h.n)))
	var seen uint64
	for i, c := range h.counts {
		seen += c
		if seen >= rank {
			return time.Duration(min(upper(i), h.max))
		}
	}
	return time.Duration(h.max)
}
