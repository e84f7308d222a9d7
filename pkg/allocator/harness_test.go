package allocator

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	"go.uber.org/zap/zaptest"
	"google.golang.org/grpc"

	"github.com/allot-dev/allot/fsm"
)

// testCluster is an in-process allocator cluster on Raft's in-memory
// transport, with each node's Connect API on a real loopback listener so
// forwarding is exercised. The idea follows raft's own MakeCluster helpers.
type testCluster struct {
	t       testing.TB
	nodes   []*Node
	trans   []*raft.InmemTransport
	servers []*http.Server
	grpcs   []*grpc.Server
	addrs   []string
	gaddrs  []string // each node's gRPC listener (NewGRPCServer)
	clock   *fakeClock
	cut     map[int]bool // nodes isolate has cut off, until heal
}

// fakeClock is the leader clock of the test cluster, settable by tests.
type fakeClock struct{ off time.Duration }

func (c *fakeClock) now() time.Time { return time.Now().Add(c.off) }

func fastConfig(id, api string) Config {
	c := DefaultConfig()
	c.NodeID = id
	c.RaftAddr = id
	c.APIAddr = api
	c.HeartbeatTimeout = 50 * time.Millisecond
	c.ElectionTimeout = 50 * time.Millisecond
	c.LeaderLeaseTimeout = 50 * time.Millisecond
	c.CommitTimeout = 5 * time.Millisecond
	c.ApplyTimeout = 2 * time.Second
	return c
}

func newTestCluster(t testing.TB, n int, mutate ...func(*Config)) *testCluster {
	t.Helper()
	tc := &testCluster{t: t, clock: &fakeClock{}}
	var peers []Peer
	lns := make([]net.Listener, n)
	for i := 0; i < n; i++ {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		lns[i] = ln
		id := fmt.Sprintf("n%d", i+1)
		peers = append(peers, Peer{ID: id, RaftAddr: id, APIAddr: ln.Addr().String()})
		tc.addrs = append(tc.addrs, ln.Addr().String())
		_, tr := raft.NewInmemTransportWithTimeout(raft.ServerAddress(id), 500*time.Millisecond)
		tc.trans = append(tc.trans, tr)
	}
	for i := range tc.trans {
		for j := range tc.trans {
			if i != j {
				tc.trans[i].Connect(tc.trans[j].LocalAddr(), tc.trans[j])
			}
		}
	}
	for i := 0; i < n; i++ {
		cfg := fastConfig(peers[i].ID, peers[i].APIAddr)
		cfg.Bootstrap = true
		cfg.Peers = peers
		for _, m := range mutate {
			m(&cfg)
		}
		tc.nodes = append(tc.nodes, tc.startNode(cfg, tc.trans[i], raft.NewInmemStore(), lns[i]))
	}
	t.Cleanup(tc.close)
	return tc
}

func (tc *testCluster) startNode(cfg Config, tr *raft.InmemTransport, store *raft.InmemStore, ln net.Listener) *Node {
	tc.t.Helper()
	m := NewMetrics(nil)
	node, err := NewNode(cfg, WithLogger(zaptest.NewLogger(tc.t).Named(cfg.NodeID)), WithClock(tc.clock.now), WithMetrics(m),
		WithRaftDeps(RaftDeps{Logs: store, Stable: store, Snapshots: raft.NewInmemSnapshotStore(), Transport: tr}))
	if err != nil {
		tc.t.Fatal(err)
	}
	api := NewServer(node, zaptest.NewLogger(tc.t), m)
	srv := HTTPServer(cfg.APIAddr, Mux(api, nil))
	go func() { _ = srv.Serve(ln) }()
	tc.servers = append(tc.servers, srv)
	gln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tc.t.Fatal(err)
	}
	g := NewGRPCServer(api)
	go func() { _ = g.Serve(gln) }()
	tc.grpcs = append(tc.grpcs, g)
	tc.gaddrs = append(tc.gaddrs, gln.Addr().String())
	return node
}

// addNode starts a node that is no member yet (it does not bootstrap), at
// raft address raftAddr on a new in-memory transport connected to every
// other, with its API on ln; AddMember makes it a member.
func (tc *testCluster) addNode(id, raftAddr string, ln net.Listener) *Node {
	tc.t.Helper()
	_, tr := raft.NewInmemTransportWithTimeout(raft.ServerAddress(raftAddr), 500*time.Millisecond)
	for _, o := range tc.trans {
		tr.Connect(o.LocalAddr(), o)
		o.Connect(tr.LocalAddr(), tr)
	}
	cfg := fastConfig(id, ln.Addr().String())
	cfg.RaftAddr = raftAddr
	n := tc.startNode(cfg, tr, raft.NewInmemStore(), ln)
	tc.trans = append(tc.trans, tr)
	tc.nodes = append(tc.nodes, n)
	tc.addrs = append(tc.addrs, ln.Addr().String())
	return n
}

// closedAddr returns a loopback address nothing listens on.
func closedAddr(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	if err := ln.Close(); err != nil {
		t.Fatal(err)
	}
	return addr
}

func (tc *testCluster) close() {
	for _, s := range tc.servers {
		_ = s.Close()
	}
	for _, g := range tc.grpcs {
		g.Stop()
	}
	for _, n := range tc.nodes {
		if n != nil {
			_ = n.Close()
		}
	}
}

// leader waits for exactly one leader among the running nodes, which
// every other running member that is not cut off follows (knows its ID and
// API address). A node that believes it leads before the others have
// heard from it can lose an election a moment later (a follower's
// heartbeat timeout ran out before the first heartbeat came): a test that
// then calls a follower would find it knowing no leader.
func (tc *testCluster) leader() *Node {
	tc.t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for time.Now().Before(deadline) {
		var leaders []*Node
		for _, n := range tc.nodes {
			if n != nil && n.IsLeader() {
				leaders = append(leaders, n)
			}
		}
		if len(leaders) == 1 && tc.followed(leaders[0]) {
			return leaders[0]
		}
		time.Sleep(10 * time.Millisecond)
	}
	tc.t.Fatal("no single leader, followed by the running nodes, within 5s")
	return nil
}

// followed reports whether every running node of l's configuration that
// is not cut off knows l as its leader, with l's API address.
func (tc *testCluster) followed(l *Node) bool {
	f := l.raft.GetConfiguration()
	if f.Error() != nil {
		return false
	}
	members := map[string]bool{}
	for _, s := range f.Configuration().Servers {
		members[string(s.ID)] = true
	}
	for i, n := range tc.nodes {
		if n == nil || n == l || tc.cut[i] || !members[n.ID()] {
			continue
		}
		if id, api := n.Leader(); id != l.ID() || api != l.Config().APIAddr {
			return false
		}
	}
	return true
}

// index returns the position of n in the cluster.
func (tc *testCluster) index(n *Node) int {
	for i, m := range tc.nodes {
		if m == n {
			return i
		}
	}
	return -1
}

// isolate cuts node i off from every other node (both directions).
func (tc *testCluster) isolate(i int) {
	if tc.cut == nil {
		tc.cut = map[int]bool{}
	}
	tc.cut[i] = true
	for j := range tc.trans {
		if i != j {
			tc.trans[i].Disconnect(tc.trans[j].LocalAddr())
			tc.trans[j].Disconnect(tc.trans[i].LocalAddr())
		}
	}
}

// heal reconnects every pair of transports.
func (tc *testCluster) heal() {
	clear(tc.cut)
	for i := range tc.trans {
		for j := range tc.trans {
			if i != j {
				tc.trans[i].Connect(tc.trans[j].LocalAddr(), tc.trans[j])
			}
		}
	}
}

// waitSame waits until every running node's FSM snapshot is byte-identical
// to the leader's (the idea of raft's EnsureSame).
func (tc *testCluster) waitSame() {
	tc.t.Helper()
	l := tc.leader()
	if err := l.Barrier(context.Background()); err != nil {
		tc.t.Fatal(err)
	}
	want := snapshotBytes(tc.t, l.FSM())
	deadline := time.Now().Add(5 * time.Second)
	for {
		same := true
		for _, n := range tc.nodes {
			if n != nil && n != l && !bytes.Equal(snapshotBytes(tc.t, n.FSM()), want) {
				same = false
			}
		}
		if same {
			return
		}
		if time.Now().After(deadline) {
			tc.t.Fatal("nodes did not converge to the leader's state within 5s")
		}
		time.Sleep(20 * time.Millisecond)
	}
}

type bufSink struct{ bytes.Buffer }

func (s *bufSink) ID() string    { return "test" }
func (s *bufSink) Cancel() error { return nil }
func (s *bufSink) Close() error  { return nil }

func snapshotBytes(t testing.TB, f *fsm.FSM) []byte {
	t.Helper()
	snap, err := f.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	var sink bufSink
	if err := snap.Persist(&sink); err != nil {
		t.Fatal(err)
	}
	snap.Release()
	return sink.Bytes()
}
