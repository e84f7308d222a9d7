package allocator

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/raft"
	"go.uber.org/zap"

	"github.com/allot-dev/allot/fsm"
)

// Sentinel errors of the node; the Connect layer maps them to codes in one place.
var (
	// ErrNotLeader means this node cannot propose; the caller should retry on the leader.
	ErrNotLeader = errors.New("not the allocator leader")
	// ErrUnknownOutcome means a Raft operation (a proposal, a barrier, a
	// membership change) may or may not have taken effect: leadership was
	// lost, Raft shut down, or the enqueue timed out. Retry (a proposal with
	// the same request id).
	ErrUnknownOutcome = errors.New("outcome unknown: leadership lost")
	// ErrMembershipRefused means Raft refused a membership change as invalid
	// for the current configuration (an address already used, no voter
	// left, a configuration that changed in between); the message says which.
	ErrMembershipRefused = errors.New("membership change refused")
)

// raftError maps the error of a Raft future to the node's sentinel errors,
// in one place for every path that waits on Raft (apply, barrier,
// membership changes, configuration reads), so each gets the same Connect
// code: not the leader, or a leadership transfer under way (nothing was
// enqueued) is ErrNotLeader; leadership lost, shutdown or an enqueue
// timeout (the entry may or may not commit) is ErrUnknownOutcome; both are
// Unavailable with a leader hint, which clients retry. A configuration
// Raft refused is ErrMembershipRefused. Anything else stays an internal
// error, wrapped with op.
func raftError(op string, err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, raft.ErrNotLeader):
		return fmt.Errorf("%s: %w", op, ErrNotLeader)
	case errors.Is(err, raft.ErrLeadershipTransferInProgress):
		return fmt.Errorf("%s: %w: leadership transfer in progress", op, ErrNotLeader)
	case errors.Is(err, raft.ErrLeadershipLost), errors.Is(err, raft.ErrRaftShutdown), errors.Is(err, raft.ErrEnqueueTimeout):
		return fmt.Errorf("%s: %w: %v", op, ErrUnknownOutcome, err)
	case isConfigurationError(err):
		return fmt.Errorf("%s: %w: %v", op, ErrMembershipRefused, err)
	}
	return fmt.Errorf("%s: %w", op, err)
}

// raftConfigurationErrors are the beginnings of the errors hashicorp/raft
// (v1.7) returns when it refuses a configuration change
// (checkConfiguration, nextConfiguration); it has no sentinels for them.
// TestRaftErrorMapsMembershipRefusals pins them against the raft in go.mod.
var raftConfigurationErrors = []string{
	"empty ID in configuration",
	"empty address in configuration",
	"found duplicate ID in configuration",
	"found duplicate address in configuration",
	"need at least one voter in configuration",
	"configuration changed since",
}

func isConfigurationError(err error) bool {
	msg := err.Error()
	for _, p := range raftConfigurationErrors {
		if strings.HasPrefix(msg, p) {
			return true
		}
	}
	return false
}

// await waits for f, or until ctx ends (f goes on, and its outcome is then
// unknown to the caller), and maps its error with raftError.
func await(ctx context.Context, op string, f raft.Future) error {
	done := make(chan error, 1)
	go func() { done <- f.Error() }()
	select {
	case err := <-done:
		return raftError(op, err)
	case <-ctx.Done():
		return fmt.Errorf("%s: %w", op, ctx.Err())
	}
}

// RaftDeps are the stores and transport of a node. Tests inject in-memory ones;
// production uses BoltDB, file snapshots and TCP.
type RaftDeps struct {
	Logs      raft.LogStore
	Stable    raft.StableStore
	Snapshots raft.SnapshotStore
	Transport raft.Transport
}

// Option customises a Node.
type Option func(*nodeOptions)

type nodeOptions struct {
	logger  *zap.Logger
	now     func() time.Time
	deps    *RaftDeps
	metrics *Metrics
}

// WithLogger sets the node's logger (default: no logging).
func WithLogger(l *zap.Logger) Option { return func(o *nodeOptions) { o.logger = l } }

// WithClock sets the leader clock stamped into proposals (default time.Now).
func WithClock(now func() time.Time) Option { return func(o *nodeOptions) { o.now = now } }

// WithRaftDeps injects stores and a transport instead of opening BoltDB and
// TCP; the node then has no data dir, and none of its checks (the marker,
// lost or damaged state, the bootstrap probe of the peers) applies.
func WithRaftDeps(d RaftDeps) Option { return func(o *nodeOptions) { o.deps = &d } }

// WithMetrics makes the node record into m (default: a private, unregistered set).
func WithMetrics(m *Metrics) Option { return func(o *nodeOptions) { o.metrics = m } }

// Node is one allocator: a Raft member whose state machine is fsm.FSM. It owns
// the background goroutines it starts; Close stops them.
type Node struct {
	cfg     Config
	log     *zap.Logger
	now     func() time.Time
	fsm     *fsm.FSM
	raftFSM *usedFSM // n.fsm as raft sees it
	raft    *raft.Raft
	trans   raft.Transport
	closers []func() error
	metrics *Metrics

	peerAPI map[string]string // from the bootstrap configuration

	dir *dataDir // nil when the stores are injected (WithRaftDeps)
	// snapMembers is the member table (id to API address) of the newest
	// snapshot in the data dir: whom to ask about the cluster before Raft
	// starts; nil without one.
	snapMembers map[string]string

	proposer *proposer

	stop chan struct{}
	wg   sync.WaitGroup

	closeOnce sync.Once
	closeErr  error
}

// NewNode opens (or creates) the node's state and starts Raft.
func NewNode(cfg Config, opts ...Option) (*Node, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	o := nodeOptions{logger: zap.NewNop(), now: time.Now}
	for _, opt := range opts {
		opt(&o)
	}
	if o.metrics == nil {
		o.metrics = NewMetrics(nil)
	}
	n := &Node{
		cfg:     cfg,
		log:     o.logger.Named("allocator").With(zap.String("node", cfg.NodeID)),
		now:     o.now,
		fsm:     fsm.New(),
		metrics: o.metrics,
		peerAPI: map[string]string{cfg.NodeID: cfg.APIAddr},
		stop:    make(chan struct{}),
	}
	for _, p := range cfg.Peers {
		n.peerAPI[p.ID] = p.APIAddr
	}
	deps := o.deps
	if deps == nil {
		d, err := n.openDeps()
		if err != nil {
			n.runClosers()
			return nil, err
		}
		deps = d
	}
	n.trans = deps.Transport

	// Raft's lines carry the node's id, like the node's own: several nodes
	// logging to one place (a test, a shared collector) stay apart.
	rc := raftConfig(cfg, o.logger.With(zap.String("node", cfg.NodeID)))
	if err := raft.ValidateConfig(rc); err != nil {
		n.runClosers()
		return nil, fmt.Errorf("raft config: %w", err)
	}

	if cfg.Bootstrap {
		has, err := raft.HasExistingState(deps.Logs, deps.Stable, deps.Snapshots)
		if err != nil {
			n.runClosers()
			return nil, fmt.Errorf("check existing state: %w", err)
		}
		if !has {
			if n.dir != nil {
				if n.dir.hadState() { // inspectDataDir and checkState refuse this already
					n.runClosers()
					return nil, n.dir.lostError("raft.db holds no Raft state")
				}
				if err := probeRunningCluster(cfg, n.log); err != nil {
					n.runClosers()
					return nil, err
				}
			}
			conf := raft.Configuration{}
			peers := cfg.Peers
			if len(peers) == 0 {
				peers = []Peer{{ID: cfg.NodeID, RaftAddr: string(deps.Transport.LocalAddr()), APIAddr: cfg.APIAddr}}
			}
			for _, p := range peers {
				conf.Servers = append(conf.Servers, raft.Server{Suffrage: raft.Voter, ID: raft.ServerID(p.ID), Address: raft.ServerAddress(p.RaftAddr)})
			}
			if err := raft.BootstrapCluster(rc, deps.Logs, deps.Stable, deps.Snapshots, deps.Transport, conf); err != nil {
				n.runClosers()
				return nil, fmt.Errorf("bootstrap: %w", err)
			}
			n.log.Info("bootstrapped a new cluster", zap.Int("voters", len(conf.Servers)))
			if n.dir != nil {
				if err := n.dir.mark(cfg.NodeID, "bootstrap"); err != nil {
					n.runClosers()
					return nil, err
				}
			}
		}
	}
	if n.dir != nil && n.dir.marker != nil && n.dir.marker.ClusterID != "" {
		// A node restarting on its state, whatever its flags: the members
		// it knows (its -bootstrap peers, its newest snapshot's member
		// table) must not run another cluster of the same ids and
		// addresses. A -join target was asked already (Run).
		if err := probePeersCluster(n.knownPeers(), n.dir.marker, n.log); err != nil {
			n.runClosers()
			return nil, err
		}
	}

	n.raftFSM = &usedFSM{FSM: n.fsm}
	r, err := raft.NewRaft(rc, n.raftFSM, deps.Logs, deps.Stable, deps.Snapshots, deps.Transport)
	n.raftFSM.started.Store(true)
	if err != nil {
		n.runClosers()
		return nil, fmt.Errorf("start raft: %w", err)
	}
	n.raft = r
	n.proposer = newProposer(n)
	n.metrics.registerNode(n)

	obsCh := make(chan raft.Observation, 16)
	observer := raft.NewObserver(obsCh, false, func(o *raft.Observation) bool {
		_, ok := o.Data.(raft.LeaderObservation)
		return ok
	})
	r.RegisterObserver(observer)
	n.wg.Add(1)
	go func() {
		defer n.wg.Done()
		defer r.DeregisterObserver(observer)
		n.watchLeadership(obsCh)
	}()
	if n.dir != nil {
		n.wg.Add(1)
		go func() {
			defer n.wg.Done()
			n.tendMarker()
		}()
	}
	return n, nil
}

// tendMarker completes the data dir's marker as the node learns, and
// watches that the state stays the marked cluster's. It writes the marker
// once a node that started without Raft state (a node that joins, or a new
// member started without -join) has its first entries or snapshot from a
// leader, and records the cluster's id once the state machine has applied
// it. Should the state machine then hold another cluster's id (a snapshot
// installed by the leader of a cluster founded again with the same node ids
// and addresses, which the start-up checks could not see), it says so once,
// as an error: the two clusters' states are mixed.
func (n *Node) tendMarker() {
	t := time.NewTicker(200 * time.Millisecond)
	defer t.Stop()
	warned := false
	for {
		if n.dir.marker == nil && n.raft.LastIndex() > 0 {
			if err := n.dir.mark(n.cfg.NodeID, "replicated"); err != nil {
				n.log.Error("the data dir's marker could not be written; it is written at the next start", zap.Error(err))
				return
			}
			n.log.Info("first Raft entries stored; data dir marked", zap.String("marker", filepath.Join(n.dir.path, markerName)))
		}
		id := n.fsm.ClusterID()
		switch m := n.dir.marker; {
		case m == nil || id == "":
		case m.ClusterID == id:
			t.Reset(time.Second) // the state is the marked cluster's: watch it at leisure
		case m.ClusterID == "":
			if err := n.dir.setClusterID(id); err != nil {
				n.log.Error("the cluster's id could not be recorded in the data dir's marker; it is recorded at the next start", zap.Error(err))
				return
			}
			n.log.Info("cluster id recorded in the data dir's marker", zap.String("cluster", id))
		case !warned:
			warned = true
			n.log.Error("this node's state machine holds the state of another cluster than its data dir's: the states of two clusters "+
				"founded with the same node ids and addresses are mixed. Stop the nodes of the cluster that should not exist, "+
				"and recover this node (docs/operations.md, \"Recover an allocator node\")",
				zap.String("marked_cluster", m.ClusterID), zap.String("state_cluster", id), zap.String("marker", filepath.Join(n.dir.path, markerName)))
		}
		select {
		case <-n.stop:
			return
		case <-t.C:
		}
	}
}

// knownPeers returns n's configuration with Peers set to the members it
// knows before Raft starts: its -bootstrap peers and its newest snapshot's
// member table, each id once (the -peer flag's address first), sorted.
func (n *Node) knownPeers() Config {
	cfg := n.cfg
	api := map[string]string{}
	if cfg.Bootstrap {
		for _, p := range cfg.Peers {
			api[p.ID] = p.APIAddr
		}
	}
	for id, a := range n.snapMembers {
		if _, ok := api[id]; !ok {
			api[id] = a
		}
	}
	cfg.Peers = nil
	for _, id := range slices.Sorted(maps.Keys(api)) {
		cfg.Peers = append(cfg.Peers, Peer{ID: id, APIAddr: api[id]})
	}
	return cfg
}

// snapshotMembers reads the member table of the snapshot at path, or nil
// (logged) when it cannot: a hint, and Raft checks the snapshot itself.
func snapshotMembers(path string, log *zap.Logger) map[string]string {
	f, err := os.Open(path)
	if err != nil {
		log.Debug("read the newest snapshot's member table", zap.Error(err))
		return nil
	}
	defer f.Close()
	ms, _, err := fsm.SnapshotMembers(f)
	if err != nil {
		log.Debug("read the newest snapshot's member table", zap.String("snapshot", path), zap.Error(err))
		return nil
	}
	return ms
}

// newClusterID returns a random cluster id: 128 bits in hex.
func newClusterID() (string, error) {
	var b [16]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	return hex.EncodeToString(b[:]), nil
}

// recordClusterID gives the cluster an id when its state has none: a new
// cluster's first leader, or the first leader of a build with cluster ids.
// A proposal that fails is tried again (up to five times, a second apart)
// while this node leads; two leaders in turn may both propose one, and the
// first committed stays (fsm.SetCluster).
func (n *Node) recordClusterID() {
	for attempt := 0; attempt < 5; attempt++ {
		if attempt > 0 {
			select {
			case <-n.stop:
				return
			case <-time.After(time.Second):
			}
		}
		if n.fsm.ClusterID() != "" || n.raft.State() != raft.Leader {
			return
		}
		id, err := newClusterID()
		if err != nil {
			n.log.Warn("make a cluster id", zap.Error(err))
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), n.cfg.ApplyTimeout)
		res, err := n.Apply(ctx, fsm.Command{Type: fsm.CmdSetCluster, Cluster: &fsm.SetCluster{ID: id}})
		cancel()
		if err != nil {
			n.log.Warn("record the cluster's id", zap.Int("attempt", attempt+1), zap.Error(err))
			continue
		}
		if r, ok := res.(*fsm.SetClusterResult); ok && r.Set {
			n.log.Info("cluster id recorded", zap.String("cluster", r.ID))
		}
		return
	}
}

// maxAppendEntries caps the entries of one AppendEntries message (and the
// applies the leader dispatches at once). The proposer already group-commits
// up to fsm.MaxBatch calls into one entry, so more entries per message buy
// little, while an entry may be large: a full batch carries up to about
// 2 x fsm.MaxWants wants, several MB of JSON. A follower catching up gets up
// to this many entries in one message, held in memory on both ends: at 512
// that could reach GBs; at 64 (raft's default) the worst case is a few
// hundred MB and the common case (small entries) is unchanged.
const maxAppendEntries = 64

// raftConfig returns the Raft configuration of a node with cfg.
func raftConfig(cfg Config, log *zap.Logger) *raft.Config {
	rc := raft.DefaultConfig()
	rc.LocalID = raft.ServerID(cfg.NodeID)
	rc.HeartbeatTimeout = cfg.HeartbeatTimeout
	rc.ElectionTimeout = cfg.ElectionTimeout
	rc.LeaderLeaseTimeout = cfg.LeaderLeaseTimeout
	rc.CommitTimeout = cfg.CommitTimeout
	if cfg.SnapshotThreshold > 0 {
		rc.SnapshotThreshold = cfg.SnapshotThreshold
	}
	if cfg.SnapshotInterval > 0 {
		rc.SnapshotInterval = cfg.SnapshotInterval
	}
	if cfg.TrailingLogs > 0 {
		rc.TrailingLogs = cfg.TrailingLogs
	}
	rc.BatchApplyCh = true
	rc.MaxAppendEntries = maxAppendEntries
	rc.Logger = newHCLog(log, "raft")
	return rc
}

// openDeps opens the node's stores in its data dir, and its transport. It
// refuses a data dir whose Raft state is lost or damaged (inspectDataDir,
// checkState) rather than start from less than the node had, and marks a
// data dir with state that has no marker yet (one from an older build).
func (n *Node) openDeps() (*RaftDeps, error) {
	if n.cfg.DataDir == "" {
		return nil, fmt.Errorf("DataDir must not be empty: %w", ErrConfig)
	}
	if err := os.MkdirAll(n.cfg.DataDir, 0o750); err != nil {
		return nil, fmt.Errorf("data dir: %w", err)
	}
	dir, err := inspectDataDir(n.cfg.DataDir, n.cfg.NodeID)
	if err != nil {
		return nil, err
	}
	store, st, err := openRaftDB(filepath.Join(n.cfg.DataDir, raftDBName))
	if err != nil {
		return nil, err
	}
	n.closers = append(n.closers, store.Close)
	snaps, err := raft.NewFileSnapshotStoreWithLogger(n.cfg.DataDir, 3, newHCLog(n.log, "snapshots"))
	if err != nil {
		return nil, fmt.Errorf("open snapshots: %w", err)
	}
	metas, err := snaps.List()
	if err != nil {
		return nil, fmt.Errorf("list snapshots: %w", err)
	}
	if err := dir.checkState(st, metas); err != nil {
		return nil, err
	}
	if len(metas) > 0 {
		n.snapMembers = snapshotMembers(filepath.Join(n.cfg.DataDir, snapshotsName, metas[0].ID, snapStateName), n.log)
	}
	if dir.marker == nil && hasEntries(st, metas) {
		// State written by a build that predates the marker.
		if err := dir.mark(n.cfg.NodeID, "existing"); err != nil {
			return nil, err
		}
		n.log.Info("data dir marked: it holds Raft state", zap.String("marker", filepath.Join(dir.path, markerName)))
	}
	n.dir = dir
	addr, err := net.ResolveTCPAddr("tcp", n.cfg.RaftAddr)
	if err != nil {
		return nil, fmt.Errorf("raft address %q: %w", n.cfg.RaftAddr, err)
	}
	trans, err := raft.NewTCPTransportWithLogger(n.cfg.RaftAddr, addr, 8, 10*time.Second, newHCLog(n.log, "transport"))
	if err != nil {
		return nil, fmt.Errorf("raft transport: %w", err)
	}
	n.closers = append(n.closers, trans.Close)
	return &RaftDeps{Logs: store, Stable: store, Snapshots: snaps, Transport: trans}, nil
}

func (n *Node) runClosers() error {
	var errs []error
	for i := len(n.closers) - 1; i >= 0; i-- {
		if err := n.closers[i](); err != nil {
			errs = append(errs, err)
		}
	}
	n.closers = nil
	return errors.Join(errs...)
}

// watchLeadership counts leader changes and, when this node becomes leader,
// records its own API address in the replicated member table so followers
// can forward to it, then gives the cluster an id if it has none.
func (n *Node) watchLeadership(obs <-chan raft.Observation) {
	var lastLeader raft.ServerID
	for {
		select {
		case <-n.stop:
			return
		case o := <-obs:
			lo, ok := o.Data.(raft.LeaderObservation)
			if !ok || lo.LeaderID == lastLeader {
				continue
			}
			lastLeader = lo.LeaderID
			n.metrics.LeaderChanges.Inc()
			n.log.Info("leader changed", zap.String("leader", string(lo.LeaderID)))
			if lo.LeaderID == raft.ServerID(n.cfg.NodeID) {
				n.wg.Add(1)
				go func() {
					defer n.wg.Done()
					n.announceMembers() // first: followers forward to the address it records
					n.recordClusterID()
				}()
			}
		}
	}
}

// announceMembers brings the member table in line with the Raft
// configuration: it records this node's API address (and a bootstrap
// peer's, when the table has none) and drops the entries of servers that
// are no longer members. A leader that removes itself steps down before it
// can drop its own entry, and a removal whose table update failed leaves
// one behind: the next leader cleans both up here.
func (n *Node) announceMembers() {
	// The table is read before the configuration: a member is added to the
	// configuration before its entry is written, so an entry read here
	// whose server is not in the configuration read after it is stale.
	known := n.fsm.Members()
	f := n.raft.GetConfiguration()
	if err := f.Error(); err != nil {
		n.log.Warn("read configuration to record members", zap.Error(err))
		return
	}
	inConf := map[string]bool{}
	for _, s := range f.Configuration().Servers {
		inConf[string(s.ID)] = true
	}
	var changes []fsm.SetMember
	for id, api := range n.peerAPI {
		if inConf[id] && (known[id] == "" || id == n.cfg.NodeID && known[id] != api) {
			changes = append(changes, fsm.SetMember{ID: id, APIAddress: api})
		}
	}
	for id := range known {
		if !inConf[id] {
			changes = append(changes, fsm.SetMember{ID: id, Remove: true})
		}
	}
	slices.SortFunc(changes, func(a, b fsm.SetMember) int { return strings.Compare(a.ID, b.ID) })
	for _, c := range changes {
		ctx, cancel := context.WithTimeout(context.Background(), n.cfg.ApplyTimeout)
		_, err := n.Apply(ctx, fsm.Command{Type: fsm.CmdSetMember, Member: &c})
		cancel()
		if err != nil {
			n.log.Warn("update member table", zap.String("member", c.ID), zap.Bool("remove", c.Remove), zap.Error(err))
			return
		}
	}
}

// FSM returns the node's state machine for reads.
func (n *Node) FSM() *fsm.FSM { return n.fsm }

// Raft returns the underlying Raft instance.
func (n *Node) Raft() *raft.Raft { return n.raft }

// ID returns the node's server ID.
func (n *Node) ID() string { return n.cfg.NodeID }

// Config returns the node's configuration.
func (n *Node) Config() Config { return n.cfg }

// IsLeader reports whether this node currently believes it is the leader.
func (n *Node) IsLeader() bool { return n.raft.State() == raft.Leader }

// Leader returns the leader's ID and API address, as far as this node knows.
func (n *Node) Leader() (id, apiAddr string) {
	_, lid := n.raft.LeaderWithID()
	if lid == "" {
		return "", ""
	}
	return string(lid), n.apiAddrOf(string(lid))
}

func (n *Node) apiAddrOf(id string) string {
	if a, ok := n.fsm.Members()[id]; ok {
		return a
	}
	return n.peerAPI[id]
}

// Apply stamps the leader's clock into cmd, proposes it and waits for it to be
// committed and applied. It returns the FSM's result, or the FSM's error.
// Concurrent Acquire and Release calls are group-committed into one entry.
func (n *Node) Apply(ctx context.Context, cmd fsm.Command) (any, error) {
	if n.raft.State() != raft.Leader {
		return nil, ErrNotLeader
	}
	if cmd.Type == fsm.CmdAcquire || cmd.Type == fsm.CmdRelease {
		return n.proposer.propose(ctx, cmd)
	}
	type result struct {
		res any
		err error
	}
	done := make(chan result, 1)
	go func() {
		res, err := n.applyNow(cmd)
		done <- result{res, err}
	}()
	select {
	case r := <-done:
		return r.res, r.err
	case <-ctx.Done():
		// The entry may still commit; the caller retries with the same request id.
		return nil, fmt.Errorf("apply: %w", ctx.Err())
	}
}

// applyNow stamps, proposes and waits for one entry.
func (n *Node) applyNow(cmd fsm.Command) (any, error) {
	cmd.NowUnixMs = n.now().UnixMilli()
	b, err := fsm.Encode(cmd)
	if err != nil {
		return nil, fmt.Errorf("encode: %w", err)
	}
	start := time.Now()
	f := n.raft.Apply(b, n.cfg.ApplyTimeout)
	err = f.Error()
	n.metrics.ApplyLatency.Observe(time.Since(start).Seconds())
	if err != nil {
		return nil, raftError("apply", err)
	}
	resp := f.Response()
	if e, ok := resp.(error); ok {
		return nil, e
	}
	return resp, nil
}

// Barrier waits until every entry committed before the call is applied
// locally, so reads on the leader that follow are linearizable.
func (n *Node) Barrier(ctx context.Context) error {
	if n.raft.State() != raft.Leader {
		return ErrNotLeader
	}
	timeout := n.cfg.ApplyTimeout
	if dl, ok := ctx.Deadline(); ok {
		if timeout = time.Until(dl); timeout <= 0 {
			// Raft reads a zero timeout as none at all.
			return fmt.Errorf("barrier: %w", context.DeadlineExceeded)
		}
	}
	return await(ctx, "barrier", n.raft.Barrier(timeout))
}

// AddNonvoter adds p as a non-voter, which receives the log but counts
// towards no quorum (an unreachable or mistyped address costs the cluster
// nothing), and records p's API address in the member table. A server
// that is already a member keeps its suffrage (Raft then only updates its
// address). Promote makes it a voter once it has caught up.
func (n *Node) AddNonvoter(ctx context.Context, p Peer) error {
	if n.raft.State() != raft.Leader {
		return ErrNotLeader
	}
	op := fmt.Sprintf("add non-voter %q", p.ID)
	if err := await(ctx, op, n.raft.AddNonvoter(raft.ServerID(p.ID), raft.ServerAddress(p.RaftAddr), 0, n.cfg.ApplyTimeout)); err != nil {
		return err
	}
	return n.RecordMember(ctx, p.ID, p.APIAddr)
}

// Promote makes the member p a voter, provided the configuration is still
// the one at index prevIndex (0: whatever it is), so that a member removed
// meanwhile is not added back.
func (n *Node) Promote(ctx context.Context, p Peer, prevIndex uint64) error {
	if n.raft.State() != raft.Leader {
		return ErrNotLeader
	}
	op := fmt.Sprintf("promote %q to voter", p.ID)
	return await(ctx, op, n.raft.AddVoter(raft.ServerID(p.ID), raft.ServerAddress(p.RaftAddr), prevIndex, n.cfg.ApplyTimeout))
}

// RecordMember records the API address of member id in the member table,
// unless the table holds it already.
func (n *Node) RecordMember(ctx context.Context, id, apiAddr string) error {
	if n.fsm.Members()[id] == apiAddr {
		return nil
	}
	_, err := n.Apply(ctx, fsm.Command{Type: fsm.CmdSetMember, Member: &fsm.SetMember{ID: id, APIAddress: apiAddr}})
	return err
}

// RemoveServer removes a member and its member table entry.
func (n *Node) RemoveServer(ctx context.Context, id string) error {
	if n.raft.State() != raft.Leader {
		return ErrNotLeader
	}
	if err := await(ctx, fmt.Sprintf("remove server %q", id), n.raft.RemoveServer(raft.ServerID(id), 0, n.cfg.ApplyTimeout)); err != nil {
		return err
	}
	if id == n.cfg.NodeID {
		// This node stepped down when its removal committed, so it can no
		// longer write the table: the next leader drops the entry
		// (announceMembers).
		return nil
	}
	_, err := n.Apply(ctx, fsm.Command{Type: fsm.CmdSetMember, Member: &fsm.SetMember{ID: id, Remove: true}})
	return err
}

// MemberInfo is one member as GetCluster reports it.
type MemberInfo struct {
	ID, RaftAddr, APIAddr, Suffrage string
	Leader                          bool
}

// Members returns the Raft configuration with API addresses.
func (n *Node) Members() ([]MemberInfo, error) {
	ms, _, err := n.membership()
	return ms, err
}

// membership returns the Raft configuration with API addresses, and the
// index of the log entry that holds it.
func (n *Node) membership() ([]MemberInfo, uint64, error) {
	f := n.raft.GetConfiguration()
	if err := f.Error(); err != nil {
		return nil, 0, raftError("configuration", err)
	}
	_, lid := n.raft.LeaderWithID()
	var out []MemberInfo
	for _, s := range f.Configuration().Servers {
		out = append(out, MemberInfo{
			ID: string(s.ID), RaftAddr: string(s.Address), APIAddr: n.apiAddrOf(string(s.ID)),
			Suffrage: s.Suffrage.String(), Leader: s.ID == lid,
		})
	}
	return out, f.Index(), nil
}

// TransferLeadership hands leadership to another voter when this node leads
// and has one; it is the first step of a graceful shutdown.
func (n *Node) TransferLeadership() {
	if n.raft.State() != raft.Leader || n.otherVoters() == 0 {
		return
	}
	if err := n.raft.LeadershipTransfer().Error(); err != nil {
		n.log.Warn("leadership transfer before shutdown failed", zap.Error(err))
		return
	}
	n.log.Info("transferred leadership before shutdown")
}

// Close shuts the node down gracefully: a leader with other voters first
// transfers leadership, so a rolling restart costs callers no failed call;
// then the node snapshots what it applied (snapshotForShutdown).
func (n *Node) Close() error {
	n.closeOnce.Do(func() {
		n.TransferLeadership()
		close(n.stop)
		n.proposer.close()
		n.snapshotForShutdown()
		err := n.raft.Shutdown().Error()
		n.wg.Wait()
		n.metrics.unregisterNode()
		n.closeErr = errors.Join(err, n.runClosers())
	})
	return n.closeErr
}

// snapshotForShutdown snapshots everything the node applied, so that it
// restarts from the snapshot and applies no entry a second time. An
// upgraded build may apply an old entry differently from the build that
// applied it first (a window change under newer carry rules): replayed on
// one node and not on another (whose snapshot was newer), it would make
// the replicas diverge. It also makes the restart faster. A node that
// applied nothing since its last snapshot has nothing to do.
func (n *Node) snapshotForShutdown() {
	if n.cfg.DataDir == "" {
		return // in-memory stores: nothing survives the shutdown
	}
	if !n.raftFSM.used.Load() {
		// raft refuses (ErrNothingNewToSnapshot), but logs the refusal as
		// an error with a stack trace first: every restart of an idle node
		// would look like a failure to whoever alerts on errors.
		return
	}
	err := n.raft.Snapshot().Error()
	switch {
	case err == nil:
		n.log.Info("snapshot taken before shutdown", zap.Uint64("applied_index", n.raft.AppliedIndex()))
	case errors.Is(err, raft.ErrNothingNewToSnapshot):
	default:
		n.log.Warn("snapshot before shutdown failed; the restart replays the log since the last snapshot", zap.Error(err))
	}
}

func (n *Node) otherVoters() int {
	f := n.raft.GetConfiguration()
	if f.Error() != nil {
		return 0
	}
	c := 0
	for _, s := range f.Configuration().Servers {
		if s.Suffrage == raft.Voter && s.ID != raft.ServerID(n.cfg.NodeID) {
			c++
		}
	}
	return c
}

// usedFSM is the FSM as raft drives it, noting whether raft applied an
// entry or restored a snapshot since the node started: only then can raft
// take a snapshot (its FSM loop refuses with ErrNothingNewToSnapshot
// otherwise, even when a no-op entry moved the applied index).
type usedFSM struct {
	*fsm.FSM
	used    atomic.Bool
	started atomic.Bool // raft.NewRaft returned: a restore is no longer its start-up restore
}

func (u *usedFSM) Apply(l *raft.Log) any {
	u.used.Store(true)
	return u.FSM.Apply(l)
}

func (u *usedFSM) Restore(rc io.ReadCloser) error {
	// raft.NewRaft restores the newest snapshot itself, outside its FSM
	// loop, which then still has nothing to snapshot.
	if u.started.Load() {
		u.used.Store(true)
	}
	return u.FSM.Restore(rc)
}
