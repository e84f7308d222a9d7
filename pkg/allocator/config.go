package allocator

import (
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/allot-dev/allot/fsm"
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

// ParsePeer parses "id=raftaddr=apiaddr".
func ParsePeer(s string) (Peer, error) {
	parts := strings.Split(s, "=")
	if len(parts) != 3 || parts[0] == "" || parts[1] == "" || parts[2] == "" {
		return Peer{}, fmt.Errorf("peer %q: want id=raft_address=api_address", s)
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
	// DataDir holds the BoltDB log and stable store and the snapshots.
	DataDir string
	// Bootstrap makes this node bootstrap a new cluster from Peers when it has
	// no state yet; it is ignored when the data dir already holds a cluster.
	Bootstrap bool
	// Peers is the initial configuration (including this node) for Bootstrap.
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
		CommitDelay:         time.Millisecond,
		CommitSiblings:      8,
		LeaseMargin:         250 * time.Millisecond,
		MaxDriftPPM:         200,
		MaxOneWayDelay:      100 * time.Millisecond,
		MaxLeaderSkew:       100 * time.Millisecond,
		StoreReplicationLag: time.Second,
	}
}

// ErrConfig marks an invalid configuration.
var ErrConfig = errors.New("invalid allocator config")

// Validate says what is wrong with the configuration.
func (c Config) Validate() error {
	switch {
	case c.NodeID == "":
		return fmt.Errorf("node id is empty: %w", ErrConfig)
	case c.RaftAddr == "":
		return fmt.Errorf("raft address is empty: %w", ErrConfig)
	case c.APIAddr == "":
		return fmt.Errorf("api address is empty: %w", ErrConfig)
	case c.HeartbeatTimeout <= 0 || c.ElectionTimeout <= 0 || c.LeaderLeaseTimeout <= 0:
		return fmt.Errorf("raft timeouts must be positive: %w", ErrConfig)
	case c.LeaderLeaseTimeout > c.HeartbeatTimeout:
		return fmt.Errorf("leader lease timeout %s exceeds heartbeat timeout %s: %w", c.LeaderLeaseTimeout, c.HeartbeatTimeout, ErrConfig)
	case c.ApplyTimeout <= 0:
		return fmt.Errorf("apply timeout must be positive: %w", ErrConfig)
	case c.MaxWantsPerCall <= 0 || c.MaxWantsPerCall > fsm.MaxWants:
		return fmt.Errorf("max wants per call must be in [1, %d]: %w", fsm.MaxWants, ErrConfig)
	case c.MaxBodyBytes <= 0:
		return fmt.Errorf("max body bytes must be positive: %w", ErrConfig)
	case c.CommitDelay < 0 || c.CommitDelay > time.Second:
		return fmt.Errorf("commit delay %s is not in [0, 1s]: %w", c.CommitDelay, ErrConfig)
	case c.CommitSiblings < 1:
		return fmt.Errorf("commit siblings %d must be at least 1: %w", c.CommitSiblings, ErrConfig)
	case c.LeaseMargin < 0 || c.MaxDriftPPM < 0 || c.MaxOneWayDelay < 0 || c.MaxLeaderSkew < 0 || c.StoreReplicationLag < 0:
		return fmt.Errorf("bound assumptions must not be negative: %w", ErrConfig)
	}
	if c.Bootstrap {
		self := false
		seen := map[string]bool{}
		for _, p := range c.Peers {
			if seen[p.ID] {
				return fmt.Errorf("peer %q listed twice: %w", p.ID, ErrConfig)
			}
			seen[p.ID] = true
			if p.ID == c.NodeID {
				self = true
			}
		}
		if len(c.Peers) > 0 && !self {
			return fmt.Errorf("bootstrap peers do not include this node %q: %w", c.NodeID, ErrConfig)
		}
	}
	return nil
}
