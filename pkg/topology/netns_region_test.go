package topology_test

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/allot-dev/allot/pkg/allocator"
	"github.com/allot-dev/allot/pkg/topology"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// regionPolicy is one leased tenant quota for region eu.
const regionPolicy = `
name: netns-region
regions: [eu]
rules:
  - name: q
    scope: tenant
    match: [{key: tenant, value: t}]
    kind: global_quota
    limit: 100000
    window: 1h
    lease: {chunk: 50, ttl: 30s}
    fail_mode: closed
`

// TestRegionInNamespace starts an allocator and a region (redis-server and
// regionagent) each in a lab host of its own, decides through the agent
// from the region's namespace, then kills and restarts the region's Redis
// on the same address: the deposited tokens are gone, and the agent leases
// again.
func TestRegionInNamespace(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and starts processes")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	if err := topology.NetnsSupport(ctx); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("network namespaces are required in CI: %v", err)
		}
		t.Skipf("skipping: %v", err)
	}
	if _, err := exec.LookPath("redis-server"); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("redis-server not installed")
		}
		t.Skip("redis-server not installed")
	}
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	root, err := topology.ModuleRoot(wd)
	if err != nil {
		t.Fatal(err)
	}
	bins := binDir(t, root)
	lab, err := topology.NewLab(ctx, topology.LabConfig{Prefix: "allotr-", Subnet: "10.79.0", LockWait: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := lab.Close(); err != nil {
			t.Errorf("lab close: %v", err)
		}
	}()
	ah, err := lab.AddHost(ctx, "a1", 11)
	if err != nil {
		t.Fatal(err)
	}
	rh, err := lab.AddHost(ctx, "eu", 21)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	allocs, err := topology.StartAllocatorsIn(ctx, topology.AllocatorConfig{Bin: filepath.Join(bins, "allocator"), Dir: dir + "/alloc",
		ExtraArgs: []string{"-log-level", "warn", "-lease-margin", "50ms"}}, []*topology.Host{ah})
	if err != nil {
		t.Fatal(err)
	}
	defer allocs.Close(5 * time.Second)
	client, err := allocator.NewClient(allocs.Endpoints())
	if err != nil {
		t.Fatal(err)
	}
	if _, err := client.Operator().PublishPolicy(ctx, &allotv1.PublishPolicyRequest{
		Document: []byte(regionPolicy), ExpectedVersion: 1, Author: "test", Reason: "region in a namespace",
	}); err != nil {
		t.Fatal(err)
	}
	r, err := topology.StartRegion(ctx, topology.RegionConfig{
		Name: "eu", AgentBin: filepath.Join(bins, "regionagent"), Dir: dir + "/eu", AllocatorEndpoints: allocs.Endpoints(), Netns: rh,
		AgentArgs: []string{"-log-level", "warn", "-lease-margin", "50ms", "-starve-wait", "5s", "-store-timeout", "500ms"},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close(5 * time.Second)
	if r.APIAddr != rh.IP+":8081" || r.RedisAddr != "127.0.0.1:6379" {
		t.Fatalf("addresses: api %s redis %s, want %s:8081 and the namespace's loopback", r.APIAddr, r.RedisAddr, rh.IP)
	}
	if err := r.WaitReady(ctx); err != nil {
		t.Fatal(err)
	}
	// `ip netns exec` passes the key salt on to the agent.
	if salt := agentKeySalt(t, r.Agent); salt == "" || salt != r.KeySalt || strings.Contains(r.Agent.Output(), "without a secret salt") {
		t.Fatalf("agent in a namespace with $ALLOT_KEY_SALT %q (the region's: %q); logged %s", salt, r.KeySalt, r.Agent.Output())
	}
	req := &allotv1.CheckRequest{Entries: []*allotv1.DescriptorEntry{{Key: "tenant", Value: "t"}}}
	decide := func() *allotv1.CheckResponse {
		t.Helper()
		resp, err := r.Client().Check(ctx, connect.NewRequest(req))
		if err != nil {
			t.Fatalf("Check: %v\nagent output:\n%s", err, r.Agent.Output())
		}
		return resp.Msg
	}
	if m := decide(); !m.Allowed {
		t.Fatalf("Check: %+v, want allowed", m)
	}
	granted := func() int64 {
		t.Helper()
		w, err := client.Operator().GetWindow(ctx, &allotv1.GetWindowRequest{Quota: "q"})
		if err != nil {
			t.Fatal(err)
		}
		return w.GetGranted()
	}
	before := granted()
	oldPid := r.Redis.Pid()
	if err := r.RestartRedis(ctx); err != nil {
		t.Fatal(err)
	}
	if r.Redis.Pid() == oldPid || r.Redis.Exited() {
		t.Fatal("Redis was not restarted")
	}
	// The restarted Redis holds nothing: the agent must lease again.
	if m := decide(); !m.Allowed {
		t.Fatalf("Check after the Redis restart: %+v, want allowed once the agent has leased again", m)
	}
	if after := granted(); after <= before {
		t.Fatalf("granted %d after the restart, %d before: want a new lease", after, before)
	}
}
