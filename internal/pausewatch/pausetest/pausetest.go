// Package pausetest checks, in tests of the commands, that a process
// reports being stopped: it stops the process (SIGSTOP), continues it, and
// reads the pause back from the process's /metrics and log.
package pausetest

import (
	"bufio"
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/allot-dev/allot/internal/pausewatch"
)

// Start re-executes the test binary (whose TestMain runs the command when
// it finds env) with env added to its environment, its output going to out;
// the process is killed at the test's end if it still runs.
func Start(t *testing.T, env ...string) (*exec.Cmd, *bytes.Buffer) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), env...)
	out := &bytes.Buffer{}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	})
	return cmd, out
}

// Stop is how long CheckStop stops the process.
const Stop = 1500 * time.Millisecond

// CheckStop stops the process cmd runs (started, serving metricsURL, its
// output going to out) for Stop, continues it, and checks that the
// histogram metric counts the pause and that the log (zap's JSON, out) has a
// pause warning of about Stop that shows next to no CPU. It ends the process
// (SIGTERM) before it reads out. A loaded machine may make the process
// pause on its own as well, so other pauses are allowed around the stop.
func CheckStop(t *testing.T, cmd *exec.Cmd, out *bytes.Buffer, metricsURL, metric string) {
	t.Helper()
	before := count(t, metricsURL, metric)
	if err := cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	time.Sleep(Stop)
	if err := cmd.Process.Signal(syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	counted := before
	for counted == before && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
		counted = count(t, metricsURL, metric)
	}
	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	_ = cmd.Wait() // out is complete from here on
	if counted == before {
		t.Fatalf("%s_count still %v after a stop of %s; output:\n%s", metric, counted, Stop, out.String())
	}
	type entry struct {
		Msg   string  `json:"msg"`
		Pause float64 `json:"pause"` // seconds, as zap's production encoder writes durations
		CPU   float64 `json:"cpu"`
	}
	var logged []entry
	sc := bufio.NewScanner(strings.NewReader(out.String()))
	for sc.Scan() {
		var e entry
		if json.Unmarshal(sc.Bytes(), &e) == nil && e.Msg == pausewatch.Message {
			logged = append(logged, e)
		}
	}
	// The watcher wakes every 100 ms, so it sees the stop less up to one
	// interval (and a little scheduling delay). A stopped process uses no
	// CPU: what the warning shows is the interval around the stop, in
	// which a quiet process uses little.
	for _, e := range logged {
		if e.Pause >= Stop.Seconds()-0.2 && e.Pause <= 2*Stop.Seconds() {
			if e.CPU > Stop.Seconds()/3 {
				t.Fatalf("a stopped process used %vs of CPU in its pause of %vs; output:\n%s", e.CPU, e.Pause, out.String())
			}
			return
		}
	}
	t.Fatalf("logged pauses %+v, none of about %s; output:\n%s", logged, Stop, out.String())
}

// count returns the histogram's _count from metricsURL.
func count(t *testing.T, metricsURL, metric string) float64 {
	t.Helper()
	resp, err := http.Get(metricsURL)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, metric+"_count "); ok {
			n, err := strconv.ParseFloat(v, 64)
			if err != nil {
				t.Fatalf("%q: %v", line, err)
			}
			return n
		}
	}
	t.Fatalf("%s has no %s_count:\n%s", metricsURL, metric, b)
	return 0
}
