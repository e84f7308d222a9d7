package chaos

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/allot-dev/allot/chaos/history"
	"github.com/allot-dev/allot/internal/pausewatch"
)

func TestPauseLine(t *testing.T) {
	msg := `"msg":"` + pausewatch.Message + `"`
	log := strings.Join([]string{
		`29108:M 05 Dec 2026 08:48:53.815 * Ready to accept connections`,
		`{"level":"warn","ts":1796467034.52,"logger":"agent",` + msg + `,"region":"eu","pause":1.416,"ended":1796467034.5,"cpu":0.002,"gcs":0}`,
		`{"level":"warn","ts":1796467033.1,"logger":"allocator",` + msg + `,"node":"a2","pause":0.75,"ended":1796467033.25,"cpu":0.9,"gcs":1}`,
		`{"level":"warn","ts":1796467033.1,"logger":"raft","msg":"heartbeat timeout reached, starting election","node":"a2"}`,
		`chaos test process (WAN proxies, observer) did not run for 2s, ended 00:00:00.000, cpu 0s, 0 GCs`,
	}, "\n")
	path := filepath.Join(t.TempDir(), "processes.log")
	if err := os.WriteFile(path, []byte(log), 0o644); err != nil {
		t.Fatal(err)
	}
	tp := []pausewatch.Pause{{End: time.Unix(1796467034, 0), Length: 2 * time.Second, CPU: 30 * time.Millisecond, GCs: 2}}
	faults := []history.Fault{
		{Scenario: "stop-leader", Action: "inject", Detail: "SIGSTOP leader a2 for 800ms", At: time.Unix(1796467032, 450e6).UnixNano()},
		{Scenario: "stop-leader", Action: "heal", Detail: "SIGCONT a2", At: time.Unix(1796467033, 251e6).UnixNano()},
	}
	got := pauseLine(tp, path, faults)
	want := "process pauses (>= 500ms; the process's CPU time and GCs in each), by when they ended: 10:37:13.250 allocator a2 (750ms, cpu 900ms, 1 GCs, stop-leader's SIGSTOP); 10:37:14.000 test process (2s, cpu 30ms, 2 GCs); 10:37:14.500 agent eu (1.416s, cpu 2ms, 0 GCs)\n"
	if got != want {
		t.Fatalf("pauseLine:\n got %q\nwant %q", got, want)
	}
	// The same pause without the scenario's SIGCONT (or another node's) is
	// not marked.
	faults[1].Detail = "SIGCONT a3"
	got = pauseLine(tp, path, faults)
	want = strings.Replace(want, ", stop-leader's SIGSTOP", "", 1)
	if got != want {
		t.Fatalf("pauseLine:\n got %q\nwant %q", got, want)
	}
	if got := pauseLine(nil, path+".missing", nil); !strings.Contains(got, "cannot read") {
		t.Fatalf("missing log: %q", got)
	}
	empty := filepath.Join(t.TempDir(), "empty.log")
	if err := os.WriteFile(empty, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if got := pauseLine(nil, empty, nil); !strings.HasPrefix(got, "process pauses (>= 500ms): none") {
		t.Fatalf("no pauses: %q", got)
	}
}

// TestProfilePauses: the CPU profile segments around a pause of the process
// are kept, as readable profiles, and every other segment is deleted.
func TestProfilePauses(t *testing.T) {
	dir := t.TempDir()
	s := &Suite{cfg: Config{Logf: t.Logf}}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); s.profilePauses(ctx, dir, 100*time.Millisecond) }()
	time.Sleep(350 * time.Millisecond) // three segments without a pause
	s.mu.Lock()
	s.pauses = append(s.pauses, pausewatch.Pause{End: time.Unix(1796467034, 0), Length: time.Second})
	s.mu.Unlock()
	time.Sleep(350 * time.Millisecond)
	cancel()
	<-done
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	want := []string{"pause-" + time.Unix(1796467034, 0).UTC().Format("150405.000") + "-0.pprof", "pause-" + time.Unix(1796467034, 0).UTC().Format("150405.000") + "-1.pprof"}
	if !slices.Equal(names, want) {
		t.Fatalf("files %v, want %v", names, want)
	}
	for _, n := range names {
		b, err := os.ReadFile(filepath.Join(dir, n))
		if err != nil {
			t.Fatal(err)
		}
		// A CPU profile is a gzipped protocol buffer.
		if len(b) < 2 || b[0] != 0x1f || b[1] != 0x8b {
			t.Errorf("%s is not a gzipped profile (%d bytes)", n, len(b))
		}
	}
}
