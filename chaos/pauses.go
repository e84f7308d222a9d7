package chaos

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime/pprof"
	"sort"
	"strings"
	"time"

	"github.com/allot-dev/allot/chaos/history"
	"github.com/allot-dev/allot/internal/pausewatch"
)

// notePause records a pause of this (the test) process: the WAN proxies
// and the observer run here, so calls through them stall with it.
func (s *Suite) notePause(p pausewatch.Pause) {
	s.mu.Lock()
	s.pauses = append(s.pauses, p)
	s.mu.Unlock()
	if s.logw != nil {
		fmt.Fprintf(s.logw, "chaos test process (WAN proxies, observer) did not run for %s, ended %s, cpu %s, %d GCs\n",
			p.Length.Round(time.Millisecond), p.End.UTC().Format("15:04:05.000"), p.CPU.Round(time.Millisecond), p.GCs)
	}
	s.logf("the test process did not run for %s (ended %s; it used %s of CPU then, %d GCs)", p.Length.Round(time.Millisecond),
		p.End.UTC().Format("15:04:05.000"), p.CPU.Round(time.Millisecond), p.GCs)
}

// loggedPause is one pause warning in the processes' log.
type loggedPause struct {
	who string // "allocator a1", "agent eu"
	pausewatch.Pause
}

// readPauses returns the pause warnings in the processes' JSON log lines
// (other lines, such as Redis's, are skipped).
func readPauses(r io.Reader) ([]loggedPause, error) {
	var out []loggedPause
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Bytes()
		if !strings.Contains(string(line), pausewatch.Message) { // cheap, before decoding
			continue
		}
		var e struct {
			Msg    string  `json:"msg"`
			Logger string  `json:"logger"`
			Node   string  `json:"node"`
			Region string  `json:"region"`
			Pause  float64 `json:"pause"`
			Ended  float64 `json:"ended"`
			CPU    float64 `json:"cpu"`
			GCs    uint64  `json:"gcs"`
		}
		if json.Unmarshal(line, &e) != nil || e.Msg != pausewatch.Message {
			continue
		}
		who := e.Logger
		switch {
		case e.Node != "":
			who = "allocator " + e.Node
		case e.Region != "":
			who = "agent " + e.Region
		}
		sec := int64(e.Ended)
		out = append(out, loggedPause{who: who, Pause: pausewatch.Pause{Length: seconds(e.Pause), CPU: seconds(e.CPU), GCs: e.GCs,
			End: time.Unix(sec, int64((e.Ended-float64(sec))*1e9))}})
	}
	return out, sc.Err()
}

// injected returns ", stop-leader's SIGSTOP" when p is an allocator's pause
// that such a scenario ended with its SIGCONT, "" otherwise.
func injected(p loggedPause, faults []history.Fault) string {
	id, ok := strings.CutPrefix(p.who, "allocator ")
	if !ok {
		return ""
	}
	for _, f := range faults {
		if f.Scenario == "stop-leader" && f.Action == "heal" && f.Detail == "SIGCONT "+id &&
			time.Duration(p.End.UnixNano()-f.At).Abs() < time.Second {
			return ", stop-leader's SIGSTOP"
		}
	}
	return ""
}

// seconds converts zap's encoding of a duration.
func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// pauseLine summarizes the pauses of the run's processes: the test
// process's own (tp) and those the allocators and agents logged (in the
// file at logPath). Several processes pausing at once point at the
// machine; one alone at that process. A pause of an allocator that a
// stop-leader scenario's SIGCONT ended (within a second, by faults) is
// marked as that scenario's.
func pauseLine(tp []pausewatch.Pause, logPath string, faults []history.Fault) string {
	var all []loggedPause
	for _, p := range tp {
		all = append(all, loggedPause{who: "test process", Pause: p})
	}
	if logPath != "" {
		f, err := os.Open(logPath)
		if err != nil {
			return fmt.Sprintf("process pauses: cannot read %s: %v\n", logPath, err)
		}
		lp, err := readPauses(f)
		f.Close()
		if err != nil {
			return fmt.Sprintf("process pauses: reading %s: %v\n", logPath, err)
		}
		all = append(all, lp...)
	}
	if len(all) == 0 {
		return fmt.Sprintf("process pauses (>= %s): none in the test process, the allocators or the agents\n", pausewatch.DefaultThreshold)
	}
	sort.Slice(all, func(i, j int) bool { return all[i].End.Before(all[j].End) })
	var b strings.Builder
	fmt.Fprintf(&b, "process pauses (>= %s; the process's CPU time and GCs in each), by when they ended:", pausewatch.DefaultThreshold)
	for _, p := range all {
		fmt.Fprintf(&b, " %s %s (%s, cpu %s, %d GCs%s);", p.End.UTC().Format("15:04:05.000"), p.who, p.Length.Round(time.Millisecond),
			p.CPU.Round(time.Millisecond), p.GCs, injected(p, faults))
	}
	return strings.TrimSuffix(b.String(), ";") + "\n"
}

// pauseProfileSegment is how long each CPU profile segment of
// Config.PauseProfiles runs.
const pauseProfileSegment = 5 * time.Second

// profilePauses profiles this process's CPU in segments of segment
// (pauseProfileSegment in the suite) until ctx ends, and keeps in dir the segment in which
// a pause of this process ended, with the one before it (the work that
// starved the watcher may have begun there), as pause-<end>-<n>.pprof; it
// deletes the others. A pause is hundreds of milliseconds of one process's
// work: an aggregate profile of a whole run would not show it.
func (s *Suite) profilePauses(ctx context.Context, dir string, segment time.Duration) {
	var prev string // the last segment's file, kept until the next one ends
	defer func() {
		if prev != "" {
			os.Remove(prev)
		}
	}()
	seen := 0 // pauses already looked at
	for i := 0; ctx.Err() == nil; i++ {
		f, err := os.CreateTemp(dir, "segment-*.pprof")
		if err != nil {
			s.logf("pause profiles: %v", err)
			return
		}
		if err := pprof.StartCPUProfile(f); err != nil { // another profile runs (go test -cpuprofile)
			f.Close()
			os.Remove(f.Name())
			s.logf("pause profiles: %v", err)
			return
		}
		t := time.NewTimer(segment)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
		}
		pprof.StopCPUProfile()
		f.Close()
		s.mu.Lock()
		ps := s.pauses[seen:]
		seen = len(s.pauses)
		s.mu.Unlock()
		if len(ps) > 0 {
			end := ps[len(ps)-1].End.UTC().Format("150405.000")
			for n, seg := range []string{prev, f.Name()} {
				if seg == "" {
					continue
				}
				kept := filepath.Join(dir, fmt.Sprintf("pause-%s-%d.pprof", end, n))
				if err := os.Rename(seg, kept); err != nil {
					s.logf("pause profiles: %v", err)
				} else {
					s.logf("pause profiles: kept %s", kept)
				}
			}
			prev = ""
			continue
		}
		if prev != "" {
			os.Remove(prev)
		}
		prev = f.Name()
	}
}
