package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/allot-dev/allot/internal/pausewatch/pausetest"
)

// TestMain runs the agent itself when the test binary is re-executed by
// TestPauseIsReported.
func TestMain(m *testing.M) {
	if args, ok := os.LookupEnv("REGIONAGENT_ARGS"); ok {
		os.Args = append([]string{"regionagent"}, strings.Fields(args)...)
		main()
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestPauseIsReported stops a running agent process (SIGSTOP) and continues
// it: the agent logs the pause as a warning with its length and counts it
// in allot_agent_process_pause_seconds. This is what tells, after the fact,
// that a process rather than the network stalled.
func TestPauseIsReported(t *testing.T) {
	pf := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(pf, []byte(standalonePolicy), 0o600); err != nil {
		t.Fatal(err)
	}
	api := freeAddr(t)
	cmd, out := pausetest.Start(t, "REGIONAGENT_ARGS=-region eu -store embedded -policy "+pf+" -api-addr "+api+" -log-level warn")
	if err := waitReady(api); err != nil {
		t.Fatal(err)
	}
	pausetest.CheckStop(t, cmd, out, "http://"+api+"/metrics", "allot_agent_process_pause_seconds")
}
