package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// standalonePolicy is a policy without global quotas, for an agent without
// allocators.
const standalonePolicy = `
name: standalone
rules:
  - name: bucket
    scope: tenant
    match: [{key: tenant}]
    kind: token_bucket
    capacity: 10
    refill_per_second: 1
`

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// TestShutdownBoundsTheServersDrain: calls their clients hold open (a
// Connect request whose body never comes, a gRPC call that never sends its
// message) do not hold the agent's exit past -shutdown-timeout. The HTTP
// drain used to wait 5 s whatever the flag said, and gRPC's GracefulStop
// as long as a call stayed open.
func TestShutdownBoundsTheServersDrain(t *testing.T) {
	pf := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(pf, []byte(standalonePolicy), 0o600); err != nil {
		t.Fatal(err)
	}
	api, envoy := freeAddr(t), freeAddr(t)
	const timeout = 300 * time.Millisecond
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	errc := make(chan error, 1)
	go func() {
		errc <- run(ctx, []string{"-region", "eu", "-store", "embedded", "-policy", pf, "-api-addr", api, "-envoy-addr", envoy,
			"-shutdown-timeout", timeout.String(), "-log-level", "error"})
	}()
	if err := waitReady(api); err != nil {
		t.Fatal(err)
	}

	c, err := net.Dial("tcp", api)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := fmt.Fprint(c, "POST /allot.v1.AdmissionService/Check HTTP/1.1\r\nHost: agent\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{"); err != nil {
		t.Fatal(err)
	}
	cc, err := grpc.NewClient(envoy, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	sctx, scancel := context.WithCancel(context.Background())
	defer scancel()
	if _, err := cc.NewStream(sctx, &grpc.StreamDesc{ClientStreams: true, ServerStreams: true}, "/allot.v1.AdmissionService/Check"); err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond) // both calls reach their handlers

	t0 := time.Now()
	cancel()
	select {
	case <-errc: // a drain cut short is reported; what matters is when
	case <-time.After(5 * time.Second):
		t.Fatal("run still draining 5 s after the stop")
	}
	if took := time.Since(t0); took > timeout+700*time.Millisecond {
		t.Fatalf("run returned %s after the stop, want within -shutdown-timeout (%s) and a little", took, timeout)
	}
}

// writePolicy writes standalonePolicy to a file and returns its path.
// waitReady waits up to 10 s for the agent serving api to answer /readyz
// with 200.
func waitReady(api string) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		resp, err := http.Get("http://" + api + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("agent not ready: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func writePolicy(t *testing.T) string {
	t.Helper()
	pf := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(pf, []byte(standalonePolicy), 0o600); err != nil {
		t.Fatal(err)
	}
	return pf
}

// TestBusyEnvoyPortLeavesNothingRunning: when -envoy-addr cannot be
// listened on, run returns an error with nothing it started still running.
// It used to return with the agent's Run and the API server it had already
// started left to end by themselves, unwaited for (the process could exit
// in the middle of the agent's shutdown). Whether one of them is caught
// still running is a race, so the start is tried several times.
func TestBusyEnvoyPortLeavesNothingRunning(t *testing.T) {
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	pf := writePolicy(t)
	buf := make([]byte, 1<<20)
	for range 50 {
		api := freeAddr(t)
		err := run(context.Background(), []string{"-region", "eu", "-store", "embedded", "-policy", pf, "-api-addr", api,
			"-envoy-addr", busy.Addr().String(), "-log-level", "error"})
		// At once: what run started must have ended before it returned,
		// not be ending meanwhile.
		stacks := string(buf[:runtime.Stack(buf, true)])
		if err == nil || !strings.Contains(err.Error(), "listen envoy") {
			t.Fatalf("run: %v, want the envoy listener's error", err)
		}
		for _, f := range []string{"main.run.func", "agent.(*Agent).Run"} {
			if strings.Contains(stacks, f) {
				t.Fatalf("%s still running after run returned:\n%s", f, stacks)
			}
		}
		if c, err := net.DialTimeout("tcp", api, time.Second); err == nil {
			c.Close()
			t.Fatalf("the API address %s still accepts connections after run returned", api)
		}
	}
}

// startStandalone runs a standalone agent with args added until the test
// ends, and returns the function that stops it and waits for run.
func startStandalone(t *testing.T, args ...string) func() error {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() {
		errc <- run(ctx, append([]string{"-region", "eu", "-store", "embedded", "-policy", writePolicy(t), "-api-addr", freeAddr(t),
			"-envoy-addr", "", "-shutdown-timeout", "300ms"}, args...))
	}()
	var (
		once sync.Once
		err  error
	)
	stop := func() error {
		once.Do(func() {
			cancel()
			err = <-errc
		})
		return err
	}
	t.Cleanup(func() { _ = stop() })
	return stop
}

// TestLeaseJournalEndsATornLine: a journal whose last line was torn (a
// crash or a full disk in mid-append) gets a newline before the next
// process's first event, so that its start event is a line of its own. It
// used to be appended to the torn line and lost with it as one malformed
// line.
func TestLeaseJournalEndsATornLine(t *testing.T) {
	path := filepath.Join(t.TempDir(), "journal.jsonl")
	const torn = `{"kind":"start","at":1,"pid":1}` + "\n" + `{"kind":"acquire","at":2,"requ`
	if err := os.WriteFile(path, []byte(torn), 0o644); err != nil {
		t.Fatal(err)
	}
	stop := startStandalone(t, "-lease-journal", path, "-log-level", "error")
	// lines returns the journal's lines and the start events among them.
	lines := func() ([]string, []map[string]any) {
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		ls := strings.Split(strings.TrimSuffix(string(b), "\n"), "\n")
		var starts []map[string]any
		for _, l := range ls {
			var ev map[string]any
			if json.Unmarshal([]byte(l), &ev) == nil && ev["kind"] == "start" {
				starts = append(starts, ev)
			}
		}
		return ls, starts
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, starts := lines(); len(starts) == 2 {
			break
		}
		if time.Now().After(deadline) {
			ls, _ := lines()
			t.Fatalf("journal %q: want this process's start event on a line of its own", ls)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := stop(); err != nil {
		t.Fatalf("run: %v", err)
	}
	ls, starts := lines()
	if len(ls) != 3 || ls[1] != `{"kind":"acquire","at":2,"requ` {
		t.Fatalf("journal %q: want the two earlier lines, the torn one intact, then the start event", ls)
	}
	if pid := starts[1]["pid"]; pid != float64(os.Getpid()) {
		t.Fatalf("start event %v: pid %v, want %d", starts[1], pid, os.Getpid())
	}

	// A journal that ends in a newline gets none more.
	before := len(ls)
	stop = startStandalone(t, "-lease-journal", path, "-log-level", "error")
	deadline = time.Now().Add(10 * time.Second)
	for {
		if _, starts := lines(); len(starts) == 3 {
			break
		}
		if time.Now().After(deadline) {
			ls, _ := lines()
			t.Fatalf("journal %q: want a third start event", ls)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := stop(); err != nil {
		t.Fatalf("run: %v", err)
	}
	if ls, _ := lines(); len(ls) != before+1 {
		t.Fatalf("journal %q: want one line more (no empty line)", ls)
	}
}

// TestLeaseJournalWriteErrorIsLoggedAtOnce: the first event the journal
// cannot write is logged as it happens. It used to be logged only at a clean
// shutdown, so a journal that stopped at a full disk went unnoticed while
// the agent ran (and for good after a crash).
func TestLeaseJournalWriteErrorIsLoggedAtOnce(t *testing.T) {
	if _, err := os.Stat("/dev/full"); err != nil {
		t.Skip("no /dev/full:", err)
	}
	logged := captureStderr(t) // the agent's logger writes to os.Stderr as it is when run builds it
	stop := startStandalone(t, "-lease-journal", "/dev/full", "-log-level", "warn")
	deadline := time.Now().Add(10 * time.Second)
	for !strings.Contains(logged(), "lease journal stopped") {
		if time.Now().After(deadline) {
			t.Fatalf("no warning while the agent runs that the journal stopped; logged %q", logged())
		}
		time.Sleep(10 * time.Millisecond)
	}
	_ = stop()
}
