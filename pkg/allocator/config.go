package allocator

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/allot-dev/allot/fsm"
	"github.com/allot-dev/allot/pkg/lease"
)

// Peer is one member of the initial cluster configuration.
type Peer struct {
	// ID is the peer's Raft server ID.
	ID string
	// RaftAddr is where the peer's Raft transport listens.
	RaftAddr string
	// APIAddr is where the peer's Connect API listens.
	APIAddr string
}

// ParsePeer parses "id=raftaddr=apiaddr"; both addresses must pass
// CheckDialAddr, as a member added later must.
func ParsePeer(s string) (Peer, error) {
	parts := strings.Split(s, "=")
	if len(parts) != 3 || parts[0] == "" || parts[1] == "" || parts[2] == "" {
		return Peer{}, fmt.Errorf("peer %q: want id=raft_address=api_address", s)
	}
	for i, name := range []string{"raft_address", "api_address"} {
		if err := CheckDialAddr(parts[1+i]); err != nil {
			return Peer{}, fmt.Errorf("peer %q: %s %q: %v", s, name, parts[1+i], err)
		}
	}
	return Peer{ID: parts[0], RaftAddr: parts[1], APIAddr: parts[2]}, nil
}

// String formats the peer as ParsePeer reads it.
func (p Peer) String() string { return p.ID + "=" + p.RaftAddr + "=" + p.APIAddr }

// Config configures one allocator node.
type Config struct {
	// NodeID is this node's Raft server ID; it must be unique and stable.
	NodeID string
	// RaftAddr is the TCP address the Raft transport binds and advertises.
	RaftAddr string
	// APIAddr is the address the Connect API listens on (and peers forward to).
	APIAddr string
	// DataDir holds the BoltDB log and stable store (raft.db), the
	// snapshots, and a marker file (allot-node.json) written once the node
	// has Raft state. A data dir whose marker or snapshots outlive the state
	// raft.db held, or whose raft.db is damaged, is refused
	// (ErrRaftStateLost, ErrRaftDBDamaged) rather than started from less
	// than the node had.
	DataDir string
	// Bootstrap makes this node bootstrap a new cluster from Peers when it has
	// no state yet; it is ignored when the data dir already holds a cluster.
	// It never bootstraps over a data dir that shows lost state, and an
	// empty data dir is refused when another of the Peers answers as a
	// cluster with a policy (ErrClusterRunning): a node that lost its data
	// is removed and joins again. It excludes RunOptions.Join.
	Bootstrap bool
	// Peers is the initial configuration (including this node) for Bootstrap,
	// and only read then; empty, Bootstrap makes a single-node cluster of this
	// node at its transport's address (the allocator command asks for that
	// explicitly: this node as its only -peer).
	Peers []Peer
	// HeartbeatTimeout is how long a follower waits without contact before it
	// starts an election.
	HeartbeatTimeout time.Duration
	// ElectionTimeout is how long a candidate waits before a new election.
	ElectionTimeout time.Duration
	// LeaderLeaseTimeout is how long a leader stays leader without a quorum.
	LeaderLeaseTimeout time.Duration
	// CommitTimeout bounds how long a follower waits for new entries before it
	// sends a heartbeat-like append.
	CommitTimeout time.Duration
	// ApplyTimeout bounds how long a proposal may wait to be enqueued.
	ApplyTimeout time.Duration
	// SnapshotThreshold is the number of log entries between snapshots.
	SnapshotThreshold uint64
	// SnapshotInterval is how often Raft checks whether to snapshot.
	SnapshotInterval time.Duration
	// TrailingLogs is how many entries stay in the log after a snapshot.
	TrailingLogs uint64
	// MaxWantsPerCall caps the quotas of one Acquire, at most fsm.MaxWants.
	// The default, 16,384, lets a region renew every quota it needs in one
	// call per tick; so many wants with quota names of the longest allowed
	// (fsm.MaxQuotaNameBytes) still fit the default MaxBodyBytes, request
	// and answer.
	MaxWantsPerCall int
	// MaxBodyBytes caps request bodies; larger ones get ResourceExhausted.
	MaxBodyBytes int
	// MaxWatchStreams caps the WatchPolicy streams this node serves at
	// once; a stream beyond it is refused with ResourceExhausted (a region
	// agent retries with backoff). Each open stream costs a goroutine or two
	// and, while a version is being sent, that version's document (up to
	// 1 MiB). The default, 1024, is one stream per region agent for 1024
	// agents on each node.
	MaxWatchStreams int
	// WatchSendTimeout bounds how long sending one policy version on a
	// WatchPolicy stream may take: a stream whose client does not read it
	// for that long is closed (the client reconnects, and is sent the
	// versions it lacks), rather than hold the version in memory and its
	// place under MaxWatchStreams. It applies when the node is served
	// through Server.Handler (as Mux and Run do). Default 10s.
	WatchSendTimeout time.Duration
	// CommitDelay is how long the leader may hold a batch of Acquire and
	// Release calls for companions before proposing it, under load only (see
	// CommitSiblings): fewer, larger Raft entries (each costs an fsync on
	// every replica) at the price of up to this much latency. The hold ends
	// early once as many calls wait as the previous entry carried. 0
	// proposes at once.
	CommitDelay time.Duration
	// CommitSiblings is the load that turns CommitDelay on: the previous
	// entry carried at least this many calls.
	CommitSiblings int
	// LeaseMargin is the margin regions subtract from lease deadlines; it feeds
	// the timing term of the stated bound.
	LeaseMargin time.Duration
	// MaxDriftPPM is the assumed maximum clock drift rate between machines, in
	// parts per million; it feeds the timing term of the stated bound.
	MaxDriftPPM int64
	// MaxLeaderSkew is the assumed maximum clock offset between allocator
	// nodes; it feeds the timing term of the stated bound.
	MaxLeaderSkew time.Duration
	// MaxOneWayDelay is the assumed maximum one-way delay from an agent to its
	// regional store; it feeds the timing term of the stated bound.
	MaxOneWayDelay time.Duration
	// StoreAsyncFailover states that regional stores fail over asynchronously
	// (losing acknowledged debits); it feeds the store_rollback term.
	StoreAsyncFailover bool
	// StoreReplicationLag is the assumed replication lag of such a failover.
	StoreReplicationLag time.Duration
	// GatewaysPerRegion is the most gateways (admission engines) any region
	// runs. It feeds the stated bound: the tokens parked in gateways'
	// in-process chunks, and the store_fallback term, which assumes every
	// gateway's admission Config.Gateways is at least this. Default 1.
	GatewaysPerRegion int
}

// DefaultConfig returns the shipped defaults: elections in well under 1.5 s on
// a LAN, snapshots every 8,192 entries.
func DefaultConfig() Config {
	return Config{
		HeartbeatTimeout:    500 * time.Millisecond,
		ElectionTimeout:     500 * time.Millisecond,
		LeaderLeaseTimeout:  250 * time.Millisecond,
		CommitTimeout:       5 * time.Millisecond,
		ApplyTimeout:        5 * time.Second,
		SnapshotThreshold:   8192,
		SnapshotInterval:    30 * time.Second,
		TrailingLogs:        10240,
		MaxWantsPerCall:     fsm.MaxWants,
		MaxBodyBytes:        4 << 20,
		MaxWatchStreams:     1024,
		WatchSendTimeout:    10 * time.Second,
		CommitDelay:         time.Millisecond,
		CommitSiblings:      8,
		LeaseMargin:         250 * time.Millisecond,
		MaxDriftPPM:         lease.DefaultMaxDriftPPM,
		MaxOneWayDelay:      100 * time.Millisecond,
		MaxLeaderSkew:       100 * time.Millisecond,
		StoreReplicationLag: time.Second,
		GatewaysPerRegion:   1,
	}
}

// ErrConfig marks an invalid configuration.
var ErrConfig = errors.New("invalid allocator config")

// Validate says what is wrong with the configuration: one error per bad
// setting, naming it, each an ErrConfig.
func (c Config) Validate() error {
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf(format+": %w", append(args, ErrConfig)...))
	}
	if c.NodeID == "" {
		bad("NodeID must not be empty")
	}
	if c.RaftAddr == "" {
		bad("RaftAddr must not be empty")
	}
	if c.APIAddr == "" {
		bad("APIAddr must not be empty")
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{
		{"HeartbeatTimeout", c.HeartbeatTimeout},
		{"ElectionTimeout", c.ElectionTimeout},
		{"LeaderLeaseTimeout", c.LeaderLeaseTimeout},
		{"ApplyTimeout", c.ApplyTimeout},
	} {
		if d.v <= 0 {
			bad("%s must be positive, got %s", d.name, d.v)
		}
	}
	if c.HeartbeatTimeout > 0 && c.LeaderLeaseTimeout > c.HeartbeatTimeout {
		bad("LeaderLeaseTimeout %s exceeds HeartbeatTimeout %s", c.LeaderLeaseTimeout, c.HeartbeatTimeout)
	}
	if c.MaxWantsPerCall <= 0 || c.MaxWantsPerCall > fsm.MaxWants {
		bad("MaxWantsPerCall must be in [1, %d], got %d", fsm.MaxWants, c.MaxWantsPerCall)
	}
	if c.MaxBodyBytes <= 0 {
		bad("MaxBodyBytes must be positive, got %d", c.MaxBodyBytes)
	}
	if c.MaxWatchStreams <= 0 {
		bad("MaxWatchStreams must be positive, got %d", c.MaxWatchStreams)
	}
	if c.WatchSendTimeout <= 0 {
		bad("WatchSendTimeout must be positive, got %s", c.WatchSendTimeout)
	}
	if c.CommitDelay < 0 || c.CommitDelay > time.Second {
		bad("CommitDelay must be in [0, 1s], got %s", c.CommitDelay)
	}
	if c.CommitSiblings < 1 {
		bad("CommitSiblings must be at least 1, got %d", c.CommitSiblings)
	}
	// The assumptions of the stated bound.
	for _, d := range []struct {
		name string
		v    time.Duration
	}{
		{"LeaseMargin", c.LeaseMargin},
		{"MaxOneWayDelay", c.MaxOneWayDelay},
		{"MaxLeaderSkew", c.MaxLeaderSkew},
		{"StoreReplicationLag", c.StoreReplicationLag},
	} {
		if d.v < 0 {
			bad("%s must not be negative, got %s", d.name, d.v)
		}
	}
	if c.MaxDriftPPM < 0 {
		bad("MaxDriftPPM must not be negative, got %d", c.MaxDriftPPM)
	}
	if c.GatewaysPerRegion < 1 {
		bad("GatewaysPerRegion must be at least 1, got %d", c.GatewaysPerRegion)
	}
	if !c.Bootstrap && len(c.Peers) > 0 {
		bad("Peers: %d initial members given without Bootstrap, which alone reads them", len(c.Peers))
	}
	if c.Bootstrap {
		self := false
		seen := map[string]bool{}
		for _, p := range c.Peers {
			if seen[p.ID] {
				bad("Peers: %q listed twice", p.ID)
			}
			seen[p.ID] = true
			if p.ID == c.NodeID {
				self = true
			}
		}
		if len(c.Peers) > 0 && !self {
			bad("Peers: the bootstrap peers do not include this node %q", c.NodeID)
		}
	}
	return errors.Join(errs...)
}
