package allocator

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"sync"
	"time"

	"github.com/hashicorp/raft"
	raftboltdb "github.com/hashicorp/raft-boltdb/v2"
	"go.uber.org/zap"

	"github.com/allot-dev/allot/fsm"
)

// Sentinel errors of the node; the Connect layer maps them to codes in one place.
var (
	// ErrNotLeader means this node cannot propose; the caller should retry on the leader.
	ErrNotLeader = errors.New("not the allocator leader")
	// ErrUnknownOutcome means a proposal was sent but leadership was lost before
	// it was known to be committed; retry with the same request id.
	ErrUnknownOutcome = errors.New("outcome unknown: leadership lost")
)

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

// WithRaftDeps injects stores and a transport instead of opening BoltDB and TCP.
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
	raft    *raft.Raft
	trans   raft.Transport
	closers []func() error
	metrics *Metrics

	peerAPI map[string]string // from the bootstrap configuration

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
	rc.MaxAppendEntries = 512
	rc.Logger = newHCLog(o.logger, "raft")
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
		}
	}

	r, err := raft.NewRaft(rc, n.fsm, deps.Logs, deps.Stable, deps.Snapshots, deps.Transport)
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
	return n, nil
}

func (n *Node) openDeps() (*RaftDeps, error) {
	if n.cfg.DataDir == "" {
		return nil, fmt.Errorf("data dir is empty: %w", ErrConfig)
	}
	if err := os.MkdirAll(n.cfg.DataDir, 0o750); err != nil {
		return nil, fmt.Errorf("data dir: %w", err)
	}
	store, err := raftboltdb.New(raftboltdb.Options{Path: filepath.Join(n.cfg.DataDir, "raft.db")})
	if err != nil {
		return nil, fmt.Errorf("open raft.db: %w", err)
	}
	n.closers = append(n.closers, store.Close)
	snaps, err := raft.NewFileSnapshotStoreWithLogger(n.cfg.DataDir, 3, newHCLog(n.log, "snapshots"))
	if err != nil {
		return nil, fmt.Errorf("open snapshots: %w", err)
	}
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
// records its own API address in the replicated member table so followers can
// forward to it.
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
					n.announceMembers()
				}()
			}
		}
	}
}

// announceMembers writes the API addresses this node knows (itself, and the
// bootstrap peers) into the member table when they are missing or stale.
func (n *Node) announceMembers() {
	known := n.fsm.Members()
	for id, api := range n.peerAPI {
		if known[id] == api {
			continue
		}
		ctx, cancel := context.WithTimeout(context.Background(), n.cfg.ApplyTimeout)
		_, err := n.Apply(ctx, fsm.Command{Type: fsm.CmdSetMember, Member: &fsm.SetMember{ID: id, APIAddress: api}})
		cancel()
		if err != nil {
			n.log.Warn("record member api address", zap.String("member", id), zap.Error(err))
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
	switch {
	case errors.Is(err, raft.ErrNotLeader), errors.Is(err, raft.ErrLeadershipTransferInProgress):
		return nil, ErrNotLeader
	case errors.Is(err, raft.ErrLeadershipLost), errors.Is(err, raft.ErrRaftShutdown), errors.Is(err, raft.ErrEnqueueTimeout):
		return nil, fmt.Errorf("apply: %w: %v", ErrUnknownOutcome, err)
	case err != nil:
		return nil, fmt.Errorf("apply: %w", err)
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
		timeout = time.Until(dl)
	}
	if err := n.raft.Barrier(timeout).Error(); err != nil {
		if errors.Is(err, raft.ErrNotLeader) || errors.Is(err, raft.ErrLeadershipLost) {
			return ErrNotLeader
		}
		return fmt.Errorf("barrier: %w", err)
	}
	return nil
}

// AddVoter adds a member and records its API address.
func (n *Node) AddVoter(ctx context.Context, p Peer) error {
	if n.raft.State() != raft.Leader {
		return ErrNotLeader
	}
	if err := n.raft.AddVoter(raft.ServerID(p.ID), raft.ServerAddress(p.RaftAddr), 0, n.cfg.ApplyTimeout).Error(); err != nil {
		if errors.Is(err, raft.ErrNotLeader) {
			return ErrNotLeader
		}
		return fmt.Errorf("add voter %q: %w", p.ID, err)
	}
	_, err := n.Apply(ctx, fsm.Command{Type: fsm.CmdSetMember, Member: &fsm.SetMember{ID: p.ID, APIAddress: p.APIAddr}})
	return err
}

// RemoveServer removes a member.
func (n *Node) RemoveServer(ctx context.Context, id string) error {
	if n.raft.State() != raft.Leader {
		return ErrNotLeader
	}
	if err := n.raft.RemoveServer(raft.ServerID(id), 0, n.cfg.ApplyTimeout).Error(); err != nil {
		if errors.Is(err, raft.ErrNotLeader) {
			return ErrNotLeader
		}
		return fmt.Errorf("remove server %q: %w", id, err)
	}
	if id == n.cfg.NodeID {
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
	f := n.raft.GetConfiguration()
	if err := f.Error(); err != nil {
		return nil, fmt.Errorf("configuration: %w", err)
	}
	_, lid := n.raft.LeaderWithID()
	var out []MemberInfo
	for _, s := range f.Configuration().Servers {
		out = append(out, MemberInfo{
			ID: string(s.ID), RaftAddr: string(s.Address), APIAddr: n.apiAddrOf(string(s.ID)),
			Suffrage: s.Suffrage.String(), Leader: s.ID == lid,
		})
	}
	return out, nil
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
// transfers leadership, so a rolling restart costs callers no failed call.
func (n *Node) Close() error {
	n.closeOnce.Do(func() {
		n.TransferLeadership()
		close(n.stop)
		n.proposer.close()
		err := n.raft.Shutdown().Error()
		n.wg.Wait()
		n.metrics.unregisterNode()
		n.closeErr = errors.Join(err, n.runClosers())
	})
	return n.closeErr
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
