package topology_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/allot-dev/allot/examples"
	"github.com/allot-dev/allot/pkg/allocator"
	"github.com/allot-dev/allot/pkg/topology"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// TestRegionProcesses starts an allocator and one region as real processes
// (redis-server + regionagent), decides a request through the agent, and
// stops the agent with SIGTERM: it exits cleanly after handing its unspent
// tokens back to the allocator.
func TestRegionProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and starts processes")
	}
	if _, err := exec.LookPath("redis-server"); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("redis-server not installed")
		}
		t.Skip("redis-server not installed")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	root, err := topology.ModuleRoot(wd)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	bins := binDir(t, root)
	allocs, err := topology.StartAllocators(ctx, topology.AllocatorConfig{Nodes: 1, Bin: filepath.Join(bins, "allocator"), Dir: dir + "/alloc",
		ExtraArgs: []string{"-log-level", "warn", "-lease-margin", "50ms"}})
	if err != nil {
		t.Fatal(err)
	}
	defer allocs.Close(5 * time.Second)
	client, err := allocator.NewClient(allocs.Endpoints())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client.Operator().PublishPolicy(ctx, &allotv1.PublishPolicyRequest{
		Document: examples.Northstar, ExpectedVersion: 1, Author: "test", Reason: "region process test",
	}); err != nil {
		t.Fatal(err)
	}
	r, err := topology.StartRegion(ctx, topology.RegionConfig{
		Name: "eu", AgentBin: filepath.Join(bins, "regionagent"), Dir: dir + "/eu", AllocatorEndpoints: allocs.Endpoints(),
		AgentArgs: []string{"-log-level", "warn", "-lease-margin", "50ms", "-starve-wait", "5s"},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close(5 * time.Second)
	if err := r.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	// The agent took its key salt from the environment StartRegion gave it:
	// on Redis without one it would have warned at start.
	salt := agentKeySalt(t, r.Agent)
	if salt == "" || strings.Contains(r.Agent.Output(), "without a secret salt") {
		t.Fatalf("agent on Redis with $ALLOT_KEY_SALT %q; logged %s", salt, r.Agent.Output())
	}
	// A route outside P-GLOBAL and P-READ: only Birch's minute quota applies.
	// (P-GLOBAL's 1 s window cannot be leased in time when a loaded machine
	// makes Acquire slower than the window, which is not what this tests.)
	req := &allotv1.CheckRequest{Entries: []*allotv1.DescriptorEntry{
		{Key: "auth", Value: "token"}, {Key: "tenant", Value: "birch"}, {Key: "user", Value: "b1"}, {Key: "route", Value: "GET /orders"},
	}}
	resp, err := r.Client().Check(ctx, connect.NewRequest(req))
	if err != nil {
		t.Fatal(err)
	}
	if !resp.Msg.Allowed || resp.Msg.PolicyVersion != 1 {
		t.Fatalf("Check: %+v, want allowed under v1; agent output:\n%s", resp.Msg, r.Agent.Output())
	}
	before, err := client.Operator().GetWindow(ctx, &allotv1.GetWindowRequest{Quota: "p-tenant-birch"})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.Agent.Stop(10 * time.Second); err != nil {
		t.Fatalf("agent did not stop cleanly: %v\n%s", err, r.Agent.Output())
	}
	after, err := client.Operator().GetWindow(ctx, &allotv1.GetWindowRequest{Quota: "p-tenant-birch"})
	if err != nil {
		t.Fatal(err)
	}
	if after.GetWindowIndex() != before.GetWindowIndex() {
		t.Skip("the minute window turned during the test; the release went to a closed window")
	}
	if after.GetGranted() < 1 || after.GetGranted()-after.GetReleased() != 1 {
		t.Fatalf("p-tenant-birch ledger after shutdown: granted %d released %d; want all but the 1 spent token released",
			after.GetGranted(), after.GetReleased())
	}
	// The agent restarts from its last-known-good policy, and with the same
	// key salt: its counters keep their key names.
	if err := r.StartAgent(ctx); err != nil {
		t.Fatal(err)
	}
	if again := agentKeySalt(t, r.Agent); again != salt {
		t.Fatalf("$ALLOT_KEY_SALT %q after the restart, %q before: want the same", again, salt)
	}
	if err := r.WaitReady(ctx); err != nil && !errors.Is(err, context.Canceled) {
		t.Fatal(err)
	}
}

// TestStartRegionStopsAnAgentThatNeverGetsHealthy: when the agent does not
// answer /healthz before ctx ends, StartRegion fails and returns no
// region, so it must stop the agent itself: nothing else could.
func TestStartRegionStopsAnAgentThatNeverGetsHealthy(t *testing.T) {
	// A stand-in agent that ignores its flags and never listens. Its pid
	// file says which process to look for afterwards.
	dir := t.TempDir()
	pidFile := filepath.Join(dir, "agent.pid")
	bin := filepath.Join(dir, "agent.sh")
	script := "#!/bin/sh\necho $$ > " + pidFile + "\nexec sleep 60\n"
	if err := os.WriteFile(bin, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 500*time.Millisecond)
	defer cancel()
	r, err := topology.StartRegion(ctx, topology.RegionConfig{Name: "eu", AgentBin: bin, Dir: dir, EmbeddedStore: true})
	if err == nil {
		_ = r.Close(time.Second)
		t.Fatal("StartRegion succeeded with an agent that never answers")
	}
	raw, rerr := os.ReadFile(pidFile)
	if rerr != nil {
		t.Fatalf("the stand-in agent never ran: %v (StartRegion: %v)", rerr, err)
	}
	pid, _ := strconv.Atoi(strings.TrimSpace(string(raw)))
	deadline := time.Now().Add(5 * time.Second)
	for syscall.Kill(pid, 0) == nil {
		if time.Now().After(deadline) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
			t.Fatalf("agent %d still running after StartRegion failed (%v)", pid, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestRegionAgentGetsAKeySalt: StartRegion gives the agent a secret key
// salt in its environment ($ALLOT_KEY_SALT), never on its command line
// (which ps shows): a random one per region unless RegionConfig.KeySalt
// names it. The agents used to run without one, so the demo and the chaos
// suite ran with principals recoverable from the Redis key names.
func TestRegionAgentGetsAKeySalt(t *testing.T) {
	// A stand-in agent that writes its key salt and arguments beside itself
	// (named by its -region) and exits.
	dir := t.TempDir()
	bin := filepath.Join(dir, "agent.sh")
	script := "#!/bin/sh\nprintf '%s' \"$ALLOT_KEY_SALT\" > \"$0.$2.salt\"\nprintf '%s ' \"$@\" > \"$0.$2.args\"\nexit 1\n"
	if err := os.WriteFile(bin, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	started := func(cfg topology.RegionConfig) (salt, args string) {
		t.Helper()
		cfg.AgentBin, cfg.Dir, cfg.EmbeddedStore = bin, filepath.Join(dir, cfg.Name), true
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if r, err := topology.StartRegion(ctx, cfg); err == nil {
			_ = r.Close(time.Second)
			t.Fatal("StartRegion succeeded with an agent that exits")
		}
		s, err := os.ReadFile(bin + "." + cfg.Name + ".salt")
		if err != nil {
			t.Fatalf("the stand-in agent never ran: %v", err)
		}
		a, err := os.ReadFile(bin + "." + cfg.Name + ".args")
		if err != nil {
			t.Fatal(err)
		}
		return string(s), string(a)
	}
	eu, euArgs := started(topology.RegionConfig{Name: "eu"})
	us, usArgs := started(topology.RegionConfig{Name: "us"})
	if len(eu) < 16 || len(us) < 16 || eu == us {
		t.Fatalf("$ALLOT_KEY_SALT of eu's and us's agents: %q and %q, want a random secret each", eu, us)
	}
	for _, args := range []string{euArgs, usArgs} {
		if strings.Contains(args, "-key-salt") || strings.Contains(args, eu) || strings.Contains(args, us) {
			t.Fatalf("agent arguments %q: want the salt only in the environment", args)
		}
	}
	if ap, _ := started(topology.RegionConfig{Name: "ap", KeySalt: "the-region-s-own"}); ap != "the-region-s-own" {
		t.Fatalf("$ALLOT_KEY_SALT %q with RegionConfig.KeySalt set, want it", ap)
	}
}

// agentKeySalt is the $ALLOT_KEY_SALT p was started with, read from
// /proc/<pid>/environ ("" elsewhere than Linux, where the test is then
// skipped).
func agentKeySalt(t *testing.T, p *topology.Process) string {
	t.Helper()
	if runtime.GOOS != "linux" {
		t.Skip("reads /proc/<pid>/environ")
	}
	b, err := os.ReadFile("/proc/" + strconv.Itoa(p.Pid()) + "/environ")
	if err != nil {
		t.Fatal(err)
	}
	for kv := range strings.SplitSeq(string(b), "\x00") {
		if v, ok := strings.CutPrefix(kv, "ALLOT_KEY_SALT="); ok {
			return v
		}
	}
	return ""
}
