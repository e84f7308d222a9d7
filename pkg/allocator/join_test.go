package allocator

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"go.uber.org/zap/zaptest"
)

// startedRun runs Run with cfg and ro until the test ends (or stop is
// called) and reports when its API listens.
type startedRun struct {
	ready chan struct{}
	done  chan error
	stop  context.CancelFunc
}

func runNode(t *testing.T, cfg Config, ro RunOptions) *startedRun {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	r := &startedRun{ready: make(chan struct{}), done: make(chan error, 1), stop: cancel}
	ro.ShutdownGrace = time.Second
	ro.Ready = func(string) { close(r.ready) }
	go func() { r.done <- Run(ctx, cfg, ro, zaptest.NewLogger(t).Named(cfg.NodeID)) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-r.done:
		case <-time.After(20 * time.Second):
			t.Error("Run did not return")
		}
	})
	return r
}

// waitReady waits until r's API listens; it fails the test if Run returned
// first.
func (r *startedRun) waitReady(t *testing.T) {
	t.Helper()
	select {
	case <-r.ready:
	case err := <-r.done:
		r.done <- err // for the cleanup
		t.Fatalf("Run returned before it listened: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not listen within 10 s")
	}
}

// foreignDataDir returns a data dir holding the Raft state of node id of a
// single-node cluster of its own, stopped.
func foreignDataDir(t *testing.T, id string) (string, Config) {
	t.Helper()
	dir := t.TempDir()
	cfg := diskConfig(t, dir, id)
	d, err := openDiskNode(t, cfg)
	if err != nil {
		t.Fatal(err)
	}
	d.waitLeader(t)
	deadline := time.Now().Add(5 * time.Second)
	for m, _ := readMarker(dir); m == nil; m, _ = readMarker(dir) {
		if time.Now().After(deadline) {
			t.Fatal("the data dir was never marked")
		}
		time.Sleep(10 * time.Millisecond)
	}
	d.stop()
	cfg.Bootstrap, cfg.Peers = false, nil
	cfg.APIAddr, cfg.RaftAddr = freeAddr(t), freeAddr(t)
	return dir, cfg
}

// TestRunRefusesToJoinWithAnotherClustersState: a node whose data dir holds
// the state of another cluster, started with -join, is refused before its
// Raft starts, with the way out named, and the cluster does not take it in.
func TestRunRefusesToJoinWithAnotherClustersState(t *testing.T) {
	tc := newTestCluster(t, 1)
	l := tc.leader()
	_, cfg := foreignDataDir(t, "j1")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	err := Run(ctx, cfg, RunOptions{Join: tc.addrs[0], ShutdownGrace: time.Second}, zaptest.NewLogger(t))
	if !errors.Is(err, ErrForeignState) || !strings.Contains(err.Error(), `node "j1"`) || !strings.Contains(err.Error(), "Empty the data dir") {
		t.Fatalf("Run() = %v, want ErrForeignState naming node j1 and the way out", err)
	}
	ms, err := l.Members()
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range ms {
		if m.ID == "j1" {
			t.Fatalf("the cluster added j1: %+v", ms)
		}
	}
	// State of a node whose id a member of the cluster holds at another
	// Raft address: not that member's state either.
	_, twin := foreignDataDir(t, "n1")
	err = Run(ctx, twin, RunOptions{Join: tc.addrs[0], ShutdownGrace: time.Second}, zaptest.NewLogger(t))
	if !errors.Is(err, ErrForeignState) || !strings.Contains(err.Error(), `lists node "n1" at raft address n1`) {
		t.Fatalf("Run() with the state of another n1 = %v, want ErrForeignState naming the member's raft address", err)
	}
}

// TestRunJoinsAgainWithItsOwnState: a member that joined, restarted with
// the same -join and its data dir, starts: the cluster lists it. So does a
// node with state whose -join target does not answer (members restarting
// together must not wait for each other).
func TestRunJoinsAgainWithItsOwnState(t *testing.T) {
	d1, err := openDiskNode(t, diskConfig(t, t.TempDir(), "a1"))
	if err != nil {
		t.Fatal(err)
	}
	d1.waitLeader(t)
	cfg := fastConfig("a2", freeAddr(t))
	cfg.RaftAddr, cfg.DataDir = freeAddr(t), t.TempDir()
	first := runNode(t, cfg, RunOptions{Join: d1.cfg.APIAddr})
	first.waitReady(t)
	deadline := time.Now().Add(10 * time.Second)
	for !isVoter(d1.Node, "a2") {
		if time.Now().After(deadline) {
			t.Fatal("a2 was never promoted")
		}
		time.Sleep(20 * time.Millisecond)
	}
	for m, _ := readMarker(cfg.DataDir); m == nil; m, _ = readMarker(cfg.DataDir) { // written once replicated
		if time.Now().After(deadline) {
			t.Fatal("a2's data dir was never marked after it joined")
		}
		time.Sleep(20 * time.Millisecond)
	}
	first.stop()
	if err := <-first.done; errors.Is(err, ErrForeignState) {
		t.Fatal(err)
	}
	first.done <- nil // for the cleanup
	again := runNode(t, cfg, RunOptions{Join: d1.cfg.APIAddr})
	again.waitReady(t)

	_, lone := foreignDataDir(t, "b1")
	runNode(t, lone, RunOptions{Join: freeAddr(t)}).waitReady(t) // nobody answers there
}

func isVoter(n *Node, id string) bool {
	ms, err := n.Members()
	if err != nil {
		return false
	}
	for _, m := range ms {
		if m.ID == id {
			return m.Suffrage == raft.Voter.String()
		}
	}
	return false
}
