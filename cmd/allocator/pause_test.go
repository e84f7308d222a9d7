package main

import (
	"bytes"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/allot-dev/allot/internal/pausewatch/pausetest"
)

// TestPauseIsReported stops a running single-node allocator (SIGSTOP) and
// continues it: it logs the pause as a warning with its length and counts it
// in allot_allocator_process_pause_seconds.
func TestPauseIsReported(t *testing.T) {
	api, raft := freeAddr(t), freeAddr(t)
	args := fmt.Sprintf("-id a1 -raft-addr %s -api-addr %s -data-dir %s -bootstrap -peer a1=%s=%s -log-level warn",
		raft, api, t.TempDir(), raft, api)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "ALLOCATOR_RUN_MAIN=1", "ALLOCATOR_ARGS="+args)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}()
	deadline := time.Now().Add(20 * time.Second)
	for {
		resp, err := http.Get("http://" + api + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				break
			}
		}
		if time.Now().After(deadline) {
			_ = cmd.Process.Kill()
			_ = cmd.Wait()
			t.Fatalf("allocator not ready after 20 s; output:\n%s", out.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	pausetest.CheckStop(t, cmd, &out, "http://"+api+"/metrics", "allot_allocator_process_pause_seconds")
}

func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}
