// Package pausewatch notices when its process stopped running for a while:
// a goroutine that wakes every Interval and finds it woke much later than
// asked was not run in between. Stop-the-world pauses, CPU starvation, a VM
// losing its host's CPU, a SIGSTOP and a machine swapping all look like
// this, and all of them make a process miss deadlines it otherwise keeps
// (lease renewals, Raft heartbeats, a client's timeout). Logging such a
// pause in every process of a deployment tells which of them stalled when
// calls between them did: one process, or the whole machine.
package pausewatch

import (
	"context"
	"runtime/metrics"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// Defaults of Config.
const (
	DefaultInterval  = 100 * time.Millisecond
	DefaultThreshold = 500 * time.Millisecond
)

// Pause is one stretch in which the watching goroutine did not run.
type Pause struct {
	// End is when the watcher ran again (wall clock).
	End time.Time
	// Length is how much later than asked the watcher woke: the part of
	// the stretch the process was not running (at least Threshold).
	Length time.Duration
	// CPU is the CPU time (user and system, all threads) the process used
	// from the wake-up before the pause to the one after it. Near zero:
	// nothing of the process ran (stopped, or the machine gave it no CPU).
	// Near the stretch's length or more: it ran, but its scheduler kept
	// the watcher waiting (goroutines or the garbage collector took every
	// thread).
	CPU time.Duration
	// GCs is the number of garbage collections that ended in that stretch.
	GCs uint64
}

// Config configures Run.
type Config struct {
	// Interval is how often the watcher wakes (default DefaultInterval).
	Interval time.Duration
	// Threshold is the lateness reported as a pause (default
	// DefaultThreshold). A loaded machine delays wake-ups by a few
	// milliseconds; a pause worth a log line is hundreds of them.
	Threshold time.Duration
	// OnPause is called with each pause, from the watching goroutine.
	OnPause func(Pause)
	// Histogram, when set, observes each pause's length in seconds.
	Histogram prometheus.Observer

	// sleep, now and usage are time.Sleep, time.Now and processUsage,
	// replaced in tests.
	sleep func(time.Duration)
	now   func() time.Time
	usage func() (cpu time.Duration, gcs uint64)
}

// processUsage returns the CPU time the process has used and the garbage
// collections it has finished.
func processUsage() (time.Duration, uint64) {
	var ru syscall.Rusage
	var cpu time.Duration
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) == nil {
		cpu = time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	}
	s := []metrics.Sample{{Name: "/gc/cycles/total:gc-cycles"}}
	metrics.Read(s)
	var gcs uint64
	if s[0].Value.Kind() == metrics.KindUint64 {
		gcs = s[0].Value.Uint64()
	}
	return cpu, gcs
}

// NewHistogram returns the histogram of pause lengths for Config.Histogram,
// named name (say allot_agent_process_pause_seconds).
func NewHistogram(name string) prometheus.Histogram {
	return prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    name,
		Help:    "Stretches in which this process did not run (a wake-up late by at least the pause threshold), by length.",
		Buckets: []float64{0.5, 1, 2, 5, 10, 30, 60},
	})
}

// Message is the message of the warning LogTo logs; tools that read the
// logs (the chaos suite's report) look for it.
const Message = "this process did not run for a while (a stop-the-world pause, CPU starvation, or its VM or machine stalled); timeouts and deadlines in that stretch may have passed unseen"

// LogTo returns an OnPause that logs each pause on log as a warning, with
// the process's CPU time and garbage collections in that stretch (see
// Pause).
func LogTo(log *zap.Logger) func(Pause) {
	return func(p Pause) {
		log.Warn(Message, zap.Duration("pause", p.Length), zap.Time("ended", p.End), zap.Duration("cpu", p.CPU), zap.Uint64("gcs", p.GCs))
	}
}

// Run watches until ctx ends; it returns nil.
func Run(ctx context.Context, cfg Config) error {
	if cfg.Interval <= 0 {
		cfg.Interval = DefaultInterval
	}
	if cfg.Threshold <= 0 {
		cfg.Threshold = DefaultThreshold
	}
	sleep, now := cfg.sleep, cfg.now
	if sleep == nil {
		sleep = func(d time.Duration) {
			t := time.NewTimer(d)
			defer t.Stop()
			select {
			case <-t.C:
			case <-ctx.Done():
			}
		}
	}
	if now == nil {
		now = time.Now
	}
	usage := cfg.usage
	if usage == nil {
		usage = processUsage
	}
	last := now()
	lastCPU, lastGCs := usage()
	for ctx.Err() == nil {
		sleep(cfg.Interval)
		t := now()
		cpu, gcs := usage()
		// time.Time's monotonic reading makes Sub immune to steps of the
		// wall clock: a clock set back or forward is not a pause.
		late := t.Sub(last) - cfg.Interval
		p := Pause{End: t, Length: late, CPU: cpu - lastCPU, GCs: gcs - lastGCs}
		last, lastCPU, lastGCs = t, cpu, gcs
		if late < cfg.Threshold || ctx.Err() != nil {
			continue
		}
		if cfg.Histogram != nil {
			cfg.Histogram.Observe(late.Seconds())
		}
		if cfg.OnPause != nil {
			cfg.OnPause(p)
		}
	}
	return nil
}
