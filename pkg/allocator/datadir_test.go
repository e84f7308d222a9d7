package allocator

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"go.uber.org/zap/zaptest/observer"
)

// diskNode is a node on the production stores (BoltDB, file snapshots, TCP)
// in its data dir, with its API served.
type diskNode struct {
	*Node
	srv *http.Server
}

// freeAddr returns a loopback address that was free a moment ago.
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// diskConfig is the configuration of node id with its data dir in dir,
// bootstrapping a single-node cluster.
func diskConfig(t *testing.T, dir, id string) Config {
	c := fastConfig(id, freeAddr(t))
	c.RaftAddr = freeAddr(t)
	c.DataDir = dir
	c.Bootstrap = true
	c.Peers = []Peer{{ID: id, RaftAddr: c.RaftAddr, APIAddr: c.APIAddr}}
	return c
}

// openDiskNode starts a node with cfg and serves its API; the test's
// cleanup stops it.
func openDiskNode(t *testing.T, cfg Config) (*diskNode, error) {
	t.Helper()
	m := NewMetrics(nil)
	n, err := NewNode(cfg, WithLogger(zaptest.NewLogger(t).Named(cfg.NodeID)), WithMetrics(m))
	if err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", cfg.APIAddr)
	if err != nil {
		_ = n.Close()
		t.Fatal(err)
	}
	d := &diskNode{Node: n, srv: HTTPServer(cfg.APIAddr, Mux(NewServer(n, zap.NewNop(), m), nil))}
	go func() { _ = d.srv.Serve(ln) }()
	t.Cleanup(d.stop)
	return d, nil
}

func (d *diskNode) stop() {
	_ = d.srv.Close()
	_ = d.Close()
}

// waitLeader waits until d leads.
func (d *diskNode) waitLeader(t *testing.T) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !d.IsLeader() {
		if time.Now().After(deadline) {
			t.Fatalf("%s did not become leader", d.ID())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// granted is what the ledger of d says the current window of atlas granted.
func (d *diskNode) granted() int64 {
	return d.FSM().CurrentWindow("atlas", d.FSM().Now()).Granted
}

// startGranting bootstraps a single-node cluster in dir, publishes the
// cluster test policy, grants 100 tokens of atlas, snapshots when snapshot
// is set, grants 100 more, and stops; it returns the node's configuration.
func startGranting(t *testing.T, dir string, snapshot bool) Config {
	t.Helper()
	cfg := diskConfig(t, dir, "a1")
	d, err := openDiskNode(t, cfg)
	if err != nil {
		t.Fatalf("first start: %v", err)
	}
	d.waitLeader(t)
	publishTest(t, []string{cfg.APIAddr}, clusterPolicy, 1)
	acquireOn(t, d.Node, "eu", "r1", 100)
	if snapshot {
		if err := d.Raft().Snapshot().Error(); err != nil {
			t.Fatalf("snapshot: %v", err)
		}
	}
	acquireOn(t, d.Node, "us", "r2", 100)
	if g := d.granted(); g != 200 {
		t.Fatalf("granted %d before the restart, want 200", g)
	}
	d.stop()
	return cfg
}

// TestRestartRefusesLostRaftState empties, deletes or replaces raft.db of
// a node that granted tokens, with and without a snapshot and with and
// without the marker (a data dir of a build that predates it): each
// restart with the same flags (-bootstrap included) must refuse, naming
// what is lost and the ways out, rather than start from the snapshot or
// from nothing and grant the window's pool again.
func TestRestartRefusesLostRaftState(t *testing.T) {
	emptyDB := func(t *testing.T, dir string) {
		if err := os.Truncate(filepath.Join(dir, raftDBName), 0); err != nil {
			t.Fatal(err)
		}
	}
	deleteDB := func(t *testing.T, dir string) {
		if err := os.Remove(filepath.Join(dir, raftDBName)); err != nil {
			t.Fatal(err)
		}
	}
	freshDB := func(t *testing.T, dir string) {
		deleteDB(t, dir)
		s, err := raftboltdb.New(raftboltdb.Options{Path: filepath.Join(dir, raftDBName)})
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Close(); err != nil {
			t.Fatal(err)
		}
	}
	dropMarker := func(t *testing.T, dir string) {
		if err := os.Remove(filepath.Join(dir, markerName)); err != nil && !errors.Is(err, os.ErrNotExist) {
			t.Fatal(err)
		}
	}
	tests := []struct {
		name     string
		snapshot bool
		damage   []func(*testing.T, string)
		want     string
	}{
		{"raft.db emptied", false, []func(*testing.T, string){emptyDB}, "raft.db is empty (0 bytes)"},
		{"raft.db deleted", false, []func(*testing.T, string){deleteDB}, "raft.db is missing"},
		{"raft.db replaced by a new one", false, []func(*testing.T, string){freshDB}, "raft.db holds no Raft state"},
		{"snapshot, raft.db emptied", true, []func(*testing.T, string){emptyDB}, "raft.db is empty (0 bytes)"},
		{"snapshot, raft.db deleted, no marker", true, []func(*testing.T, string){deleteDB, dropMarker}, "raft.db is missing"},
		{"snapshot, raft.db emptied, no marker", true, []func(*testing.T, string){emptyDB, dropMarker}, "snapshot(s) in snapshots"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			cfg := startGranting(t, dir, tt.snapshot)
			for _, damage := range tt.damage {
				damage(t, dir)
			}
			d, err := openDiskNode(t, cfg)
			if err == nil {
				time.Sleep(500 * time.Millisecond) // let it elect itself and apply what it has
				t.Fatalf("the restart was accepted: the ledger granted %d of the 200 tokens granted before", d.granted())
			}
			if !errors.Is(err, ErrRaftStateLost) {
				t.Errorf("restart: %v, want an ErrRaftStateLost", err)
			}
			for _, w := range []string{tt.want, "refusing to start", "restore the data dir", "member remove", "-join"} {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("the refusal does not say %q: %v", w, err)
				}
			}
			if _, serr := os.Stat(filepath.Join(dir, raftDBName)); tt.want == "raft.db is missing" && serr == nil {
				t.Errorf("the refusal created a new raft.db")
			}
		})
	}
}

// TestRestartRefusesLostSnapshots removes the snapshots of a node whose log
// was compacted: the log alone starts after the entries the snapshot held,
// and applying it to an empty state would forget them.
func TestRestartRefusesLostSnapshots(t *testing.T) {
	dir := t.TempDir()
	cfg := diskConfig(t, dir, "a1")
	cfg.TrailingLogs = 1
	d, err := openDiskNode(t, cfg)
	if err != nil {
		t.Fatal(err)
	}
	d.waitLeader(t)
	publishTest(t, []string{cfg.APIAddr}, clusterPolicy, 1)
	for i := range 4 {
		acquireOn(t, d.Node, "eu", fmt.Sprintf("r%d", i), 100)
	}
	if err := d.Raft().Snapshot().Error(); err != nil {
		t.Fatal(err)
	}
	d.stop()
	if err := os.RemoveAll(filepath.Join(dir, snapshotsName)); err != nil {
		t.Fatal(err)
	}
	_, err = openDiskNode(t, cfg)
	if !errors.Is(err, ErrRaftStateLost) || !strings.Contains(err.Error(), "no snapshot holds the entries before it") {
		t.Fatalf("restart without the snapshots: %v, want an ErrRaftStateLost naming the snapshots", err)
	}
}

// TestRestartKeepsStateAndMarksOldDataDir restarts a node, with the same
// flags, from a data dir that a build without the marker wrote: it must
// start with its grants and write the marker; and the marker of a fresh
// bootstrap records the node.
func TestRestartKeepsStateAndMarksOldDataDir(t *testing.T) {
	dir := t.TempDir()
	cfg := startGranting(t, dir, true)
	m, err := readMarker(dir)
	if err != nil || m == nil || m.NodeID != "a1" || m.Origin != "bootstrap" {
		t.Fatalf("marker after the bootstrap: %+v, %v; want node a1, origin bootstrap", m, err)
	}
	if err := os.Remove(filepath.Join(dir, markerName)); err != nil {
		t.Fatal(err)
	}
	d, err := openDiskNode(t, cfg)
	if err != nil {
		t.Fatalf("restart of a data dir without marker: %v", err)
	}
	d.waitLeader(t)
	deadline := time.Now().Add(5 * time.Second)
	for d.granted() != 200 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if g := d.granted(); g != 200 {
		t.Errorf("granted %d after the restart, want 200", g)
	}
	m, err = readMarker(dir)
	if err != nil || m == nil || m.NodeID != "a1" || m.Origin != "existing" {
		t.Errorf("marker after the restart: %+v, %v; want node a1, origin existing", m, err)
	}
	d.stop()

	// The data dir of a1 is not a2's.
	other := cfg
	other.NodeID = "a2"
	other.Peers = []Peer{{ID: "a2", RaftAddr: cfg.RaftAddr, APIAddr: cfg.APIAddr}}
	if _, err := openDiskNode(t, other); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), `node "a1"`) {
		t.Errorf("a2 on a1's data dir: %v, want an ErrConfig naming a1", err)
	}
}

// TestJoinedNodeMarksItsDataDir adds a node started without state to a
// cluster: once the leader has sent it entries, its data dir is marked,
// and emptying its raft.db then makes a restart refuse.
func TestJoinedNodeMarksItsDataDir(t *testing.T) {
	d1, err := openDiskNode(t, diskConfig(t, t.TempDir(), "a1"))
	if err != nil {
		t.Fatal(err)
	}
	d1.waitLeader(t)
	dir2 := t.TempDir()
	cfg2 := diskConfig(t, dir2, "a2")
	cfg2.Bootstrap, cfg2.Peers = false, nil
	d2, err := openDiskNode(t, cfg2)
	if err != nil {
		t.Fatal(err)
	}
	if m, _ := readMarker(dir2); m != nil {
		t.Fatalf("a node without state has a marker: %+v", m)
	}
	ctx := t.Context()
	if err := d1.AddNonvoter(ctx, Peer{ID: "a2", RaftAddr: cfg2.RaftAddr, APIAddr: cfg2.APIAddr}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	var m *dataDirMarker
	for m == nil && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
		m, _ = readMarker(dir2)
	}
	if m == nil || m.NodeID != "a2" || m.Origin != "replicated" {
		t.Fatalf("marker of the joined node: %+v, want node a2, origin replicated", m)
	}
	d2.stop()
	if err := os.Truncate(filepath.Join(dir2, raftDBName), 0); err != nil {
		t.Fatal(err)
	}
	if _, err := openDiskNode(t, cfg2); !errors.Is(err, ErrRaftStateLost) {
		t.Fatalf("restart of the joined node with raft.db emptied: %v, want an ErrRaftStateLost", err)
	}
}

// TestBootstrapProbesThePeers starts, with -bootstrap and the peer list
// they were founded with, nodes of a three-node cluster that lost their
// whole data dir, and a node whose peer list names a running cluster that
// does not list it: each must refuse, as a peer answers as a cluster with
// a policy, and say the way out, which depends on whether the cluster has
// a leader. Founders starting together (no policy yet) bootstrap, and the
// way out of a lost majority (the lost nodes back empty, without
// -bootstrap) brings the cluster back with its ledger.
func TestBootstrapProbesThePeers(t *testing.T) {
	var cfgs []Config
	var peers []Peer
	for _, id := range []string{"a1", "a2", "a3"} {
		c := diskConfig(t, t.TempDir(), id)
		cfgs, peers = append(cfgs, c), append(peers, c.Peers[0])
	}
	nodes := make([]*diskNode, 3)
	for i := range cfgs {
		cfgs[i].Peers = peers
		d, err := openDiskNode(t, cfgs[i])
		if err != nil {
			t.Fatalf("founder %s starting after the others (which have no policy yet): %v", cfgs[i].NodeID, err)
		}
		nodes[i] = d
	}
	publishTest(t, []string{cfgs[0].APIAddr, cfgs[1].APIAddr, cfgs[2].APIAddr}, clusterPolicy, 1)
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(5 * time.Second)
		for !cond() {
			if time.Now().After(deadline) {
				for _, d := range nodes {
					t.Logf("%s: %v, applied %d, granted %d", d.ID(), d.Raft().State(), d.Raft().AppliedIndex(), d.granted())
				}
				t.Fatalf("timed out waiting for %s", what)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	hasPolicy := func(d *diskNode) bool { _, ok := d.FSM().Policy(); return ok }
	waitFor("the policy on every node", func() bool { return hasPolicy(nodes[0]) && hasPolicy(nodes[1]) && hasPolicy(nodes[2]) })
	var leader *diskNode
	waitFor("a leader", func() bool {
		for _, d := range nodes {
			if d.IsLeader() {
				leader = d
			}
		}
		return leader != nil
	})
	acquireOn(t, leader.Node, "eu", "r1", 100)
	const wantGranted = 100
	waitFor("the grant on a1", func() bool { return nodes[0].granted() == wantGranted })
	lose := func(i int) {
		t.Helper()
		nodes[i].stop()
		if err := os.RemoveAll(cfgs[i].DataDir); err != nil {
			t.Fatal(err)
		}
	}
	refusal := func(i int, want ...string) {
		t.Helper()
		_, err := openDiskNode(t, cfgs[i])
		if !errors.Is(err, ErrClusterRunning) {
			t.Fatalf("%s restarted with -bootstrap after losing its data dir: %v, want an ErrClusterRunning", cfgs[i].NodeID, err)
		}
		for _, w := range want {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("the refusal does not say %q: %v", w, err)
			}
		}
		if m, _ := readMarker(cfgs[i].DataDir); m != nil {
			t.Errorf("the refused node wrote a marker: %+v", m)
		}
	}

	// One node lost, a quorum left: remove it, then join.
	lose(2)
	waitFor("a leader among a1 and a2", func() bool { return nodes[0].IsLeader() || nodes[1].IsLeader() })
	refusal(2, `lists this node "a3"`, "member remove a3", "-join ")

	// A majority lost: no leader to remove anything; back empty, no -bootstrap.
	lose(1)
	waitFor("a1 to know no leader", func() bool { id, _ := nodes[0].Leader(); return id == "" })
	refusal(1, `lists this node "a2" and knows no leader`, "same -id and -raft-addr", "-join "+cfgs[0].APIAddr)
	for _, i := range []int{1, 2} {
		c := cfgs[i]
		c.Bootstrap, c.Peers = false, nil
		if err := os.RemoveAll(c.DataDir); err != nil {
			t.Fatal(err)
		}
		d, err := openDiskNode(t, c)
		if err != nil {
			t.Fatalf("%s back empty without -bootstrap: %v", c.NodeID, err)
		}
		nodes[i] = d
	}
	waitFor("a leader again", func() bool { return nodes[0].IsLeader() || nodes[1].IsLeader() || nodes[2].IsLeader() })
	waitFor(fmt.Sprintf("the ledger on the nodes back (granted %d)", wantGranted), func() bool {
		return nodes[1].granted() == wantGranted && nodes[2].granted() == wantGranted
	})

	// A node that was never a member.
	cfg4 := diskConfig(t, t.TempDir(), "a4")
	cfg4.Peers = []Peer{cfgs[0].Peers[0], cfg4.Peers[0]}
	_, err := openDiskNode(t, cfg4)
	if !errors.Is(err, ErrClusterRunning) || !strings.Contains(err.Error(), `without this node "a4"`) {
		t.Fatalf("a4 bootstrapping with a member of a running cluster as peer: %v, want an ErrClusterRunning", err)
	}
}

// boltTestDB writes a raft.db of several hundred KB (Raft logs and a term)
// in dir and returns its path.
func boltTestDB(t *testing.T, dir string) string {
	t.Helper()
	path := filepath.Join(dir, raftDBName)
	s, err := raftboltdb.New(raftboltdb.Options{Path: path})
	if err != nil {
		t.Fatal(err)
	}
	var logs []*raft.Log
	for i := uint64(1); i <= 3000; i++ {
		logs = append(logs, &raft.Log{Index: i, Term: 1, Type: raft.LogCommand, Data: []byte(strings.Repeat("x", 150))})
	}
	if err := s.StoreLogs(logs); err != nil {
		t.Fatal(err)
	}
	// A log truncated after a conflict leaves freed pages on the freelist.
	if err := s.DeleteRange(2001, 3000); err != nil {
		t.Fatal(err)
	}
	if err := s.SetUint64([]byte("CurrentTerm"), 1); err != nil {
		t.Fatal(err)
	}
	if err := s.Close(); err != nil {
		t.Fatal(err)
	}
	return path
}

// boltMetaOf returns the meta bbolt uses in the file b, and its page size.
func boltMetaOf(t *testing.T, b []byte) (boltMeta, int) {
	t.Helper()
	m0, err0 := parseBoltMeta(b)
	if err0 != nil {
		t.Fatalf("meta page 0: %v", err0)
	}
	ps := int(m0.pageSize)
	m1, err1 := parseBoltMeta(b[ps:])
	if err1 == nil && m1.tx > m0.tx {
		return m1, ps
	}
	return m0, ps
}

// TestTruncatedRaftDBIsRefused opens truncated copies of a raft.db through
// NewNode in this process: each must be refused with ErrRaftDBDamaged, or,
// when the truncation kept every page the database uses, open; neither
// may crash the process (bbolt v1.3.5 reads a truncated file through its
// memory map and dies of SIGBUS or SIGSEGV).
func TestTruncatedRaftDBIsRefused(t *testing.T) {
	whole, err := os.ReadFile(boltTestDB(t, t.TempDir()))
	if err != nil {
		t.Fatal(err)
	}
	m, ps := boltMetaOf(t, whole)
	used := int(m.pgid) * ps
	t.Logf("raft.db: %d bytes, %d-byte pages, %d pages used", len(whole), ps, m.pgid)
	if used >= len(whole) {
		t.Fatalf("the test database uses its whole file (%d bytes): no room to truncate after its pages", used)
	}
	sizes := []int{100, 4096, 4 * ps, 16384, 65536, 300000, used - ps, used - 1, used, len(whole) - 1}
	for _, size := range sizes {
		t.Run(fmt.Sprint(size), func(t *testing.T) {
			dir := t.TempDir()
			if err := os.WriteFile(filepath.Join(dir, raftDBName), whole[:size], 0o600); err != nil {
				t.Fatal(err)
			}
			cfg := diskConfig(t, dir, "a1")
			cfg.Bootstrap, cfg.Peers = false, nil
			n, err := NewNode(cfg, WithLogger(zaptest.NewLogger(t)))
			if size == used {
				if err != nil {
					t.Fatalf("raft.db cut right after its last page: %v, want it to open", err)
				}
				_ = n.Close()
				return
			}
			if err == nil {
				_ = n.Close()
				t.Fatalf("a raft.db cut to %d of %d bytes opened", size, len(whole))
			}
			if !errors.Is(err, ErrRaftDBDamaged) || !strings.Contains(err.Error(), "restore the data dir") {
				t.Fatalf("cut to %d bytes: %v, want an ErrRaftDBDamaged that says what to do", size, err)
			}
		})
	}
}

// TestDamagedRaftDBIsRefused damages a raft.db's meta and data pages.
func TestDamagedRaftDBIsRefused(t *testing.T) {
	whole, err := os.ReadFile(boltTestDB(t, t.TempDir()))
	if err != nil {
		t.Fatal(err)
	}
	m, ps := boltMetaOf(t, whole)
	newer := 0
	if m1, err := parseBoltMeta(whole[ps:]); err == nil && m1.tx == m.tx {
		newer = 1
	}
	tests := []struct {
		name   string
		damage func(b []byte)
		want   string // "" : it opens
	}{
		{"both meta pages", func(b []byte) { b[16], b[ps+16] = 0, 0 }, "neither meta page is valid"},
		{"the newer meta page", func(b []byte) { b[newer*ps+16+48]++ }, ""}, // bbolt uses the older one
		{"meta names pages beyond the file", func(b []byte) {
			// Both metas claim twice the file; the checksums are redone.
			for i := range 2 {
				p := b[i*ps+16:]
				binary.NativeEndian.PutUint64(p[40:], uint64(len(b)/ps*2))
				h := fnv.New64a()
				h.Write(p[:56])
				binary.NativeEndian.PutUint64(p[56:], h.Sum64())
			}
		}, "truncated"},
		{"root page points beyond the file", func(b []byte) {
			// The root becomes a branch page of one element whose child
			// is 4 TB into the file: bbolt reads it through the memory map
			// and faults, which must not kill the process.
			p := b[int(m.root)*ps:]
			binary.NativeEndian.PutUint16(p[8:], 0x01) // branch
			binary.NativeEndian.PutUint16(p[10:], 1)   // one element
			binary.NativeEndian.PutUint32(p[16:], 0)   // its key: empty
			binary.NativeEndian.PutUint32(p[20:], 0)
			binary.NativeEndian.PutUint64(p[24:], 1<<30) // its child page
		}, "reading it failed"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := append([]byte(nil), whole...)
			tt.damage(b)
			dir := t.TempDir()
			if err := os.WriteFile(filepath.Join(dir, raftDBName), b, 0o600); err != nil {
				t.Fatal(err)
			}
			cfg := diskConfig(t, dir, "a1")
			cfg.Bootstrap, cfg.Peers = false, nil
			n, err := NewNode(cfg, WithLogger(zaptest.NewLogger(t)))
			if tt.want == "" {
				if err != nil {
					t.Fatalf("NewNode: %v, want it to open", err)
				}
				_ = n.Close()
				return
			}
			if err == nil {
				_ = n.Close()
				t.Fatal("the damaged raft.db opened")
			}
			if !errors.Is(err, ErrRaftDBDamaged) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("NewNode: %v, want an ErrRaftDBDamaged saying %q", err, tt.want)
			}
			t.Logf("refused: %v", err)
		})
	}
}

// TestMarkerIsWrittenWhole checks the marker's format and that a torn one
// is refused rather than taken for none.
func TestMarkerIsWrittenWhole(t *testing.T) {
	dir := t.TempDir()
	d := &dataDir{path: dir}
	if err := d.mark("a1", "bootstrap"); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(dir, markerName))
	if err != nil {
		t.Fatal(err)
	}
	var m map[string]any
	if err := json.Unmarshal(b, &m); err != nil || m["node_id"] != "a1" || m["origin"] != "bootstrap" {
		t.Fatalf("marker %s: %v", b, err)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 1 {
		t.Errorf("the data dir holds %d files after the marker was written, want 1", len(entries))
	}
	if err := os.WriteFile(filepath.Join(dir, markerName), b[:len(b)/2], 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := readMarker(dir); err == nil {
		t.Error("a torn marker was read")
	}
}

// TestCleanShutdownTakesASnapshot: a node stopped cleanly snapshots what it
// applied, so a restart (on an upgraded build, say) applies no entry again.
func TestCleanShutdownTakesASnapshot(t *testing.T) {
	dir := t.TempDir()
	cfg := diskConfig(t, dir, "a1")
	d, err := openDiskNode(t, cfg)
	if err != nil {
		t.Fatal(err)
	}
	d.waitLeader(t)
	publishTest(t, []string{cfg.APIAddr}, clusterPolicy, 1)
	acquireOn(t, d.Node, "eu", "r1", 100)
	applied := d.Raft().AppliedIndex()
	d.stop()
	ss, err := raft.NewFileSnapshotStore(dir, 3, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	metas, err := ss.List()
	if err != nil {
		t.Fatal(err)
	}
	if len(metas) == 0 || metas[0].Index < applied {
		t.Fatalf("snapshots after a clean shutdown: %+v; want one at index %d or later", metas, applied)
	}
}

// TestIdleShutdownLogsNoError: a node that applied nothing since its last
// snapshot stops without raft's "failed to take snapshot" error (and its
// stack trace) in the log, which would page whoever alerts on errors at
// every restart of an idle node.
func TestIdleShutdownLogsNoError(t *testing.T) {
	dir := t.TempDir()
	cfg := diskConfig(t, dir, "a1")
	d, err := openDiskNode(t, cfg)
	if err != nil {
		t.Fatal(err)
	}
	d.waitLeader(t)
	publishTest(t, []string{cfg.APIAddr}, clusterPolicy, 1)
	d.stop() // snapshots what it applied

	core, logs := observer.New(zapcore.InfoLevel)
	log := zap.New(zapcore.NewTee(core, zaptest.NewLogger(t).Core()))
	n, err := NewNode(cfg, WithLogger(log), WithMetrics(NewMetrics(nil)))
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for !n.IsLeader() && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	if err := n.Close(); err != nil {
		t.Fatal(err)
	}
	for _, e := range logs.All() {
		if e.Level >= zapcore.ErrorLevel {
			t.Errorf("idle restart and shutdown logged %s %q %v", e.Level, e.Message, e.ContextMap())
		}
	}
}
