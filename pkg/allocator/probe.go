package allocator

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	"connectrpc.com/connect"
	"go.uber.org/zap"

	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
	"github.com/allot-dev/allot/proto/allot/v1/allotv1connect"
)

// bootstrapProbeTimeout bounds how long a node that bootstraps from an
// empty data dir waits for its bootstrap peers' answers.
const bootstrapProbeTimeout = time.Second

// probeRunningCluster asks the other bootstrap peers (their API, GetCluster,
// all at once, for at most bootstrapProbeTimeout) whether they run a
// cluster already, before a node with an empty data dir bootstraps. A peer
// that answers with a published policy runs a cluster that may have granted
// quotas: this node lost its data dir (restarted with the flags it was
// founded with) or was never started while the others went on without it.
// Bootstrapping would make it a voter that forgot the votes and entries it
// acknowledged, so it refuses (ErrClusterRunning). Peers that do not answer,
// or answer without a policy (founders starting together), are no reason
// to refuse: the probe only catches what it can see.
func probeRunningCluster(cfg Config, log *zap.Logger) error {
	var running *peerAnswer
	for _, a := range askPeers(cfg, log) {
		if a.resp.GetPolicyVersion() > 0 {
			running = &a
			break
		}
	}
	if running == nil {
		return nil
	}
	r, p := running.resp, running.peer
	listed := false
	for _, m := range r.GetMembers() {
		listed = listed || m.GetId() == cfg.NodeID
	}
	what := fmt.Sprintf("peer %s (%s) answers as a running cluster (policy v%d, term %d, commit index %d, members %s)",
		p.ID, p.APIAddr, r.GetPolicyVersion(), r.GetTerm(), r.GetCommitIndex(), memberIDs(r.GetMembers()))
	if listed && r.GetLeaderId() == "" {
		// A majority lost: no leader can remove this node, and the
		// survivors need it back (empty, at its address) to elect one.
		return fmt.Errorf("-bootstrap with an empty data dir %s, but %s that lists this node %q and knows no leader: %w. "+
			"If a majority of the cluster is lost, start this node with the empty data dir, the same -id and "+
			"-raft-addr, and -join %s instead of -bootstrap and -peer: the survivors elect a leader with its vote and "+
			"it catches up (docs/operations.md, \"Recover from a lost majority\")",
			cfg.DataDir, what, cfg.NodeID, ErrClusterRunning, p.APIAddr)
	}
	if listed {
		return fmt.Errorf("-bootstrap with an empty data dir %s, but %s that lists this node %q: %w. This node lost its data "+
			"dir, or was never started while the others went on without it; bootstrapping would make it a voter that "+
			"forgot the votes and entries it acknowledged. Remove it (allotctl -addr %s member remove %s), then start "+
			"it with the empty data dir and -join %s instead of -bootstrap and -peer: it joins as a non-voter and is "+
			"promoted once it has caught up (docs/operations.md, \"Recover an allocator node\")",
			cfg.DataDir, what, cfg.NodeID, ErrClusterRunning, p.APIAddr, cfg.NodeID, p.APIAddr)
	}
	return fmt.Errorf("-bootstrap with an empty data dir %s, but %s without this node %q: %w. A node joins a running "+
		"cluster with -join %s, not -bootstrap", cfg.DataDir, what, cfg.NodeID, ErrClusterRunning, p.APIAddr)
}

// otherCluster refuses, with ErrForeignState, to start on a data dir marked
// with a cluster id (m) when a member (who; its API at addr) answered (r)
// with another one: one of the two clusters was torn down and founded again
// with the same node ids and addresses, and Raft would mix their states
// (the node with the higher term and the longer log wins an election and
// overwrites the others' logs, never what their state machines applied).
// Either id missing (a marker or a cluster of an older build, or a cluster
// whose first leader has not recorded one yet) is no reason.
func otherCluster(cfg Config, m *dataDirMarker, who, addr string, r *allotv1.GetClusterResponse) error {
	if m.ClusterID == "" || r.GetClusterId() == "" || r.GetClusterId() == m.ClusterID {
		return nil
	}
	return fmt.Errorf("data dir %s holds the Raft state of node %q of cluster %s (%s, marked %s), but %s (node %s, term %d, "+
		"members %s) runs cluster %s: %w. One of the two clusters was founded again with the same node ids and addresses; "+
		"starting would mix their states. If the running cluster is the one to keep, empty this data dir and start the node "+
		"with -join %s (it catches up from the leader); if this data dir's cluster is, stop the nodes of the other one first "+
		"(docs/operations.md, \"Recover an allocator node\")", cfg.DataDir, cfg.NodeID, m.ClusterID, m.Origin,
		m.Created.Format(time.RFC3339), who, r.GetNodeId(), r.GetTerm(), memberIDs(r.GetMembers()), r.GetClusterId(), ErrForeignState, addr)
}

// probePeersCluster asks the members a node knows (cfg.Peers: its
// -bootstrap peers and its newest snapshot's member table; GetCluster, all
// at once, for at most bootstrapProbeTimeout) which cluster they run,
// before a node whose data dir is marked with a cluster id (m) starts Raft
// on it, and refuses when one that lists this node (its id at its Raft
// address) runs another id (see otherCluster). One of another id that does
// not list this node only gets a warning: an address reused by another
// cluster after its node left this one (a -peer flag or an old snapshot
// outlives it) never contacts this node. Members that do not answer are no
// reason to refuse: the members restart together.
func probePeersCluster(cfg Config, m *dataDirMarker, log *zap.Logger) error {
	for _, a := range askPeers(cfg, log) {
		err := otherCluster(cfg, m, fmt.Sprintf("member %s (%s)", a.peer.ID, a.peer.APIAddr), a.peer.APIAddr, a.resp)
		switch {
		case err == nil:
		case listsNode(a.resp, cfg):
			return err
		default:
			log.Warn("a member this node knows (a -peer, or its newest snapshot's member table) runs another cluster, which "+
				"does not list this node: its address may have been reused since it left this cluster", zap.String("peer", a.peer.ID), zap.String("api", a.peer.APIAddr),
				zap.String("its_cluster", a.resp.GetClusterId()), zap.String("this_cluster", m.ClusterID))
		}
	}
	return nil
}

// listsNode reports whether r lists this node: its id at its Raft address.
func listsNode(r *allotv1.GetClusterResponse, cfg Config) bool {
	for _, mem := range r.GetMembers() {
		if mem.GetId() == cfg.NodeID && mem.GetRaftAddress() == cfg.RaftAddr {
			return true
		}
	}
	return false
}

// peerAnswer is a bootstrap peer's answer to GetCluster.
type peerAnswer struct {
	peer Peer
	resp *allotv1.GetClusterResponse
}

// askPeers asks the other bootstrap peers (their API, GetCluster, all at
// once, for at most bootstrapProbeTimeout) about their cluster, and returns
// the answers in the order of cfg.Peers; peers that did not answer are left
// out.
func askPeers(cfg Config, log *zap.Logger) []peerAnswer {
	var others []Peer
	for _, p := range cfg.Peers {
		if p.ID != cfg.NodeID {
			others = append(others, p)
		}
	}
	if len(others) == 0 {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), bootstrapProbeTimeout)
	defer cancel()
	hc := NewHTTPClient()
	defer hc.CloseIdleConnections()
	resps := make([]*allotv1.GetClusterResponse, len(others))
	var wg sync.WaitGroup
	for i, p := range others {
		wg.Go(func() {
			op := allotv1connect.NewOperatorServiceClient(hc, "http://"+p.APIAddr)
			resp, err := op.GetCluster(ctx, connect.NewRequest(&allotv1.GetClusterRequest{}))
			if err != nil {
				log.Debug("bootstrap peer did not answer", zap.String("peer", p.ID), zap.Error(err))
				return
			}
			resps[i] = resp.Msg
		})
	}
	wg.Wait()
	var out []peerAnswer
	for i, r := range resps {
		if r != nil {
			out = append(out, peerAnswer{peer: others[i], resp: r})
		}
	}
	return out
}

func memberIDs(ms []*allotv1.Member) string {
	ids := make([]string, len(ms))
	for i, m := range ms {
		ids[i] = m.GetId()
	}
	return strings.Join(ids, ",")
}

// joinProbeTimeout bounds how long a node with Raft state that starts with
// -join waits for the member it joins through to list the cluster.
const joinProbeTimeout = 2 * time.Second

// probeJoinTarget checks, before a node whose data dir holds Raft state
// (marker m) starts Raft with -join via, that the cluster at via lists the
// node: a member restarting with the -join it was added with does. A
// cluster that answers without it means the state is another cluster's (a
// data dir reused from a torn-down cluster) or this node was removed:
// starting Raft on it would put that state beside the cluster's log, and
// what the node applied from it is never undone (a leader overwrites a
// follower's log, not what its state machine applied), so it refuses
// (ErrForeignState), as when it lists this node's id at another Raft
// address, or lists it but runs another cluster than the data dir's marker
// names (see otherCluster). A cluster that does not answer is no reason to refuse:
// its members restart with their -join too, and must not wait for each
// other.
func probeJoinTarget(cfg Config, via string, m *dataDirMarker, log *zap.Logger) error {
	ctx, cancel := context.WithTimeout(context.Background(), joinProbeTimeout)
	defer cancel()
	hc := NewHTTPClient()
	defer hc.CloseIdleConnections()
	op := allotv1connect.NewOperatorServiceClient(hc, "http://"+via)
	resp, err := op.GetCluster(ctx, connect.NewRequest(&allotv1.GetClusterRequest{}))
	if err != nil {
		log.Warn("could not ask the member to join through whether it lists this node; starting from the data dir's Raft state",
			zap.String("join", via), zap.Error(err))
		return nil
	}
	r := resp.Msg
	for _, mem := range r.GetMembers() {
		switch {
		case mem.GetId() != cfg.NodeID:
		case mem.GetRaftAddress() == cfg.RaftAddr:
			// Listed: this node's state, unless the cluster was founded
			// again with the same ids and addresses.
			return otherCluster(cfg, m, "the member at "+via, via, r)
		default:
			// Another member holds this id (the cluster refuses to add
			// it twice), so the state is not that member's either.
			return fmt.Errorf("-join %s with data dir %s, which holds the Raft state of node %q (%s, marked %s), but the "+
				"cluster there lists node %q at raft address %s, not this node's %s: %w. Start this node with another -id "+
				"and an empty data dir, or move the member (allotctl -addr %s member remove %s) and start this one with "+
				"an empty data dir and -join %s", via, cfg.DataDir, m.NodeID, m.Origin, m.Created.Format(time.RFC3339),
				cfg.NodeID, mem.GetRaftAddress(), cfg.RaftAddr, ErrForeignState, via, cfg.NodeID, via)
		}
	}
	return fmt.Errorf("-join %s with data dir %s, which holds the Raft state of node %q (%s, marked %s), but the cluster there "+
		"(node %s, term %d, members %s) does not list this node: %w. The state is another cluster's, or this node was "+
		"removed; joining with it would keep what it applied from that state beside the cluster's log. Empty the data "+
		"dir and start again with -join %s: the node catches up from the leader (docs/operations.md, \"Recover an "+
		"allocator node\")", via, cfg.DataDir, m.NodeID, m.Origin, m.Created.Format(time.RFC3339), r.GetNodeId(), r.GetTerm(),
		memberIDs(r.GetMembers()), ErrForeignState, via)
}
