package topology

import (
	"context"
	"fmt"
	"path/filepath"
)

// The ports every allocator host of a Lab uses (each host has its own address).
const (
	// LabRaftPort is the Raft transport port of an allocator in a Lab host.
	LabRaftPort = 7000
	// LabAPIPort is the Connect API port of an allocator in a Lab host.
	LabAPIPort = 8000
	// LabGRPCPort is the AllocatorService gRPC port (-grpc-addr) of an
	// allocator in a Lab host.
	LabGRPCPort = 8100
)

// AllocatorNodeIn describes allocator node h.Name running bin inside host h
// with its data under dir/h.Name; args follow the node's own flags (for
// example "-bootstrap" with "-peer"s, or "-join" with a member's API
// address). Start it with Allocators.Start of a cluster made by
// StartAllocatorsIn, whose Bin is "ip".
func AllocatorNodeIn(h *Host, bin, dir string, args ...string) *AllocatorNode {
	n := &AllocatorNode{
		ID:       h.Name,
		RaftAddr: fmt.Sprintf("%s:%d", h.IP, LabRaftPort),
		APIAddr:  fmt.Sprintf("%s:%d", h.IP, LabAPIPort),
		GRPCAddr: fmt.Sprintf("%s:%d", h.IP, LabGRPCPort),
		DataDir:  filepath.Join(dir, h.Name),
	}
	own := []string{"-id", n.ID, "-raft-addr", n.RaftAddr, "-api-addr", n.APIAddr, "-grpc-addr", n.GRPCAddr, "-data-dir", n.DataDir}
	_, n.Args = h.Command(bin, append(own, args...)...)
	return n
}

// StartAllocatorsIn starts one allocator per host, each inside its host's
// namespace at the host's address, bootstrapping one cluster, and waits for
// a leader. cfg.Nodes and cfg.Host are ignored; cfg.ExtraArgs go to every
// node. The returned cluster restarts nodes inside their hosts too.
func StartAllocatorsIn(ctx context.Context, cfg AllocatorConfig, hosts []*Host) (*Allocators, error) {
	if len(hosts) == 0 {
		return nil, fmt.Errorf("allocators: no hosts")
	}
	bin := cfg.Bin
	cfg.Bin = "ip" // node Args carry "netns exec NS bin ..."
	cfg.Nodes = len(hosts)
	a := &Allocators{cfg: cfg}
	var peers []string
	for _, h := range hosts {
		peers = append(peers, "-peer", fmt.Sprintf("%s=%s:%d=%s:%d", h.Name, h.IP, LabRaftPort, h.IP, LabAPIPort))
	}
	for _, h := range hosts {
		args := append(append([]string{"-bootstrap"}, peers...), cfg.ExtraArgs...)
		a.Nodes = append(a.Nodes, AllocatorNodeIn(h, bin, cfg.Dir, args...))
	}
	if err := a.startAll(ctx); err != nil {
		return nil, err
	}
	return a, nil
}
