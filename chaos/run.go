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
	"strings"
	"sync"
	"time"

	"github.com/allot-dev/allot/chaos/check"
	"github.com/allot-dev/allot/chaos/history"
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
// excused one window past its heal.
func (s *Suite) CheckParams() check.Params {
	return check.Params{Quotas: s.Quotas(), FaultGrace: s.cfg.Window, LinearizabilityTimeout: 30 * time.Second, ApplyTimeout: 5 * time.Second}
}

// Report renders the checkers' result with a header describing the run,
// and writes it to OutDir/name.
func (s *Suite) Report(name, title string, h history.History, r *check.Result, took time.Duration) (string, error) {
	var b strings.Builder
	fmt.Fprintf(&b, "%s\n", title)
	fmt.Fprintf(&b, "seed %d; machine: %s; run took %s; true-clock drift vs wall clock at the end %s\n",
		s.cfg.Seed, machine(), took.Round(time.Second), s.clock.Drift().Round(time.Microsecond))
	fmt.Fprintf(&b, "topology: %d allocators (+1 spare), regions %v, WAN %s-%s each way, loss %.1f%%; window %s, TTL %s\n",
		s.cfg.Allocators, s.cfg.Regions, s.cfg.WAN.DelayMin, s.cfg.WAN.DelayMax, s.cfg.WAN.Loss*100, s.cfg.Window, s.cfg.TTL)
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
