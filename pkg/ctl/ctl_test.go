package ctl

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"

	"github.com/allot-dev/allot/examples"
	"github.com/allot-dev/allot/pkg/allocator"
)

// startNode runs a single-node allocator in-process (in-memory Raft, real
// Connect API on loopback) and returns its address.
func startNode(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	cfg := allocator.DefaultConfig()
	cfg.NodeID, cfg.RaftAddr, cfg.APIAddr, cfg.Bootstrap = "c1", "c1", ln.Addr().String(), true
	cfg.HeartbeatTimeout, cfg.ElectionTimeout, cfg.LeaderLeaseTimeout = 50*time.Millisecond, 50*time.Millisecond, 50*time.Millisecond
	_, tr := raft.NewInmemTransport("c1")
	store := raft.NewInmemStore()
	node, err := allocator.NewNode(cfg, allocator.WithRaftDeps(allocator.RaftDeps{Logs: store, Stable: store, Snapshots: raft.NewInmemSnapshotStore(), Transport: tr}))
	if err != nil {
		t.Fatal(err)
	}
	srv := allocator.HTTPServer(cfg.APIAddr, allocator.Mux(allocator.NewServer(node, nil, allocator.NewMetrics(nil)), nil))
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() {
		_ = srv.Close()
		_ = node.Close()
	})
	for deadline := time.Now().Add(5 * time.Second); !node.IsLeader(); {
		if time.Now().After(deadline) {
			t.Fatal("no leader")
		}
		time.Sleep(10 * time.Millisecond)
	}
	return cfg.APIAddr
}

func runCtl(t *testing.T, addr string, args ...string) (string, error) {
	t.Helper()
	var out, errOut bytes.Buffer
	err := Main(context.Background(), append([]string{"-addr", addr}, args...), &out, &errOut)
	return out.String() + errOut.String(), err
}

func TestCtlAgainstAllocator(t *testing.T) {
	addr := startNode(t)
	dir := t.TempDir()
	northstar := filepath.Join(dir, "northstar.yaml")
	if err := os.WriteFile(northstar, examples.Northstar, 0o600); err != nil {
		t.Fatal(err)
	}
	tighter := filepath.Join(dir, "tighter.yaml")
	if err := os.WriteFile(tighter, bytes.Replace(examples.Northstar, []byte("limit: 1000\n"), []byte("limit: 800\n"), 1), 0o600); err != nil {
		t.Fatal(err)
	}
	broken := filepath.Join(dir, "broken.yaml")
	if err := os.WriteFile(broken, bytes.Replace(examples.Northstar, []byte("cost: 10"), []byte("cost: 30"), 1), 0o600); err != nil {
		t.Fatal(err)
	}

	tests := []struct {
		name    string
		args    []string
		want    []string
		wantErr string
	}{
		{"publish", []string{"policy", "publish", northstar, "-author", "alice", "-reason", "initial"}, []string{"published version 1", "alice", "initial"}, ""},
		{"publish invalid names the field", []string{"policy", "publish", broken, "-author", "a", "-reason", "r"}, nil, "cost"},
		{"get", []string{"policy", "get"}, []string{"# version 1 by alice", "p-tenant-atlas"}, ""},
		{"list", []string{"policy", "list"}, []string{"VERSION", "alice", "initial"}, ""},
		{"diff", []string{"policy", "diff", tighter}, []string{"p-tenant-atlas", "1000", "800"}, ""},
		{"diff none", []string{"policy", "diff", northstar}, []string{"no changes against version 1"}, ""},
		{"bound", []string{"bound"}, []string{"p-tenant-atlas: G=1000", "carry_over", "fallback", "lost_grants", "HOW TO MAKE IT 0"}, ""},
		{"bound one", []string{"bound", "p-global"}, []string{"p-global: G=40000"}, ""},
		{"window", []string{"window", "p-tenant-atlas"}, []string{"p-tenant-atlas window", "limit 1000", "remaining 1000"}, ""},
		{"cluster", []string{"cluster"}, []string{"answered by c1 (Leader)", "c1"}, ""},
		{"stale publish", []string{"policy", "publish", tighter, "-version", "1", "-author", "a", "-reason", "r"}, nil, "failed_precondition"},
		{"unknown quota", []string{"window", "nope"}, nil, "not_found"},
		{"window without quota", []string{"window"}, nil, "QUOTA"},
		{"unknown command", []string{"frobnicate"}, nil, "unknown command"},
		{"bad output flag", []string{"-o", "yaml", "cluster"}, nil, "-o"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, err := runCtl(t, addr, tt.args...)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("got err %v, want one containing %q (output %q)", err, tt.wantErr, out)
				}
				return
			}
			if err != nil {
				t.Fatalf("%v\n%s", err, out)
			}
			for _, w := range tt.want {
				if !strings.Contains(out, w) {
					t.Errorf("output lacks %q:\n%s", w, out)
				}
			}
		})
	}

	// -o json is machine-readable.
	out, err := runCtl(t, addr, "-o", "json", "bound", "p-tenant-atlas")
	if err != nil {
		t.Fatal(err)
	}
	var parsed struct {
		PolicyVersion string `json:"policyVersion"`
		Bounds        []struct {
			Quota                string `json:"quota"`
			MaxAdmittedPerWindow string `json:"maxAdmittedPerWindow"`
		} `json:"bounds"`
	}
	if err := json.Unmarshal([]byte(out), &parsed); err != nil {
		t.Fatalf("json output: %v\n%s", err, out)
	}
	if len(parsed.Bounds) != 1 || parsed.Bounds[0].Quota != "p-tenant-atlas" || parsed.Bounds[0].MaxAdmittedPerWindow != "1000" {
		t.Errorf("json bound: %+v", parsed)
	}
}

// TestCtlRollback is the operator's rollback (docs/operations.md): what
// `policy get -version N` prints is a file `policy publish` takes, so an old
// version comes back as a new, higher one with the same rules.
func TestCtlRollback(t *testing.T) {
	addr := startNode(t)
	dir := t.TempDir()
	northstar := filepath.Join(dir, "northstar.yaml")
	tighter := filepath.Join(dir, "tighter.yaml")
	if err := os.WriteFile(northstar, examples.Northstar, 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(tighter, bytes.Replace(examples.Northstar, []byte("limit: 1000\n"), []byte("limit: 800\n"), 1), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{northstar, tighter} {
		if out, err := runCtl(t, addr, "policy", "publish", f, "-author", "alice", "-reason", "plan"); err != nil {
			t.Fatalf("publish %s: %v\n%s", f, err, out)
		}
	}
	old, err := runCtl(t, addr, "policy", "get", "-version", "1")
	if err != nil {
		t.Fatalf("get version 1: %v\n%s", err, old)
	}
	saved := filepath.Join(dir, "v1.yaml")
	if err := os.WriteFile(saved, []byte(old), 0o600); err != nil {
		t.Fatal(err)
	}
	out, err := runCtl(t, addr, "policy", "publish", saved, "-author", "bob", "-reason", "rollback to v1")
	if err != nil || !strings.Contains(out, "published version 3") {
		t.Fatalf("publish the saved version 1: %v\n%s", err, out)
	}
	out, err = runCtl(t, addr, "policy", "diff", northstar)
	if err != nil || !strings.Contains(out, "no changes against version 3") {
		t.Fatalf("version 3 against version 1's file: %v\n%s", err, out)
	}
	out, err = runCtl(t, addr, "window", "p-tenant-atlas")
	if err != nil || !strings.Contains(out, "limit 1000") {
		t.Fatalf("window after the rollback: %v\n%s", err, out)
	}
}
