package allocator

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/hashicorp/raft"
	"go.uber.org/zap/zaptest"

	"github.com/allot-dev/allot/fsm"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
	"github.com/allot-dev/allot/proto/allot/v1/allotv1connect"
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

// waitMarkedCluster waits until dir's marker records a cluster id, and
// returns it.
func waitMarkedCluster(t *testing.T, dir string) string {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if m, _ := readMarker(dir); m != nil && m.ClusterID != "" {
			return m.ClusterID
		}
		if time.Now().After(deadline) {
			t.Fatalf("the marker of %s never recorded a cluster id", dir)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// foreignDataDir returns a data dir holding the Raft state of node id of a
// single-node cluster of its own (its marker with the cluster's id),
// stopped.
func foreignDataDir(t *testing.T, id string) (string, Config) {
	t.Helper()
	dir := t.TempDir()
	cfg := diskConfig(t, dir, id)
	d, err := openDiskNode(t, cfg)
	if err != nil {
		t.Fatal(err)
	}
	d.waitLeader(t)
	if waitMarkedCluster(t, dir) != d.FSM().ClusterID() {
		t.Fatalf("the marker's cluster id is not the state's %q", d.FSM().ClusterID())
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
	// Written once replicated, with the cluster's id once applied.
	if id := waitMarkedCluster(t, cfg.DataDir); id != d1.FSM().ClusterID() {
		t.Fatalf("a2's marker records cluster %q, the cluster is %q", id, d1.FSM().ClusterID())
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

// TestClusterIDRecordedEverywhere: a new cluster's first leader gives it an
// id, every member applies the same one, and GetCluster reports it.
func TestClusterIDRecordedEverywhere(t *testing.T) {
	tc := newTestCluster(t, 3)
	tc.leader()
	deadline := time.Now().Add(10 * time.Second)
	var id string
	for {
		id = tc.nodes[0].FSM().ClusterID()
		same := id != ""
		for _, n := range tc.nodes {
			same = same && n.FSM().ClusterID() == id
		}
		if same {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the members never agreed on a cluster id: %q, %q, %q",
				tc.nodes[0].FSM().ClusterID(), tc.nodes[1].FSM().ClusterID(), tc.nodes[2].FSM().ClusterID())
		}
		time.Sleep(10 * time.Millisecond)
	}
	if len(id) != 32 {
		t.Fatalf("cluster id %q: want 32 hex digits (128 random bits)", id)
	}
	r, err := clusterOf(tc.addrs[1])
	if err != nil || r.GetClusterId() != id {
		t.Fatalf("GetCluster = %v (%v), want cluster_id %q", r, err, id)
	}
	// Another cluster gets another id.
	if other := newTestCluster(t, 1); other.leader() != nil {
		for other.nodes[0].FSM().ClusterID() == "" && time.Now().Before(deadline) {
			time.Sleep(10 * time.Millisecond)
		}
		if got := other.nodes[0].FSM().ClusterID(); got == "" || got == id {
			t.Fatalf("a second cluster's id is %q, the first one's %q", got, id)
		}
	}
}

func clusterOf(api string) (*allotv1.GetClusterResponse, error) {
	hc := NewHTTPClient()
	defer hc.CloseIdleConnections()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := allotv1connect.NewOperatorServiceClient(hc, "http://"+api).GetCluster(ctx, connect.NewRequest(&allotv1.GetClusterRequest{}))
	if err != nil {
		return nil, err
	}
	return resp.Msg, nil
}

// TestRunRefusesTheStateOfAClusterFoundedAgain: node a2's data dir holds
// the state of a cluster that was torn down; a new cluster was founded with
// a2 among its peers, at a2's address. The new cluster lists a2 where a2
// is, so only the cluster ids tell the states apart: a2 refuses to start,
// with -join as with -bootstrap, and names both ids. A -peer of another
// cluster that does not list a2 does not stop it.
func TestRunRefusesTheStateOfAClusterFoundedAgain(t *testing.T) {
	dirA, a2 := foreignDataDir(t, "a2")
	markedA := waitMarkedCluster(t, dirA)
	peers := []Peer{{ID: "b1", RaftAddr: freeAddr(t), APIAddr: freeAddr(t)}, {ID: "b2", RaftAddr: freeAddr(t), APIAddr: freeAddr(t)},
		{ID: "a2", RaftAddr: a2.RaftAddr, APIAddr: a2.APIAddr}}
	for _, p := range peers[:2] {
		cfg := fastConfig(p.ID, p.APIAddr)
		cfg.RaftAddr, cfg.DataDir, cfg.Bootstrap, cfg.Peers = p.RaftAddr, t.TempDir(), true, peers
		runNode(t, cfg, RunOptions{}).waitReady(t)
	}
	deadline := time.Now().Add(15 * time.Second)
	var idB string
	for idB == "" {
		if r, err := clusterOf(peers[0].APIAddr); err == nil {
			idB = r.GetClusterId()
		}
		if time.Now().After(deadline) {
			t.Fatal("the new cluster never recorded an id")
		}
		time.Sleep(20 * time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	check := func(how string, cfg Config, ro RunOptions) {
		t.Helper()
		ro.ShutdownGrace = time.Second
		err := Run(ctx, cfg, ro, zaptest.NewLogger(t).Named(how))
		if !errors.Is(err, ErrForeignState) || !strings.Contains(err.Error(), "cluster "+markedA) || !strings.Contains(err.Error(), "runs cluster "+idB) {
			t.Fatalf("Run with %s = %v, want ErrForeignState naming clusters %s and %s", how, err, markedA, idB)
		}
	}
	check("-join", a2, RunOptions{Join: peers[0].APIAddr})
	founder := a2
	founder.Bootstrap, founder.Peers = true, peers
	check("-bootstrap", founder, RunOptions{})
	if m, err := readMarker(dirA); err != nil || m.ClusterID != markedA {
		t.Fatalf("the refused node's marker changed: %+v (%v)", m, err)
	}
	// A -peer that runs another cluster which does not list a2 (an address
	// reused after its node left a2's cluster) is no reason to refuse.
	c1, err := openDiskNode(t, diskConfig(t, t.TempDir(), "c1"))
	if err != nil {
		t.Fatal(err)
	}
	c1.waitLeader(t)
	for c1.FSM().ClusterID() == "" {
		if time.Now().After(deadline) {
			t.Fatal("c1's cluster never recorded an id")
		}
		time.Sleep(20 * time.Millisecond)
	}
	founder.Peers = []Peer{{ID: "a2", RaftAddr: a2.RaftAddr, APIAddr: a2.APIAddr}, {ID: "c1", RaftAddr: c1.cfg.RaftAddr, APIAddr: c1.cfg.APIAddr}}
	runNode(t, founder, RunOptions{}).waitReady(t)
}

// TestMarkerOfAnOlderBuildGetsTheClusterID: a marker written before
// cluster ids (no cluster_id) is completed at the next start, once the
// state machine has the id; the rest of the marker stays.
func TestMarkerOfAnOlderBuildGetsTheClusterID(t *testing.T) {
	dir, cfg := foreignDataDir(t, "o1")
	m, err := readMarker(dir)
	if err != nil {
		t.Fatal(err)
	}
	id := m.ClusterID
	m.ClusterID = ""
	if err := writeMarker(dir, *m); err != nil {
		t.Fatal(err)
	}
	cfg.Bootstrap, cfg.Peers = true, []Peer{{ID: "o1", RaftAddr: cfg.RaftAddr, APIAddr: cfg.APIAddr}}
	d, err := openDiskNode(t, cfg)
	if err != nil {
		t.Fatal(err)
	}
	d.waitLeader(t)
	if got := waitMarkedCluster(t, dir); got != id {
		t.Fatalf("the marker records cluster %q, the state's is %q", got, id)
	}
	after, err := readMarker(dir)
	if err != nil || after.NodeID != m.NodeID || after.Origin != m.Origin || !after.Created.Equal(m.Created) {
		t.Fatalf("marker after %+v (%v), before %+v: only the id may change", after, err, m)
	}
}

// TestRestartWithNeitherFlagAsksTheSnapshotsMembers: a node restarted with
// neither -join nor -bootstrap (as the README allows) asks the members its
// newest snapshot lists; one that runs a cluster founded again, listing
// this node where it is, makes it refuse.
func TestRestartWithNeitherFlagAsksTheSnapshotsMembers(t *testing.T) {
	dirA := t.TempDir()
	a2 := diskConfig(t, dirA, "a2")
	d, err := openDiskNode(t, a2)
	if err != nil {
		t.Fatal(err)
	}
	d.waitLeader(t)
	markedA := waitMarkedCluster(t, dirA)
	b1 := Peer{ID: "b1", RaftAddr: freeAddr(t), APIAddr: freeAddr(t)}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// The old cluster's member table lists b1 (as a cluster of a2 and b1
	// would), and a snapshot holds it.
	if _, err := d.Apply(ctx, fsm.Command{Type: fsm.CmdSetMember, Member: &fsm.SetMember{ID: b1.ID, APIAddress: b1.APIAddr}}); err != nil {
		t.Fatal(err)
	}
	if err := d.Raft().Snapshot().Error(); err != nil {
		t.Fatal(err)
	}
	d.stop()
	// Founded again: b1 and b2 with a2 at its address.
	peers := []Peer{b1, {ID: "b2", RaftAddr: freeAddr(t), APIAddr: freeAddr(t)}, {ID: "a2", RaftAddr: a2.RaftAddr, APIAddr: a2.APIAddr}}
	for _, p := range peers[:2] {
		cfg := fastConfig(p.ID, p.APIAddr)
		cfg.RaftAddr, cfg.DataDir, cfg.Bootstrap, cfg.Peers = p.RaftAddr, t.TempDir(), true, peers
		runNode(t, cfg, RunOptions{}).waitReady(t)
	}
	deadline := time.Now().Add(15 * time.Second)
	for {
		if r, err := clusterOf(b1.APIAddr); err == nil && r.GetClusterId() != "" {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("the new cluster never recorded an id")
		}
		time.Sleep(20 * time.Millisecond)
	}
	neither := a2
	neither.Bootstrap, neither.Peers = false, nil
	err = Run(ctx, neither, RunOptions{ShutdownGrace: time.Second}, zaptest.NewLogger(t))
	if !errors.Is(err, ErrForeignState) || !strings.Contains(err.Error(), "cluster "+markedA) || !strings.Contains(err.Error(), "member b1") {
		t.Fatalf("Run with neither flag = %v, want ErrForeignState naming cluster %s and member b1", err, markedA)
	}
}
