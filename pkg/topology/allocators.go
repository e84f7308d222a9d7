package topology

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"sync"
	"time"

	"connectrpc.com/connect"

	"github.com/allot-dev/allot/pkg/allocator"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
	"github.com/allot-dev/allot/proto/allot/v1/allotv1connect"
)

// AllocatorNode is one allocator process of the topology.
type AllocatorNode struct {
	// ID is the node's Raft server ID.
	ID string
	// RaftAddr and APIAddr are its listen addresses; GRPCAddr is its
	// AllocatorService gRPC listener (-grpc-addr).
	RaftAddr, APIAddr, GRPCAddr string
	// DataDir holds its Raft state.
	DataDir string
	// Args are the command-line arguments it was started with.
	Args []string
	// Proc is the running process (replaced by Restart).
	Proc *Process
}

// AllocatorConfig describes an allocator cluster to start.
type AllocatorConfig struct {
	// Nodes is the number of allocator processes (3 tolerates one failure).
	Nodes int
	// Bin is the path of the allocator binary.
	Bin string
	// Dir holds one data directory per node.
	Dir string
	// Host is the address nodes listen on (default 127.0.0.1).
	Host string
	// Output receives every node's output (nil: kept only for diagnostics).
	Output io.Writer
	// ExtraArgs are passed to every node (for example "-log-level", "warn").
	ExtraArgs []string
}

// Allocators is a running allocator cluster.
type Allocators struct {
	cfg   AllocatorConfig
	Nodes []*AllocatorNode
}

// handedOut remembers the addresses FreePort returned recently: the kernel
// may give a port it just freed to the next Listen on port 0, and two nodes
// of one topology once got the same address that way.
var handedOut = struct {
	sync.Mutex
	at map[string]time.Time
}{at: map[string]time.Time{}}

// FreePort returns a port on host that was free a moment ago and that it did
// not return in the last minute.
func FreePort(host string) (string, error) {
	handedOut.Lock()
	defer handedOut.Unlock()
	now := time.Now()
	for addr, at := range handedOut.at {
		if now.Sub(at) > time.Minute {
			delete(handedOut.at, addr)
		}
	}
	for range 64 {
		ln, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
		if err != nil {
			return "", err
		}
		addr := ln.Addr().String()
		ln.Close()
		if _, dup := handedOut.at[addr]; !dup {
			handedOut.at[addr] = now
			return addr, nil
		}
	}
	return "", fmt.Errorf("free port on %s: every port the kernel offered was handed out in the last minute", host)
}

// StartAllocators starts cfg.Nodes allocator processes that bootstrap one
// cluster, and waits until it has a leader.
func StartAllocators(ctx context.Context, cfg AllocatorConfig) (*Allocators, error) {
	if cfg.Nodes < 1 {
		return nil, fmt.Errorf("allocators: %d nodes: want at least 1", cfg.Nodes)
	}
	if cfg.Host == "" {
		cfg.Host = "127.0.0.1"
	}
	a := &Allocators{cfg: cfg}
	var peers []string
	for i := 0; i < cfg.Nodes; i++ {
		n := &AllocatorNode{ID: fmt.Sprintf("a%d", i+1), DataDir: filepath.Join(cfg.Dir, fmt.Sprintf("a%d", i+1))}
		var err error
		if n.RaftAddr, err = FreePort(cfg.Host); err != nil {
			return nil, err
		}
		if n.APIAddr, err = FreePort(cfg.Host); err != nil {
			return nil, err
		}
		if n.GRPCAddr, err = FreePort(cfg.Host); err != nil {
			return nil, err
		}
		peers = append(peers, "-peer", n.ID+"="+n.RaftAddr+"="+n.APIAddr)
		a.Nodes = append(a.Nodes, n)
	}
	for _, n := range a.Nodes {
		n.Args = append([]string{"-id", n.ID, "-raft-addr", n.RaftAddr, "-api-addr", n.APIAddr, "-grpc-addr", n.GRPCAddr, "-data-dir", n.DataDir, "-bootstrap"}, peers...)
		n.Args = append(n.Args, cfg.ExtraArgs...)
	}
	if err := a.startAll(ctx); err != nil {
		return nil, err
	}
	return a, nil
}

// startAll starts every node and waits for a leader; on failure it stops
// what it started.
func (a *Allocators) startAll(ctx context.Context) error {
	for _, n := range a.Nodes {
		if err := a.Start(n); err != nil {
			a.Close(time.Second)
			return err
		}
	}
	if _, err := a.WaitLeader(ctx); err != nil {
		a.Close(time.Second)
		return err
	}
	return nil
}

// Start (re)starts node n with its recorded arguments and data dir.
func (a *Allocators) Start(n *AllocatorNode) error {
	p, err := StartProcess(n.ID, a.cfg.Bin, n.Args, a.cfg.Output)
	if err != nil {
		return err
	}
	n.Proc = p
	return nil
}

// Endpoints returns every node's API address.
func (a *Allocators) Endpoints() []string {
	out := make([]string, len(a.Nodes))
	for i, n := range a.Nodes {
		out[i] = n.APIAddr
	}
	return out
}

// GRPCEndpoints returns the nodes' gRPC listeners, in node order.
func (a *Allocators) GRPCEndpoints() []string {
	out := make([]string, len(a.Nodes))
	for i, n := range a.Nodes {
		out[i] = n.GRPCAddr
	}
	return out
}

// nodeOperator is an operator client of node n alone, over hc.
func nodeOperator(hc *http.Client, n *AllocatorNode) allotv1connect.OperatorServiceClient {
	return allotv1connect.NewOperatorServiceClient(hc, "http://"+n.APIAddr)
}

// WaitUp waits until node n answers on its API.
func (a *Allocators) WaitUp(ctx context.Context, n *AllocatorNode) error {
	// Asked directly (not through the failover client, whose leader hints
	// could steer the question to another node).
	hc := allocator.NewHTTPClient()
	defer hc.CloseIdleConnections()
	op := nodeOperator(hc, n)
	for {
		cctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
		_, err := op.GetCluster(cctx, connect.NewRequest(&allotv1.GetClusterRequest{}))
		cancel()
		if err == nil {
			return nil
		}
		if n.Proc.Exited() {
			return fmt.Errorf("%s exited: %s", n.ID, lastLines(n.Proc.Output(), 5))
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s did not come up: %w", n.ID, err)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// WaitLeader waits until a live node says it is the leader, and returns it
// and the time it first answered so.
func (a *Allocators) WaitLeader(ctx context.Context) (*AllocatorNode, error) {
	// Every poll asks each node itself over one HTTP client for the whole
	// wait (a client per poll would leave a connection behind every 20 ms),
	// without the failover client's leader hints, which could steer the
	// question for one node to another.
	hc := allocator.NewHTTPClient()
	defer hc.CloseIdleConnections()
	ops := map[*AllocatorNode]allotv1connect.OperatorServiceClient{}
	for {
		for _, n := range a.Nodes {
			if n.Proc == nil || n.Proc.Exited() {
				continue
			}
			op := ops[n]
			if op == nil {
				op = nodeOperator(hc, n)
				ops[n] = op
			}
			cctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
			resp, err := op.GetCluster(cctx, connect.NewRequest(&allotv1.GetClusterRequest{}))
			cancel()
			if err == nil && resp.Msg.GetState() == "Leader" && resp.Msg.GetNodeId() == n.ID {
				return n, nil
			}
		}
		select {
		case <-ctx.Done():
			return nil, fmt.Errorf("no allocator leader: %w", ctx.Err())
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// Close stops every node gracefully (leaders transfer leadership first).
func (a *Allocators) Close(grace time.Duration) error {
	var first error
	for _, n := range a.Nodes {
		if n.Proc == nil {
			continue
		}
		if err := n.Proc.Stop(grace); err != nil && first == nil {
			first = err
		}
	}
	return first
}

func lastLines(s string, n int) string {
	lines := 0
	for i := len(s) - 1; i >= 0; i-- {
		if s[i] == '\n' {
			lines++
			if lines > n {
				return s[i+1:]
			}
		}
	}
	return s
}
