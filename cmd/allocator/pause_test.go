package main

import (
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/allot-dev/allot/internal/pausewatch/pausetest"
	"github.com/allot-dev/allot/pkg/topology"
)

// TestPauseIsReported stops a running single-node allocator (SIGSTOP) and
// continues it: it logs the pause as a warning with its length and counts it
// in allot_allocator_process_pause_seconds.
func TestPauseIsReported(t *testing.T) {
	var addrs [2]string
	for i := range addrs {
		a, err := topology.FreePort("127.0.0.1")
		if err != nil {
			t.Fatal(err)
		}
		addrs[i] = a
	}
	api, raft := addrs[0], addrs[1]
	cmd, out := pausetest.Start(t, "ALLOCATOR_RUN_MAIN=1", fmt.Sprintf("ALLOCATOR_ARGS=-id a1 -raft-addr %s -api-addr %s -data-dir %s -bootstrap -peer a1=%s=%s -log-level warn",
		raft, api, t.TempDir(), raft, api))
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
	pausetest.CheckStop(t, cmd, out, "http://"+api+"/metrics", "allot_allocator_process_pause_seconds")
}
