package main

import (
	"context"
	"io"
	"strings"
	"testing"

	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/agent"
)

func TestLocalRedis(t *testing.T) {
	for addr, want := range map[string]bool{
		"":                   true, // the private server
		"127.0.0.1:6379":     true,
		"127.0.0.5:6379":     true,
		"localhost:6379":     true,
		"[::1]:6379":         true,
		"10.0.0.7:6379":      false,
		"redis.internal:637": false,
		"no-port":            false,
	} {
		if got := localRedis(addr); got != want {
			t.Errorf("localRedis(%q) = %v, want %v", addr, got, want)
		}
	}
}

func TestBadFlagsAreRefused(t *testing.T) {
	for _, tt := range []struct{ args, want string }{
		{"-procs -1", "-procs: -1 is negative"},
		{"-suite nope", `-suite: "nope"`},
		// The batcher flags reach the agent suite, over the agent's defaults.
		{"-suite agent -batch-delay 11ms", "BatchDelay must be in [0, 10ms], got 11ms"},
		{"-suite agent -pipelines 0", "MaxPipelines must be at least 1, got 0"},
		{"-bracket", "-bracket: only with -suite agent"},
		{"-repeat 0", "-repeat: 0 is not between 1 and 100"},
		{"-repeat 3", "-repeat: only with -suite admission and a -mode list"},
		{"-suite agent -mode raw -repeat 2", "-repeat: only with -suite admission"},
	} {
		err := run(context.Background(), strings.Fields(tt.args), io.Discard, io.Discard)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("allotbench %s: %v, want an error containing %q", tt.args, err, tt.want)
		}
	}
}

// TestAgentSuiteUsesTheAgentsBatcher: -suite agent measures the agent's own
// store defaults (agent.DefaultStoreConfig) unless a flag sets them, and
// says which it used.
func TestAgentSuiteUsesTheAgentsBatcher(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a redis-server")
	}
	for _, tt := range []struct{ args, want string }{
		{"-suite agent", "a partial batch waits up to " + agent.DefaultStoreConfig().BatchDelay.String()},
		{"-suite agent -batch-delay 0", "a partial batch waits up to 0s"},
		{"-suite admission", "a partial batch waits up to " + admission.DefaultRedisConfig().BatchDelay.String()},
	} {
		var out strings.Builder
		args := append(strings.Fields(tt.args), "-mode", "raw", "-requests", "200", "-duration", "1s", "-warmup", "0s")
		if err := run(context.Background(), args, &out, io.Discard); err != nil {
			t.Fatalf("allotbench %s: %v", tt.args, err)
		}
		if !strings.Contains(out.String(), tt.want) {
			t.Errorf("allotbench %s printed:\n%s\nwant %q", tt.args, out.String(), tt.want)
		}
	}
}
