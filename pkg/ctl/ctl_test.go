package ctl

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/hashicorp/raft"

	"github.com/allot-dev/allot/examples"
	"github.com/allot-dev/allot/pkg/allocator"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
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
		{"bound", []string{"bound"}, []string{"p-tenant-atlas: G=1000", "carry_over", "fallback", "store_fallback", "lost_grants", "HOW TO MAKE IT 0"}, ""},
		// P-GLOBAL fails over to fallback_per_region 2,000 in each of two
		// regions' agents and again in their gateways: +8,000. One gateway
		// a region (the default -gateways-per-region) parks 100.
		{"bound one", []string{"bound", "p-global"}, []string{"p-global: G=40000 per 1s; admitted per window <= 48000 (overshoot 8000)",
			"store_fallback", "200 parked in gateways"}, ""},
		{"window", []string{"window", "p-tenant-atlas"}, []string{"p-tenant-atlas window", "limit 1000", "remaining 1000"}, ""},
		{"cluster", []string{"cluster"}, []string{"answered by c1 (Leader)", "c1", "\ncluster "}, ""},
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
	dir := publishTwoVersions(t, addr)
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
	out, err = runCtl(t, addr, "policy", "diff", filepath.Join(dir, "northstar.yaml"))
	if err != nil || !strings.Contains(out, "no changes against version 3") {
		t.Fatalf("version 3 against version 1's file: %v\n%s", err, out)
	}
	out, err = runCtl(t, addr, "window", "p-tenant-atlas")
	if err != nil || !strings.Contains(out, "limit 1000") {
		t.Fatalf("window after the rollback: %v\n%s", err, out)
	}
}

// noCalls returns the address of a listener that fails the test if anything
// connects to it: arguments that are refused are refused before the network.
func noCalls(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var conns atomic.Int32
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns.Add(1)
			_ = c.Close()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		if n := conns.Load(); n > 0 {
			t.Errorf("%d connections to the allocator, want none", n)
		}
	})
	return ln.Addr().String()
}

// wantUsage fails unless err is a usage error containing each of want.
func wantUsage(t *testing.T, err error, out string, want ...string) {
	t.Helper()
	if !errors.Is(err, ErrUsage) {
		t.Errorf("got err %v, want a usage error (output %q)", err, out)
		return
	}
	for _, w := range want {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("got err %q, want one containing %q", err, w)
		}
	}
}

// TestCtlMemberAddValidatesAddresses: a member's addresses must be
// host:port, checked before the allocator is called: a voter with an
// unusable address can cost the cluster its quorum.
func TestCtlMemberAddValidatesAddresses(t *testing.T) {
	addr := noCalls(t)
	for _, bad := range []string{"not an addr", "", "host", ":8000", "host:", "host:0", "host:65536", "host:http", "host:-1", "a:b:c"} {
		out, err := runCtl(t, addr, "-timeout", "1s", "member", "add", "n4", bad, "127.0.0.1:8004")
		wantUsage(t, err, out, "RAFT_ADDR", strconv.Quote(bad))
		out, err = runCtl(t, addr, "-timeout", "1s", "member", "add", "n4", "127.0.0.1:7004", bad)
		wantUsage(t, err, out, "API_ADDR", strconv.Quote(bad))
	}
	for _, good := range []string{"127.0.0.1:7004", "[::1]:7004", "node-4.allot.svc:7004", "n4:1", "n4:65535"} {
		if err := allocator.CheckDialAddr(good); err != nil {
			t.Errorf("%s: %v, want it accepted", good, err)
		}
	}
}

// TestCtlMemberChangeMayHaveApplied: a membership change sent and never
// answered may have been applied; the error says so and how to check. One
// never sent (nothing listens) says nothing of the kind.
func TestCtlMemberChangeMayHaveApplied(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	go func() { // accepts, reads and never answers
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
			go func() { _, _ = io.Copy(io.Discard, c) }()
		}
	}()
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			_ = c.Close()
		}
	})
	for _, args := range [][]string{{"member", "add", "n4", "127.0.0.1:7004", "127.0.0.1:8004"}, {"member", "remove", "n4"}} {
		out, err := runCtl(t, ln.Addr().String(), append([]string{"-timeout", "300ms"}, args...)...)
		if err == nil || errors.Is(err, ErrUsage) || !strings.Contains(err.Error(), "may or may not have been applied") || !strings.Contains(err.Error(), "allotctl cluster") {
			t.Errorf("%v: got err %v, want one saying the change may have been applied (output %q)", args, err, out)
		}
	}
	dead, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	_ = dead.Close()
	out, err := runCtl(t, dead.Addr().String(), "-timeout", "300ms", "member", "remove", "n4")
	if err == nil || strings.Contains(err.Error(), "may or may not") {
		t.Errorf("member remove, never sent: got err %v, want one not saying it may have been applied (output %q)", err, out)
	}
	for _, tt := range []struct {
		err   error
		maybe bool
	}{
		{connect.NewError(connect.CodeUnavailable, errors.New("connection reset")), true},
		{connect.NewError(connect.CodeDeadlineExceeded, errors.New("late")), true},
		{fmt.Errorf("%w (last error: unavailable: EOF)", context.DeadlineExceeded), true},
		{connect.NewError(connect.CodeInvalidArgument, errors.New("raft_address: bad")), false},
		{connect.NewError(connect.CodeFailedPrecondition, errors.New("not the leader")), false},
	} {
		got := strings.Contains(maybeApplied("member add", true, tt.err).Error(), "may or may not")
		if got != tt.maybe {
			t.Errorf("%v: says it may have been applied: %v, want %v", tt.err, got, tt.maybe)
		}
		if strings.Contains(maybeApplied("member add", false, tt.err).Error(), "may or may not") {
			t.Errorf("%v, never sent: says it may have been applied", tt.err)
		}
	}
}

// TestCtlRefusesUnexpectedArguments: every command refuses an argument it
// does not take, naming it, before the network; a flag after the command
// gets the hint that global flags go before it.
func TestCtlRefusesUnexpectedArguments(t *testing.T) {
	addr := noCalls(t)
	file := filepath.Join(t.TempDir(), "northstar.yaml")
	if err := os.WriteFile(file, examples.Northstar, 0o600); err != nil {
		t.Fatal(err)
	}
	const hint = "go before the command"
	for _, tt := range []struct {
		args []string
		want []string
	}{
		{[]string{"cluster", "extra"}, []string{`"extra"`}},
		{[]string{"cluster", "-o", "json"}, []string{"-o", hint}},
		{[]string{"bound", "-o", "json"}, []string{"-o", hint}},
		{[]string{"bound", "p-global", "-o", "json"}, []string{"-o", hint}},
		{[]string{"bound", "p-global", "extra"}, []string{`"extra"`}},
		{[]string{"window", "p-global", "extra"}, []string{`"extra"`}},
		{[]string{"window", "p-global", "-timeout", "1s"}, []string{"-timeout", hint}},
		{[]string{"policy", "list", "extra"}, []string{`"extra"`}},
		{[]string{"policy", "list", "-addr", "x:1"}, []string{"-addr", hint}},
		{[]string{"policy", "list", "-version", "1"}, []string{`"-version"`, "global flags -addr, -o and -timeout go before the command"}},
		{[]string{"policy", "get", "1", "2"}, []string{`"2"`}},
		{[]string{"policy", "get", "latest"}, []string{`"latest"`}},
		{[]string{"policy", "get", "1", "-version", "2"}, []string{"version"}},
		{[]string{"policy", "get", "-author", "x"}, []string{"-author"}},
		{[]string{"policy", "publish", file, "extra", "-author", "a", "-reason", "r"}, []string{`"extra"`}},
		{[]string{"policy", "publish", "-author", "a"}, []string{"FILE"}},
		{[]string{"policy", "diff", file, "extra"}, []string{`"extra"`}},
		{[]string{"policy", "diff", file, "-reason", "r"}, []string{"-reason"}},
		{[]string{"policy"}, []string{"publish, get, list or diff"}},
		{[]string{"policy", "frobnicate"}, []string{`"frobnicate"`}},
		{[]string{"member", "remove", "n4", "extra"}, []string{`"extra"`}},
		{[]string{"member", "add", "n4", "127.0.0.1:7004", "127.0.0.1:8004", "extra"}, []string{`"extra"`}},
		{[]string{"member", "add", "n4", "127.0.0.1:7004"}, []string{"API_ADDR"}},
		{[]string{"member", "remove", "-o", "json"}, []string{"-o", hint}},
		{[]string{"member"}, []string{"add", "remove"}},
		{[]string{"member", "list"}, []string{`"list"`}},
		{[]string{"frobnicate"}, []string{"unknown command"}},
		{[]string{"-bogus", "cluster"}, []string{"-bogus"}},
	} {
		out, err := runCtl(t, addr, append([]string{"-timeout", "1s"}, tt.args...)...)
		wantUsage(t, err, out, tt.want...)
	}
}

// TestCtlPolicyGetVersionArgument: `policy get N` prints version N, as
// `policy get -version N` does, not the current one.
func TestCtlPolicyGetVersionArgument(t *testing.T) {
	addr := startNode(t)
	publishTwoVersions(t, addr)
	for _, args := range [][]string{{"policy", "get", "1"}, {"policy", "get", "-version", "1"}} {
		out, err := runCtl(t, addr, args...)
		if err != nil || !strings.Contains(out, "# version 1 by alice") {
			t.Errorf("%v: %v, want version 1:\n%s", args, err, out)
		}
	}
	if out, err := runCtl(t, addr, "policy", "get"); err != nil || !strings.Contains(out, "# version 2 by alice") {
		t.Errorf("policy get: %v, want the current version 2:\n%s", err, out)
	}
}

// TestCtlValidatesGlobalFlags: a timeout that is not positive and an empty
// address are usage errors before the network, not deadline_exceeded or
// "no Host in request URL".
func TestCtlValidatesGlobalFlags(t *testing.T) {
	addr := noCalls(t)
	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{"-addr", addr, "-timeout", "-1s", "cluster"}, "-timeout must be positive, got -1s"},
		{[]string{"-addr", addr, "-timeout", "0", "cluster"}, "-timeout must be positive, got 0s"},
		{[]string{"-addr", "", "cluster"}, "-addr: no address given"},
		{[]string{"-addr", ",,", "cluster"}, "-addr: no address given"},
		{[]string{"-addr", addr + ",," + addr, "cluster"}, "-addr: address 2 of 3 is empty"},
		{[]string{"-addr", addr + ",", "cluster"}, "-addr: address 2 of 2 is empty"},
		{[]string{"-addr", "http://", "cluster"}, `"http://"`},
		{[]string{"-addr", "localhost", "cluster"}, `"localhost"`},
	} {
		var out, errOut bytes.Buffer
		err := Main(context.Background(), tt.args, &out, &errOut)
		wantUsage(t, err, out.String()+errOut.String(), tt.want)
	}
	for _, a := range []string{addr, " " + addr + " ", "http://" + addr, addr + "," + addr} {
		var out, errOut bytes.Buffer
		err := Main(context.Background(), []string{"-addr", a, "-timeout", "1s", "frobnicate"}, &out, &errOut)
		if err == nil || !strings.Contains(err.Error(), "unknown command") {
			t.Errorf("-addr %q: %v, want it accepted", a, err)
		}
	}
}

// TestCtlHelp: -h is not an error of the command line; cmd/allotctl exits 0.
func TestCtlHelp(t *testing.T) {
	for _, args := range [][]string{{"-h"}, {"policy", "get", "-h"}, {"cluster", "-h"}} {
		var out, errOut bytes.Buffer
		err := Main(context.Background(), args, &out, &errOut)
		if !errors.Is(err, flag.ErrHelp) || !strings.Contains(errOut.String(), "usage: allotctl") {
			t.Errorf("%v: %v, want flag.ErrHelp and the usage (output %q)", args, err, errOut.String())
		}
	}
}

// publishTwoVersions publishes Northstar (version 1) and a copy with Atlas's
// limit lowered to 800 (version 2) from files in a temporary directory,
// which it returns (northstar.yaml, tighter.yaml).
func publishTwoVersions(t *testing.T, addr string) string {
	t.Helper()
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
	return dir
}

// TestCtlWindowShowsCarried: after a publish that changes a quota's window
// length, `allotctl window` shows the leases regions still hold from before
// as carried, so that its remaining adds up (1000 - 100 carried).
func TestCtlWindowShowsCarried(t *testing.T) {
	addr := startNode(t)
	dir := t.TempDir()
	v1 := filepath.Join(dir, "v1.yaml")
	if err := os.WriteFile(v1, examples.Northstar, 0o600); err != nil {
		t.Fatal(err)
	}
	rule := []byte("    limit: 1000\n    window: 1m\n")
	if !bytes.Contains(examples.Northstar, rule) {
		t.Fatal("the example's P-TENANT rule changed: update this test")
	}
	v2 := filepath.Join(dir, "v2.yaml")
	if err := os.WriteFile(v2, bytes.Replace(examples.Northstar, rule, []byte("    limit: 1000\n    window: 2m\n"), 1), 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := runCtl(t, addr, "policy", "publish", v1, "-author", "a", "-reason", "r"); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	c, err := allocator.NewClient([]string{addr})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := c.Acquire(ctx, &allotv1.AcquireRequest{Region: "eu", RequestId: "r1", Wants: []*allotv1.Want{{Quota: "p-tenant-atlas", Tokens: 100}}})
	if err != nil || len(resp.GetGrants()) != 1 || resp.GetGrants()[0].GetTokens() != 100 {
		t.Fatalf("acquire: %v %v", resp, err)
	}
	out, err := runCtl(t, addr, "window", "p-tenant-atlas")
	if err != nil || strings.Contains(out, "carried") {
		t.Fatalf("before the window change: %v\n%s", err, out)
	}
	if out, err := runCtl(t, addr, "policy", "publish", v2, "-author", "a", "-reason", "longer window"); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	out, err = runCtl(t, addr, "window", "p-tenant-atlas")
	if err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	// The lease (TTL 15 s) is live: the new window leaves room for it,
	// unless this test took 15 s to get here.
	for _, w := range []string{"remaining 900", "carried 100"} {
		if !strings.Contains(out, w) {
			t.Errorf("output lacks %q:\n%s", w, out)
		}
	}
}

// TestCtlFlagErrorsPrintedOnce: a flag error is returned once, without the
// flag package's own copy of it and of the whole usage before it; -h and
// an unknown command still print the usage.
func TestCtlFlagErrorsPrintedOnce(t *testing.T) {
	addr := noCalls(t)
	file := filepath.Join(t.TempDir(), "northstar.yaml")
	if err := os.WriteFile(file, examples.Northstar, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tt := range []struct {
		args []string
		want string
	}{
		{[]string{"-bogus", "cluster"}, "flag provided but not defined: -bogus"},
		{[]string{"-timeout", "soon", "cluster"}, `invalid value "soon" for flag -timeout`},
		{[]string{"policy", "publish", file, "-author", "a", "-reason", "r", "-timeout", "3s"},
			`policy publish: unexpected argument "-timeout": global flags go before the command (allotctl -timeout ... policy publish ...)`},
		{[]string{"window", "p-global", "-index", "x"}, `window: invalid value "x" for flag -index`},
	} {
		var out, errOut bytes.Buffer
		err := Main(context.Background(), append([]string{"-addr", addr}, tt.args...), &out, &errOut)
		wantUsage(t, err, out.String()+errOut.String(), tt.want)
		if out.Len()+errOut.Len() > 0 {
			t.Errorf("%v: printed %q, want nothing but the error returned", tt.args, out.String()+errOut.String())
		}
		if UsageShown(err) {
			t.Errorf("%v: UsageShown, want a pointer to -h", tt.args)
		}
	}
	var out, errOut bytes.Buffer
	err := Main(context.Background(), []string{"-addr", addr, "frobnicate"}, &out, &errOut)
	if !UsageShown(err) || strings.Count(errOut.String(), "usage: allotctl") != 1 {
		t.Errorf("unknown command: %v, UsageShown %v, want the usage once (output %q)", err, UsageShown(err), errOut.String())
	}
}

// TestCtlPolicyVersionNeverPublished: a version past the current one was
// never published, and the error says so (the allocator says "not
// retained" of it); version 0 is refused before the network: versions
// start at 1.
func TestCtlPolicyVersionNeverPublished(t *testing.T) {
	empty := startNode(t)
	if _, err := runCtl(t, empty, "policy", "get", "-version", "3"); err == nil ||
		!strings.Contains(err.Error(), "policy get: version 3 was never published: no policy has been published yet") {
		t.Errorf("get -version 3 before any publish: %v", err)
	}
	addr := startNode(t)
	dir := publishTwoVersions(t, addr)
	for _, args := range [][]string{
		{"policy", "get", "-version", "99"},
		{"policy", "get", "99"},
		{"policy", "diff", filepath.Join(dir, "northstar.yaml"), "-version", "99"},
	} {
		_, err := runCtl(t, addr, args...)
		want := args[0] + " " + args[1] + ": version 99 was never published (the current version is 2)"
		if err == nil || err.Error() != want {
			t.Errorf("%v: got err %v, want %q", args, err, want)
		}
	}
	out, err := runCtl(t, noCalls(t), "policy", "get", "0")
	wantUsage(t, err, out, "policy get: no version 0: versions start at 1")
}

// TestCtlWindowWithoutGrants: the previous window, and the next one before
// anything is pre-granted from it, have no ledger when nobody was granted
// from them; the error says they had no grants, not that they are not
// retained. An older window is not retained.
func TestCtlWindowWithoutGrants(t *testing.T) {
	addr := startNode(t)
	publishTwoVersions(t, addr)
	current := func() int64 {
		t.Helper()
		out, err := runCtl(t, addr, "-o", "json", "window", "p-tenant-atlas")
		if err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
		var w struct {
			WindowIndex string `json:"windowIndex"`
		}
		if err := json.Unmarshal([]byte(out), &w); err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
		n, err := strconv.ParseInt(w.WindowIndex, 10, 64)
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	for _, tt := range []struct {
		offset int64
		want   string
	}{
		{-1, "(the previous window, ["},
		{-1, ")) had no grants: the allocator keeps no ledger of a window nobody was granted from"},
		{1, "(the next window, ["},
		{1, ")) has no grants yet"},
		{-3, "not retained"},
	} {
		// A window may end between the calls: try again when it did.
		for try := 0; ; try++ {
			cur := current()
			idx := cur + tt.offset
			_, err := runCtl(t, addr, "window", "p-tenant-atlas", "-index", strconv.FormatInt(idx, 10))
			if cur != current() && try < 3 {
				continue
			}
			want := fmt.Sprintf("window: p-tenant-atlas window %d ", idx)
			if tt.offset == -3 {
				want = ""
			}
			if err == nil || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("-index current%+d: got err %v, want one containing %q and %q", tt.offset, err, want, tt.want)
			}
			break
		}
	}
}
