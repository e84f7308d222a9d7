package agent_test

import (
	"context"
	"os"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/allot-dev/allot/internal/redistest"
	"github.com/allot-dev/allot/pkg/bench"
)

// benchEnabled gates the heavy measurements: they take minutes and the
// whole machine. Run them once, on an idle machine:
//
//	ALLOT_AGENT_BENCH=1 go test ./pkg/agent -run 'TestAgentBenchSuite|TestRenewalTraffic' -v -timeout 20m
//
// ALLOT_AGENT_BENCH_DURATION=2s shortens each mode for a smoke run, and
// ALLOT_AGENT_BENCH_MODES=raw,envoy picks modes.
func benchEnabled(t *testing.T) {
	if os.Getenv("ALLOT_AGENT_BENCH") == "" {
		t.Skip("set ALLOT_AGENT_BENCH=1 to run the agent benchmarks")
	}
}

// TestAgentBenchSuite measures, in one run on one Redis with 64 callers
// over 10,000 keys, the engine's raw script ceiling (a), the agent's Check
// over Connect (c) and its Envoy RLS endpoint (d). Figures go to the test
// log (and docs/agent-bench.md).
func TestAgentBenchSuite(t *testing.T) {
	benchEnabled(t)
	srv, err := redistest.StartServer(context.Background())
	redistest.Require(t, err)
	defer srv.Close()
	cfg := bench.DefaultAgentSuiteConfig()
	if d, err := time.ParseDuration(os.Getenv("ALLOT_AGENT_BENCH_DURATION")); err == nil {
		cfg.Duration = d // a quick smoke run; the figures need the default 10 s
	}
	if m := os.Getenv("ALLOT_AGENT_BENCH_MODES"); m != "" {
		cfg.Modes = strings.Split(m, ",")
	}
	client := redis.NewClient(&redis.Options{Addr: srv.Addr(), PoolSize: cfg.Workers})
	defer client.Close()
	var out strings.Builder
	figs, err := bench.RunAgentSuite(context.Background(), client, cfg, &out)
	if err != nil {
		t.Fatal(err)
	}
	bench.SummarizeAgent(&out, figs)
	t.Logf("GOMAXPROCS %d, %d workers, %d keys, %d connections, %s\n%s", runtime.GOMAXPROCS(0), cfg.Workers, cfg.Keys,
		cfg.Connections, time.Now().UTC().Format(time.RFC3339), out.String())
	for _, f := range figs {
		if f.Errors > 0 {
			t.Errorf("%s: %d errors, first %v", f.Name, f.Errors, f.FirstErr)
		}
	}
}
