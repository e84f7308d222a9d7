package agent_test

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/hashicorp/raft"
	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/allot-dev/allot/fsm"
	"github.com/allot-dev/allot/internal/redistest"
	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/agent"
	"github.com/allot-dev/allot/pkg/allocator"
	"github.com/allot-dev/allot/pkg/policy"
	"github.com/allot-dev/allot/pkg/topology"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
	"github.com/allot-dev/allot/proto/allot/v1/allotv1connect"
)

// One redis-server serves the package's tests; each test isolates itself
// with a namespace of its own. Tests that need a region of their own (the
// Northstar scenario) start their own servers.
var shared struct {
	redis *redistest.Server
	err   error
}

func TestMain(m *testing.M) {
	shared.redis, shared.err = redistest.StartServer(context.Background())
	code := m.Run()
	if shared.redis != nil {
		shared.redis.Close()
	}
	if code == 0 {
		// raft's NetworkTransport.Close stops its listener but leaves the
		// handlers of inbound connections reading until the peer closes
		// them: the in-process allocator clusters leave those behind.
		if err := goleak.Find(goleak.IgnoreAnyFunction("github.com/hashicorp/raft.(*NetworkTransport).handleConn")); err != nil {
			fmt.Fprintln(os.Stderr, "goleak:", err)
			code = 1
		}
	}
	os.Exit(code)
}

// sharedRedis returns a client of the shared server.
func sharedRedis(t testing.TB) *redis.Client {
	t.Helper()
	redistest.Require(t, shared.err)
	c := shared.redis.Client()
	t.Cleanup(func() { c.Close() })
	return c
}

var nsSeq struct {
	sync.Mutex
	n int
}

// namespace returns a fresh key namespace.
// clearOfDailyTurn waits, when the day's turn (UTC midnight, where the 24 h
// fixed windows of apiPolicy and basePolicy end) is less than a minute away,
// until it has passed: a test that counts exactly what such a window holds
// would otherwise see it reset midway. Redis's TIME reads this machine's
// clock.
func clearOfDailyTurn(t testing.TB) {
	t.Helper()
	const clear = time.Minute
	now := time.Now()
	turn := now.Truncate(24 * time.Hour).Add(24 * time.Hour)
	if left := turn.Sub(now); left < clear {
		t.Logf("waiting %s for the daily windows' turn to pass", left+time.Second)
		time.Sleep(left + time.Second)
	}
}

func namespace() string {
	nsSeq.Lock()
	defer nsSeq.Unlock()
	nsSeq.n++
	return fmt.Sprintf("t%d", nsSeq.n)
}

func mustParse(t testing.TB, src string) *policy.Document {
	t.Helper()
	doc, err := policy.Parse([]byte(src))
	if err != nil {
		t.Fatalf("policy: %v", err)
	}
	return doc
}

func canonical(t testing.TB, doc *policy.Document) []byte {
	t.Helper()
	b, err := policy.Canonical(doc)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func digestOf(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// testLogger logs warnings and errors of the code under test.
func testLogger(t testing.TB) *zap.Logger {
	return zaptest.NewLogger(t, zaptest.Level(zapcore.WarnLevel))
}

// fakeAllocator is an allocator without Raft: the real state machine (fsm)
// behind the real Connect API over TCP, with hooks that make Acquire lose
// answers, stall or answer garbage. Its leader clock is time.Now.
type fakeAllocator struct {
	allotv1connect.UnimplementedAllocatorServiceHandler
	allotv1connect.UnimplementedOperatorServiceHandler

	t    testing.TB
	addr string

	mu       sync.Mutex
	f        *fsm.FSM
	index    uint64
	acquires []*allotv1.AcquireRequest
	releases []*allotv1.ReleaseRequest
	// hook, when set, sees each Acquire first; commit runs it on the state
	// machine. It may return an answer of its own (garbage), an error, or
	// call commit and drop the answer.
	hook func(ctx context.Context, req *allotv1.AcquireRequest, commit func() (*allotv1.AcquireResponse, error)) (*allotv1.AcquireResponse, error)
	// inject are extra records streamed to WatchPolicy callers.
	inject chan *allotv1.PolicyRecord
	// stallRelease, when set, makes Release wait for its caller to give up
	// (an allocator that cannot be reached).
	stallRelease atomic.Bool
	// releaseDelay, when positive, delays every Release by that many
	// nanoseconds (a slow allocator).
	releaseDelay atomic.Int64
	// releaseCalls counts the Release calls received, stalled ones too.
	releaseCalls atomic.Int64
}

func startFakeAllocator(t testing.TB) *fakeAllocator {
	t.Helper()
	fa := &fakeAllocator{t: t, f: fsm.New(), inject: make(chan *allotv1.PolicyRecord, 16)}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	fa.addr = ln.Addr().String()
	mux := http.NewServeMux()
	mux.Handle(allotv1connect.NewAllocatorServiceHandler(fa))
	mux.Handle(allotv1connect.NewOperatorServiceHandler(fa))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		srv := allocator.HTTPServer(fa.addr, mux)
		_ = allocator.Serve(ctx, srv, ln, time.Second)
		_ = srv.Close() // Shutdown leaves connections that sent nothing yet
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	return fa
}

func (fa *fakeAllocator) apply(cmd fsm.Command) (any, error) {
	fa.mu.Lock()
	defer fa.mu.Unlock()
	cmd.NowUnixMs = time.Now().UnixMilli()
	b, err := fsm.Encode(cmd)
	if err != nil {
		return nil, err
	}
	fa.index++
	out := fa.f.Apply(&raft.Log{Type: raft.LogCommand, Index: fa.index, Data: b})
	if err, ok := out.(error); ok {
		return nil, err
	}
	return out, nil
}

// publish publishes doc as the next version and returns it.
func (fa *fakeAllocator) publish(doc *policy.Document) uint64 {
	fa.t.Helper()
	cur, _ := fa.f.Policy()
	out, err := fa.apply(fsm.Command{Type: fsm.CmdPublishPolicy, Publish: &fsm.Publish{
		ExpectedVersion: cur.Version + 1, Author: "test", Reason: "test", Document: canonical(fa.t, doc), Quotas: allocator.QuotaSpecs(doc),
	}})
	if err != nil {
		fa.t.Fatalf("publish: %v", err)
	}
	return out.(*fsm.PublishResult).Policy.Version
}

func (fa *fakeAllocator) acquireLog() []*allotv1.AcquireRequest {
	fa.mu.Lock()
	defer fa.mu.Unlock()
	return append([]*allotv1.AcquireRequest(nil), fa.acquires...)
}

func (fa *fakeAllocator) releaseLog() []*allotv1.ReleaseRequest {
	fa.mu.Lock()
	defer fa.mu.Unlock()
	return append([]*allotv1.ReleaseRequest(nil), fa.releases...)
}

func (fa *fakeAllocator) window(quota string) fsm.WindowView {
	fa.mu.Lock()
	defer fa.mu.Unlock()
	return fa.f.CurrentWindow(quota, time.Now().UnixMilli())
}

func (fa *fakeAllocator) grant(id string) (fsm.GrantView, bool) {
	fa.mu.Lock()
	defer fa.mu.Unlock()
	return fa.f.Grant(id)
}

func (fa *fakeAllocator) setHook(h func(ctx context.Context, req *allotv1.AcquireRequest, commit func() (*allotv1.AcquireResponse, error)) (*allotv1.AcquireResponse, error)) {
	fa.mu.Lock()
	fa.hook = h
	fa.mu.Unlock()
}

func toConnectErr(err error) error {
	switch {
	case errors.Is(err, fsm.ErrUnknownQuota), errors.Is(err, fsm.ErrUnknownGrant):
		return connect.NewError(connect.CodeNotFound, err)
	case errors.Is(err, fsm.ErrInvalidArgument):
		return connect.NewError(connect.CodeInvalidArgument, err)
	}
	return connect.NewError(connect.CodeInternal, err)
}

// Acquire implements AllocatorService.Acquire.
func (fa *fakeAllocator) Acquire(ctx context.Context, req *connect.Request[allotv1.AcquireRequest]) (*connect.Response[allotv1.AcquireResponse], error) {
	m := req.Msg
	fa.mu.Lock()
	fa.acquires = append(fa.acquires, m)
	hook := fa.hook
	fa.mu.Unlock()
	commit := func() (*allotv1.AcquireResponse, error) {
		out, err := fa.apply(fsm.Command{Type: fsm.CmdAcquire, Acquire: allocator.AcquireCommand(m)})
		if err != nil {
			return nil, toConnectErr(err)
		}
		return allocator.AcquireAnswer(out.(*fsm.AcquireResult)), nil
	}
	var resp *allotv1.AcquireResponse
	var err error
	if hook != nil {
		resp, err = hook(ctx, m, commit)
	} else {
		resp, err = commit()
	}
	if err != nil {
		return nil, err
	}
	return connect.NewResponse(resp), nil
}

// Release implements AllocatorService.Release.
func (fa *fakeAllocator) Release(ctx context.Context, req *connect.Request[allotv1.ReleaseRequest]) (*connect.Response[allotv1.ReleaseResponse], error) {
	fa.releaseCalls.Add(1)
	if fa.stallRelease.Load() {
		<-ctx.Done()
		return nil, connect.NewError(connect.CodeUnavailable, ctx.Err())
	}
	if d := time.Duration(fa.releaseDelay.Load()); d > 0 {
		select {
		case <-time.After(d):
		case <-ctx.Done():
			return nil, connect.NewError(connect.CodeUnavailable, ctx.Err())
		}
	}
	fa.mu.Lock()
	fa.releases = append(fa.releases, req.Msg)
	fa.mu.Unlock()
	out, err := fa.apply(fsm.Command{Type: fsm.CmdRelease, Release: &fsm.Release{Region: req.Msg.GetRegion(), GrantID: req.Msg.GetGrantId(), Tokens: req.Msg.GetTokens()}})
	if err != nil {
		return nil, toConnectErr(err)
	}
	res := out.(*fsm.ReleaseResult)
	return connect.NewResponse(&allotv1.ReleaseResponse{Returned: res.Returned, PoolRemaining: res.PoolRemaining}), nil
}

func recordOf(r fsm.PolicyRecord) *allotv1.PolicyRecord {
	return &allotv1.PolicyRecord{Version: r.Version, Author: r.Author, Reason: r.Reason, PublishedUnixMs: r.PublishedUnixMs,
		Document: r.Document, Digest: digestOf(r.Document)}
}

// GetPolicy implements OperatorService.GetPolicy.
func (fa *fakeAllocator) GetPolicy(_ context.Context, _ *connect.Request[allotv1.GetPolicyRequest]) (*connect.Response[allotv1.GetPolicyResponse], error) {
	fa.mu.Lock()
	r, ok := fa.f.Policy()
	fa.mu.Unlock()
	if !ok {
		return nil, connect.NewError(connect.CodeNotFound, errors.New("no policy has been published yet"))
	}
	return connect.NewResponse(&allotv1.GetPolicyResponse{Policy: recordOf(r)}), nil
}

// WatchPolicy implements OperatorService.WatchPolicy: published versions
// after the caller's, then injected records.
func (fa *fakeAllocator) WatchPolicy(ctx context.Context, req *connect.Request[allotv1.WatchPolicyRequest], stream *connect.ServerStream[allotv1.WatchPolicyResponse]) error {
	last := req.Msg.GetAfterVersion()
	t := time.NewTicker(10 * time.Millisecond)
	defer t.Stop()
	for {
		fa.mu.Lock()
		hist := fa.f.PolicyHistory()
		var recs []*allotv1.PolicyRecord
		for _, h := range hist {
			if h.Version > last {
				if r, ok := fa.f.PolicyVersion(h.Version); ok {
					recs = append(recs, recordOf(r))
					last = h.Version
				}
			}
		}
		fa.mu.Unlock()
		for _, r := range recs {
			if err := stream.Send(&allotv1.WatchPolicyResponse{Policy: r}); err != nil {
				return err
			}
		}
		select {
		case <-ctx.Done():
			return nil
		case r := <-fa.inject:
			if err := stream.Send(&allotv1.WatchPolicyResponse{Policy: r}); err != nil {
				return err
			}
		case <-t.C:
		}
	}
}

// testConfig is a config for fast tests: 20 ms ticks, 50 ms margin.
func testConfig(region string, endpoints ...string) agent.Config {
	cfg := agent.DefaultConfig()
	cfg.Region = region
	cfg.AllocatorEndpoints = endpoints
	cfg.Engine.Namespace = namespace()
	cfg.Engine.StoreTimeout = 500 * time.Millisecond // a shared CI machine: decide by the store, not the fail modes
	cfg.Lease.Tick = 20 * time.Millisecond
	cfg.Lease.IdlePoll = 200 * time.Millisecond
	cfg.Lease.Margin = 50 * time.Millisecond
	// A shared CI machine (and -race) can take over 50 ms for one deposit;
	// a timed-out deposit is withdrawn, which these tests do not expect.
	cfg.Lease.DepositTimeout = 500 * time.Millisecond
	cfg.Lease.AcquireTimeout = time.Second
	cfg.StarveWait = time.Second
	cfg.WatchBackoff = 20 * time.Millisecond
	cfg.MaxWatchBackoff = 200 * time.Millisecond
	return cfg
}

// newAgent builds an agent on rdb; it is not running.
func newAgent(t testing.TB, cfg agent.Config, rdb redis.UniversalClient, opts ...agent.Option) *agent.Agent {
	t.Helper()
	if len(cfg.AllocatorEndpoints) > 0 {
		c, err := allocator.NewClient(cfg.AllocatorEndpoints, allocator.WithAttempts(3), allocator.WithBackoff(20*time.Millisecond))
		if err != nil {
			t.Fatal(err)
		}
		opts = append([]agent.Option{agent.WithAllocatorClient(c)}, opts...)
	}
	a, err := agent.New(cfg, rdb, append([]agent.Option{agent.WithLogger(testLogger(t))}, opts...)...)
	if err != nil {
		t.Fatalf("agent.New: %v", err)
	}
	return a
}

// closeAtEnd closes, when the test ends, the store of an agent the test
// drives without Run (Renew, Check): Run with an ended context does nothing
// but its shutdown, which closes the store and its pipeline workers.
func closeAtEnd(t testing.TB, a *agent.Agent) {
	t.Cleanup(func() {
		ctx, cancel := context.WithCancel(context.Background())
		cancel()
		_ = a.Run(ctx)
	})
}

// running is an agent whose Run is going.
type running struct {
	*agent.Agent
	stop func() error
}

// runAgent runs a until the test ends (or stop is called).
func runAgent(t testing.TB, a *agent.Agent) *running {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- a.Run(ctx) }()
	var once sync.Once
	var err error
	stop := func() error {
		once.Do(func() {
			cancel()
			err = <-errc
		})
		return err
	}
	t.Cleanup(func() { _ = stop() })
	return &running{Agent: a, stop: stop}
}

// waitFor polls cond every 10 ms until it holds, failing the test after
// limit (a bound on the wait, not a timing assertion).
func waitFor(t testing.TB, limit time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(limit)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("gave up after %s waiting for %s", limit, what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// served is an agent with its Connect and Envoy APIs on real listeners.
type served struct {
	connect allotv1connect.AdmissionServiceClient
	// grpc is a Connect client speaking the gRPC protocol to the gRPC
	// listener (GRPCAdmissionService).
	grpc allotv1connect.AdmissionServiceClient
	rls  rlsv3.RateLimitServiceClient
	addr string
}

func serve(t testing.TB, a *agent.Agent) *served {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{}, 2)
	go func() {
		srv := allocator.HTTPServer(ln.Addr().String(), agent.Mux(a, nil))
		_ = allocator.Serve(ctx, srv, ln, time.Second)
		_ = srv.Close() // Shutdown leaves connections that sent nothing yet
		done <- struct{}{}
	}()
	gs := agent.NewGRPCServer(a)
	go func() {
		_ = gs.Serve(gln)
		done <- struct{}{}
	}()
	conn, err := grpc.NewClient(gln.Addr().String(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	hc := h2cClient()
	t.Cleanup(func() {
		conn.Close()
		hc.CloseIdleConnections()
		cancel()
		gs.Stop()
		<-done
		<-done
	})
	return &served{
		connect: allotv1connect.NewAdmissionServiceClient(hc, "http://"+ln.Addr().String()),
		grpc:    allotv1connect.NewAdmissionServiceClient(hc, "http://"+gln.Addr().String(), connect.WithGRPC()),
		rls:     rlsv3.NewRateLimitServiceClient(conn),
		addr:    ln.Addr().String(),
	}
}

// h2cClient speaks cleartext HTTP/2 only (prior knowledge): one connection
// multiplexes every caller, as gRPC does. A transport that also allows
// HTTP/1.1 picks HTTP/1.1 for http:// URLs, at about twice the CPU per call.
func h2cClient() *http.Client {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	return &http.Client{Transport: &http.Transport{Protocols: &p}}
}

// entries builds Connect descriptor entries from key, value pairs.
func entries(kv ...string) []*allotv1.DescriptorEntry {
	var es []*allotv1.DescriptorEntry
	for i := 0; i+1 < len(kv); i += 2 {
		es = append(es, &allotv1.DescriptorEntry{Key: kv[i], Value: kv[i+1]})
	}
	return es
}

func check(t testing.TB, c allotv1connect.AdmissionServiceClient, req *allotv1.CheckRequest) *allotv1.CheckResponse {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := c.Check(ctx, connect.NewRequest(req))
	if err != nil {
		t.Fatalf("Check(%v): %v", req, err)
	}
	return resp.Msg
}

// poolStats reads a pool through an engine of its own on the same store.
func poolStats(t testing.TB, rdb redis.UniversalClient, ns string, doc *policy.Document, quota string) admission.PoolStats {
	t.Helper()
	st, err := admission.NewRedisStore(rdb, admission.DefaultRedisConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer st.Close()
	cfg := admission.DefaultConfig()
	cfg.Namespace = ns
	e, err := admission.New(cfg, st, doc, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	ps, err := e.PoolStats(context.Background(), quota)
	if err != nil {
		t.Fatal(err)
	}
	return ps
}

// cluster is an in-process allocator cluster of real nodes over TCP (Raft
// on TCP, BoltDB, the Connect API), each node run by allocator.Run.
type cluster struct {
	t     testing.TB
	nodes []*clusterNode
}

type clusterNode struct {
	cfg    allocator.Config
	grpc   string // the node's gRPC listener (RunOptions.GRPCAddr)
	cancel context.CancelFunc
	done   chan error
}

// allocatorConfig states the bound's assumptions for one machine: no clock
// offset between nodes, sub-10ms store delay, and a 50 ms margin.
func startCluster(t testing.TB, n int) *cluster {
	t.Helper()
	c := &cluster{t: t}
	var peers []allocator.Peer
	dir := t.TempDir()
	for i := 0; i < n; i++ {
		raftAddr, err := topology.FreePort("127.0.0.1")
		if err != nil {
			t.Fatal(err)
		}
		apiAddr, err := topology.FreePort("127.0.0.1")
		if err != nil {
			t.Fatal(err)
		}
		grpcAddr, err := topology.FreePort("127.0.0.1")
		if err != nil {
			t.Fatal(err)
		}
		cfg := allocator.DefaultConfig()
		cfg.NodeID = fmt.Sprintf("a%d", i+1)
		cfg.RaftAddr, cfg.APIAddr = raftAddr, apiAddr
		cfg.DataDir = fmt.Sprintf("%s/a%d", dir, i+1)
		cfg.Bootstrap = true
		cfg.HeartbeatTimeout = 200 * time.Millisecond
		cfg.ElectionTimeout = 200 * time.Millisecond
		cfg.LeaderLeaseTimeout = 100 * time.Millisecond
		cfg.LeaseMargin = 50 * time.Millisecond
		cfg.MaxLeaderSkew = 10 * time.Millisecond
		cfg.MaxOneWayDelay = 10 * time.Millisecond
		peers = append(peers, allocator.Peer{ID: cfg.NodeID, RaftAddr: raftAddr, APIAddr: apiAddr})
		c.nodes = append(c.nodes, &clusterNode{cfg: cfg, grpc: grpcAddr})
	}
	for _, nd := range c.nodes {
		nd.cfg.Peers = peers
		c.start(nd)
	}
	t.Cleanup(c.close)
	waitFor(t, 30*time.Second, "an allocator leader", func() bool { return c.leader() >= 0 })
	return c
}

func (c *cluster) start(nd *clusterNode) {
	ctx, cancel := context.WithCancel(context.Background())
	nd.cancel, nd.done = cancel, make(chan error, 1)
	cfg, ro := nd.cfg, allocator.RunOptions{ShutdownGrace: time.Second, GRPCAddr: nd.grpc}
	go func() {
		nd.done <- allocator.Run(ctx, cfg, ro, zap.NewNop())
	}()
}

// stop stops node i gracefully.
func (c *cluster) stop(i int) {
	nd := c.nodes[i]
	if nd.cancel == nil {
		return
	}
	nd.cancel()
	<-nd.done
	nd.cancel = nil
}

func (c *cluster) close() {
	for i := range c.nodes {
		c.stop(i)
	}
}

func (c *cluster) endpoints() []string {
	var out []string
	for _, nd := range c.nodes {
		out = append(out, nd.cfg.APIAddr)
	}
	return out
}

// grpcEndpoints are the nodes' gRPC listeners, in node order.
func (c *cluster) grpcEndpoints() []string {
	var out []string
	for _, nd := range c.nodes {
		out = append(out, nd.grpc)
	}
	return out
}

// leader returns the index of the node that says it leads, or -1.
func (c *cluster) leader() int {
	for i, nd := range c.nodes {
		if nd.cancel == nil {
			continue
		}
		cl, err := allocator.NewClient([]string{nd.cfg.APIAddr}, allocator.WithAttempts(1))
		if err != nil {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		resp, err := cl.Operator().GetCluster(ctx, &allotv1.GetClusterRequest{})
		cancel()
		// A client left open keeps pinging its connection: a poll every
		// 10 ms would pile up thousands of them (it starved a race run).
		cl.Close()
		if err == nil && resp.GetState() == "Leader" {
			return i
		}
	}
	return -1
}

// publish publishes doc through any live node.
func (c *cluster) publish(doc *policy.Document, expected uint64) {
	c.t.Helper()
	var eps []string
	for _, nd := range c.nodes {
		if nd.cancel != nil {
			eps = append(eps, nd.cfg.APIAddr)
		}
	}
	cl, err := allocator.NewClient(eps)
	if err != nil {
		c.t.Fatal(err)
	}
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := cl.Operator().PublishPolicy(ctx, &allotv1.PublishPolicyRequest{
		Document: canonical(c.t, doc), ExpectedVersion: expected, Author: "test", Reason: "test",
	}); err != nil {
		c.t.Fatalf("publish: %v", err)
	}
}

// current returns the allocator's current record.
func (fa *fakeAllocator) current(t testing.TB) *allotv1.PolicyRecord {
	t.Helper()
	fa.mu.Lock()
	defer fa.mu.Unlock()
	r, ok := fa.f.Policy()
	if !ok {
		t.Fatal("nothing published")
	}
	return recordOf(r)
}
