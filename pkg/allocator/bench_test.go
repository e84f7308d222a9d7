package allocator_test

import (
	"context"
	"flag"
	"fmt"
	"io"
	"net"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"

	"github.com/allot-dev/allot/fsm"
	"github.com/allot-dev/allot/pkg/allocator"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// BenchmarkAllocator measures, in one run on the same machine, Acquire through
// a 3-node loopback cluster (BoltDB with fsync, TCP transport) on the
// Connect API over h2c (acquire) and on the gRPC listener over grpc-go
// (acquire-grpc, what agents with -allocators-grpc use) and, as the
// ceiling, a bare hashicorp/raft Apply loop on the same stores and
// transport with a no-op FSM, and between the two the same Acquires
// proposed straight to the leader's Node (node-apply: group commit and FSM
// without the API). Run it with:
//
//	go test -run '^$' -bench BenchmarkAllocator -benchtime 3s ./pkg/allocator
func BenchmarkAllocator(b *testing.B) {
	for _, callers := range []int{1, 64} {
		b.Run(fmt.Sprintf("bare-raft-apply/callers=%d", callers), func(b *testing.B) {
			benchBare(b, callers)
		})
		b.Run(fmt.Sprintf("node-apply/callers=%d", callers), func(b *testing.B) {
			benchNodeApply(b, callers)
		})
		for _, batch := range []int{1, 100} {
			b.Run(fmt.Sprintf("acquire/batch=%d/callers=%d", batch, callers), func(b *testing.B) {
				benchAcquire(b, batch, callers, false)
			})
			b.Run(fmt.Sprintf("acquire-grpc/batch=%d/callers=%d", batch, callers), func(b *testing.B) {
				benchAcquire(b, batch, callers, true)
			})
		}
	}
}

// runLoad runs op b.N times spread over callers goroutines and reports
// calls/s, grants/s (calls x grantsPerCall, when that is positive), p50 and
// p99 latency.
func runLoad(b *testing.B, callers, grantsPerCall int, op func(i int) error) {
	b.Helper()
	var (
		next  atomic.Int64
		mu    sync.Mutex
		lats  = make([]time.Duration, 0, b.N)
		wg    sync.WaitGroup
		fails atomic.Int64
	)
	b.ResetTimer()
	start := time.Now()
	for c := 0; c < callers; c++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			local := make([]time.Duration, 0, b.N/callers+1)
			for {
				i := int(next.Add(1)) - 1
				if i >= b.N {
					break
				}
				t0 := time.Now()
				if err := op(i); err != nil {
					fails.Add(1)
					continue
				}
				local = append(local, time.Since(t0))
			}
			mu.Lock()
			lats = append(lats, local...)
			mu.Unlock()
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	b.StopTimer()
	if f := fails.Load(); f > 0 {
		b.Fatalf("%d of %d calls failed", f, b.N)
	}
	slices.Sort(lats)
	b.ReportMetric(float64(b.N)/elapsed.Seconds(), "calls/s")
	if grantsPerCall > 0 {
		b.ReportMetric(float64(b.N*grantsPerCall)/elapsed.Seconds(), "grants/s")
	}
	if len(lats) > 0 {
		b.ReportMetric(float64(lats[len(lats)/2].Microseconds())/1000, "p50-ms")
		b.ReportMetric(float64(lats[len(lats)*99/100].Microseconds())/1000, "p99-ms")
	}
	b.ReportMetric(0, "ns/op")
}

func freeAddr(b *testing.B) string {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

type benchCluster struct {
	nodes   []*allocator.Node
	servers []func()
	addrs   []string // the leader's Connect API
	grpc    []string // the leader's gRPC listener
}

var benchCommitDelay = flag.Duration("bench.commit-delay", allocator.DefaultConfig().CommitDelay, "BenchmarkAllocator: the nodes' Config.CommitDelay")

func startBenchCluster(b *testing.B) *benchCluster {
	b.Helper()
	dir := b.TempDir()
	var peers []allocator.Peer
	for i := 0; i < 3; i++ {
		peers = append(peers, allocator.Peer{ID: fmt.Sprintf("b%d", i), RaftAddr: freeAddr(b), APIAddr: freeAddr(b)})
	}
	bc := &benchCluster{}
	grpcAddrs := make([]string, len(peers))
	for i, p := range peers {
		cfg := allocator.DefaultConfig()
		cfg.NodeID, cfg.RaftAddr, cfg.APIAddr = p.ID, p.RaftAddr, p.APIAddr
		cfg.DataDir = filepath.Join(dir, p.ID)
		cfg.Bootstrap, cfg.Peers = true, peers
		cfg.CommitDelay = *benchCommitDelay
		n, err := allocator.NewNode(cfg)
		if err != nil {
			b.Fatal(err)
		}
		ln, err := net.Listen("tcp", p.APIAddr)
		if err != nil {
			b.Fatal(err)
		}
		api := allocator.NewServer(n, nil, allocator.NewMetrics(nil))
		srv := allocator.HTTPServer(p.APIAddr, allocator.Mux(api, nil))
		go func() { _ = srv.Serve(ln) }()
		gln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			b.Fatal(err)
		}
		g := allocator.NewGRPCServer(api)
		go func() { _ = g.Serve(gln) }()
		grpcAddrs[i] = gln.Addr().String()
		bc.nodes = append(bc.nodes, n)
		bc.servers = append(bc.servers, func() { _ = srv.Close() }, g.Stop)
	}
	b.Cleanup(func() {
		for _, s := range bc.servers {
			s()
		}
		for _, n := range bc.nodes {
			_ = n.Close()
		}
	})
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		for i, n := range bc.nodes {
			if n.IsLeader() {
				bc.addrs = []string{peers[i].APIAddr}
				bc.grpc = []string{grpcAddrs[i]}
				return bc
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	b.Fatal("no leader")
	return nil
}

// leader is the node that leads now.
func (bc *benchCluster) leader() *allocator.Node {
	for _, n := range bc.nodes {
		if n.IsLeader() {
			return n
		}
	}
	return bc.nodes[0]
}

func benchPolicy(quotas int) string {
	var sb strings.Builder
	sb.WriteString("name: bench\nregions: [eu]\nrules:\n")
	for i := 0; i < quotas; i++ {
		fmt.Fprintf(&sb, "  - {name: q%03d, scope: tenant, match: [{key: tenant, value: t%03d}], kind: global_quota, limit: 1000000000000, window: 24h, lease: {chunk: 1, ttl: 1h}}\n", i, i)
	}
	return sb.String()
}

func benchAcquire(b *testing.B, batch, callers int, overGRPC bool) {
	bc := startBenchCluster(b)
	var opts []allocator.ClientOption
	if overGRPC {
		opts = append(opts, allocator.WithGRPCEndpoints(bc.grpc...))
	}
	client, err := allocator.NewClient(bc.addrs, opts...)
	if err != nil {
		b.Fatal(err)
	}
	defer client.Close()
	ctx := context.Background()
	if _, err := client.Operator().PublishPolicy(ctx, &allotv1.PublishPolicyRequest{Document: []byte(benchPolicy(100)), ExpectedVersion: 1, Author: "bench", Reason: "bench"}); err != nil {
		b.Fatal(err)
	}
	wants := make([]*allotv1.Want, batch)
	for i := range wants {
		wants[i] = &allotv1.Want{Quota: fmt.Sprintf("q%03d", i), Tokens: 1, DemandPerSecond: 10}
	}
	leader := bc.leader()
	first := leader.Raft().LastIndex()
	defer func() {
		if entries := leader.Raft().LastIndex() - first; entries > 0 {
			b.ReportMetric(float64(b.N)/float64(entries), "calls/entry")
		}
	}()
	runLoad(b, callers, batch, func(i int) error {
		resp, err := client.Acquire(ctx, &allotv1.AcquireRequest{Region: "eu", RequestId: fmt.Sprintf("r%d", i), Wants: wants})
		if err == nil && len(resp.GetGrants()) != batch {
			return fmt.Errorf("got %d grants", len(resp.GetGrants()))
		}
		return err
	})
}

// benchNodeApply proposes single-quota Acquires straight to the leader's
// Node (group commit included, no HTTP): what the allocator costs on top of
// Raft without the API in between.
func benchNodeApply(b *testing.B, callers int) {
	bc := startBenchCluster(b)
	client, err := allocator.NewClient(bc.addrs)
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	if _, err := client.Operator().PublishPolicy(ctx, &allotv1.PublishPolicyRequest{Document: []byte(benchPolicy(1)), ExpectedVersion: 1, Author: "bench", Reason: "bench"}); err != nil {
		b.Fatal(err)
	}
	leader := bc.leader()
	first := leader.Raft().LastIndex()
	defer func() {
		if entries := leader.Raft().LastIndex() - first; entries > 0 {
			b.ReportMetric(float64(b.N)/float64(entries), "calls/entry")
		}
	}()
	runLoad(b, callers, 1, func(i int) error {
		_, err := leader.Apply(ctx, fsm.Command{Type: fsm.CmdAcquire, Acquire: &fsm.Acquire{
			Region: "eu", RequestID: fmt.Sprintf("r%d", i), Wants: []fsm.Want{{Quota: "q000", Tokens: 1, DemandPerSecond: 10}},
		}})
		return err
	})
}

// noopFSM is the bare loop's state machine: it does nothing.
type noopFSM struct{}

func (noopFSM) Apply(*raft.Log) any                 { return nil }
func (noopFSM) Snapshot() (raft.FSMSnapshot, error) { return noopSnap{}, nil }
func (noopFSM) Restore(rc io.ReadCloser) error      { return rc.Close() }

type noopSnap struct{}

func (noopSnap) Persist(s raft.SnapshotSink) error { return s.Close() }
func (noopSnap) Release()                          {}

func benchBare(b *testing.B, callers int) {
	dir := b.TempDir()
	var servers []raft.Server
	type member struct {
		addr string
		id   string
	}
	var ms []member
	for i := 0; i < 3; i++ {
		m := member{addr: freeAddr(b), id: fmt.Sprintf("r%d", i)}
		ms = append(ms, m)
		servers = append(servers, raft.Server{ID: raft.ServerID(m.id), Address: raft.ServerAddress(m.addr), Suffrage: raft.Voter})
	}
	var rafts []*raft.Raft
	for _, m := range ms {
		ac := allocator.DefaultConfig()
		rc := raft.DefaultConfig()
		rc.LocalID = raft.ServerID(m.id)
		rc.HeartbeatTimeout, rc.ElectionTimeout, rc.LeaderLeaseTimeout, rc.CommitTimeout = ac.HeartbeatTimeout, ac.ElectionTimeout, ac.LeaderLeaseTimeout, ac.CommitTimeout
		rc.BatchApplyCh, rc.MaxAppendEntries = true, 512
		rc.LogOutput = io.Discard
		store, err := raftboltdb.New(raftboltdb.Options{Path: filepath.Join(dir, m.id+".db")})
		if err != nil {
			b.Fatal(err)
		}
		snaps := raft.NewInmemSnapshotStore()
		tcpAddr, _ := net.ResolveTCPAddr("tcp", m.addr)
		trans, err := raft.NewTCPTransport(m.addr, tcpAddr, 8, 10*time.Second, io.Discard)
		if err != nil {
			b.Fatal(err)
		}
		if err := raft.BootstrapCluster(rc, store, store, snaps, trans, raft.Configuration{Servers: servers}); err != nil {
			b.Fatal(err)
		}
		r, err := raft.NewRaft(rc, noopFSM{}, store, store, snaps, trans)
		if err != nil {
			b.Fatal(err)
		}
		rafts = append(rafts, r)
		b.Cleanup(func() {
			_ = r.Shutdown().Error()
			_ = trans.Close()
			_ = store.Close()
		})
	}
	var leader *raft.Raft
	for deadline := time.Now().Add(10 * time.Second); leader == nil && time.Now().Before(deadline); {
		for _, r := range rafts {
			if r.State() == raft.Leader {
				leader = r
			}
		}
		time.Sleep(10 * time.Millisecond)
	}
	if leader == nil {
		b.Fatal("no leader")
	}
	payload := make([]byte, 96) // about the size of a one-quota Acquire entry
	runLoad(b, callers, 0, func(int) error { return leader.Apply(payload, 5*time.Second).Error() })
}
