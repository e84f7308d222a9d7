package chaos

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/allot-dev/allot/chaos/check"
	"github.com/allot-dev/allot/chaos/history"
	"github.com/allot-dev/allot/internal/pausewatch"
	"github.com/allot-dev/allot/pkg/allocator"
)

func newSingleClient(addr string) (*allocator.Client, error) {
	return allocator.NewClient([]string{addr}, allocator.WithAttempts(1))
}

// Finish stops the regions (they hand back what they hold and settle
// pending requests), reads every ledger once more and returns the history.
func (s *Suite) Finish(ctx context.Context) (history.History, error) {
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
	)
	for _, r := range s.regions {
		wg.Add(1)
		go func() {
			defer wg.Done()
			sctx, cancel := context.WithTimeout(ctx, 30*time.Second)
			defer cancel()
			if err := r.Stop(sctx); err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	pctx, pcancel := context.WithTimeout(ctx, 10*time.Second)
	errs = append(errs, s.stopProxies(pctx))
	pcancel()
	rctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	errs = append(errs, s.obs.readAll(rctx))
	cancel()
	s.bgCancel()
	s.bg.Wait()
	return s.rec.Snapshot(), errors.Join(errs...)
}

// Quotas returns what the checkers hold each quota to.
func (s *Suite) Quotas() []check.Quota { return append([]check.Quota(nil), s.quotas...) }

// CheckParams are the checkers' parameters for this run: a fault span is
// excused one window past its heal; a Birch denial before its region's first
// grant only within three TTLs of the region's first request or Acquire (a
// cold start takes one renewal, or a window turn and a starve wait); an unanswered Acquire may take effect
// up to 10 s after its last attempt (a 5 s proposal timeout, and a request
// sent during a partition of up to 4 s can reach the allocator seconds
// after the heal).
func (s *Suite) CheckParams() check.Params {
	return check.Params{Quotas: s.Quotas(), FaultGrace: s.cfg.Window, StartupGrace: 3 * s.cfg.TTL, LinearizabilityTimeout: 30 * time.Second, ApplyTimeout: 10 * time.Second}
}

// WallClockStep is the farthest the machine's wall clock moved against
// CLOCK_MONOTONIC since the suite started (positive: ahead), over the
// observer's samples (every 300 ms) and now: a step that was undone before
// the end counts too.
func (s *Suite) WallClockStep() time.Duration {
	now := s.clock.Drift()
	if s.obs == nil {
		return now
	}
	if worst, _ := s.obs.drift.max(); worst.Abs() > now.Abs() {
		return worst
	}
	return now
}

// Report renders the checkers' result with a header describing the run,
// and writes it to OutDir/name.
func (s *Suite) Report(name, title string, h history.History, r *check.Result, took time.Duration) (string, error) {
	var b strings.Builder
	fmt.Fprintf(&b, "%s\n", title)
	var worst time.Duration
	var samples int
	if s.obs != nil {
		worst, samples = s.obs.drift.max()
	}
	fmt.Fprintf(&b, "seed %d; machine: %s; run took %s; true-clock drift vs wall clock at the end %s, largest of %d samples %s\n",
		s.cfg.Seed, machine(), took.Round(time.Second), s.clock.Drift().Round(time.Microsecond), samples, worst.Round(time.Microsecond))
	fmt.Fprintf(&b, "topology: %d allocators (+1 spare), regions %v as %s, WAN %s-%s each way, loss %.1f%%; window %s, TTL %s\n",
		s.cfg.Allocators, s.cfg.Regions, regionKindText(s.cfg.RegionKind), s.cfg.WAN.DelayMin, s.cfg.WAN.DelayMax, s.cfg.WAN.Loss*100, s.cfg.Window, s.cfg.TTL)
	for _, q := range s.cfg.Quotas {
		fmt.Fprintf(&b, "quota %s: G %d, chunk %d, clamp %t, demand %v", q.Name, q.Limit, q.Chunk, q.Clamp, q.Demand)
		if len(q.Flood) > 0 {
			fmt.Fprintf(&b, " alternating with %v", q.Flood)
		}
		if st := s.stated[q.Name]; st != nil {
			fmt.Fprintf(&b, "; GetBound states +%d", st.GetOvershoot())
		}
		b.WriteString("\n")
	}
	for _, q := range s.cfg.Quotas {
		b.WriteString(latencyLine(h, q.Name, s.cfg.Window))
	}
	s.mu.Lock()
	tp := append([]pausewatch.Pause(nil), s.pauses...)
	s.mu.Unlock()
	var logPath string
	if s.logw != nil {
		logPath = s.logw.Name()
	}
	b.WriteString(pauseLine(tp, logPath, h.Faults))
	b.WriteString("\n")
	if err := check.Render(&b, "per scenario (windows it touched, by the true clock):", h, r, s.Quotas(), s.cfg.Window); err != nil {
		return "", err
	}

	b.WriteString("\nfault timeline:\n")
	for _, f := range h.Faults {
		fmt.Fprintf(&b, "  %s  %-18s %-7s %s\n", time.Unix(0, f.At).UTC().Format("15:04:05.000"), f.Scenario, f.Action, f.Detail)
	}
	out := b.String()
	if s.cfg.OutDir != "" {
		if err := os.MkdirAll(s.cfg.OutDir, 0o755); err != nil {
			return out, err
		}
		if err := os.WriteFile(filepath.Join(s.cfg.OutDir, name), []byte(out), 0o644); err != nil {
			return out, err
		}
	}
	return out, nil
}

// latencyLine summarizes how long quota's decisions took, from request to
// answer, when the events carry both (agent regions: a request short of
// tokens waits for a renewal, up to the agent's starve wait, instead of
// being denied at once): over the whole run, and outside fault windows
// (a span that touches the region, extended by grace past its end).
func latencyLine(h history.History, quota string, grace time.Duration) string {
	var all, calm []time.Duration
	for _, e := range h.Events {
		if e.Quota != quota || (e.Kind != history.KindAdmit && e.Kind != history.KindDeny) || e.Call == 0 || e.At < e.Call {
			continue
		}
		d := time.Duration(e.At - e.Call)
		all = append(all, d)
		inFault := false
		for _, sp := range h.Spans {
			if sp.Skipped == "" && sp.Affects(e.Region) && e.At >= sp.Start && e.Call <= sp.End+int64(grace) {
				inFault = true
				break
			}
		}
		if !inFault {
			calm = append(calm, d)
		}
	}
	if len(all) == 0 {
		return ""
	}
	return fmt.Sprintf("decision latency %s: all %s; outside faults %s\n", quota, latencyStats(all), latencyStats(calm))
}

func latencyStats(lat []time.Duration) string {
	if len(lat) == 0 {
		return "none"
	}
	slices.Sort(lat)
	pct := func(p float64) time.Duration {
		return lat[min(len(lat)-1, int(p*float64(len(lat))))].Round(time.Millisecond)
	}
	slow := len(lat) - sort.Search(len(lat), func(i int) bool { return lat[i] > 200*time.Millisecond })
	return fmt.Sprintf("%d decisions, p50 %s, p99 %s, max %s, %d (%.1f%%) over 200ms",
		len(lat), pct(0.5), pct(0.99), lat[len(lat)-1].Round(time.Millisecond), slow, float64(slow)*100/float64(len(lat)))
}

func regionKindText(kind string) string {
	if kind == RegionAgent {
		return "region agents (regionagent + redis-server + load generator)"
	}
	return "region drivers"
}

// machine describes the CPU the run had (nproc and the model name).
func machine() string {
	model := "unknown CPU"
	if out, err := exec.Command("lscpu").Output(); err == nil {
		for _, line := range strings.Split(string(out), "\n") {
			if k, v, ok := strings.Cut(line, ":"); ok && strings.TrimSpace(k) == "Model name" {
				model = strings.TrimSpace(v)
			}
		}
	}
	return fmt.Sprintf("%d CPUs (%s)", runtime.NumCPU(), model)
}

// WriteHistory writes the whole history to OutDir/name as JSON lines: the
// spans, the fault timeline, then every event.
func (s *Suite) WriteHistory(name string, h history.History) error {
	f, err := os.Create(filepath.Join(s.cfg.OutDir, name))
	if err != nil {
		return err
	}
	w := bufio.NewWriterSize(f, 1<<20)
	enc := json.NewEncoder(w)
	for _, sp := range h.Spans {
		err = errors.Join(err, enc.Encode(map[string]any{"span": sp}))
	}
	for _, fl := range h.Faults {
		err = errors.Join(err, enc.Encode(map[string]any{"fault": fl}))
	}
	for _, e := range h.Events {
		err = errors.Join(err, enc.Encode(e))
	}
	return errors.Join(err, w.Flush(), f.Close())
}
