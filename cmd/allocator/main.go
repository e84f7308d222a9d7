// Command allocator runs one node of allot's Raft-replicated global quota
// allocator: the Raft member (BoltDB log, file snapshots, TCP transport) and its
// Connect API (Connect, gRPC, gRPC-Web over h2c), /metrics, /healthz and
// /readyz, and with -grpc-addr Acquire and Release on grpc-go as well.
//
//	allocator -id a1 -raft-addr 127.0.0.1:7001 -api-addr 127.0.0.1:8001 -data-dir /tmp/a1 \
//	  -bootstrap -peer a1=127.0.0.1:7001=127.0.0.1:8001 -peer a2=... -peer a3=...
//
// -bootstrap needs every initial member as a -peer, this node included (a
// single-node cluster: this node as its only -peer); -peer is read only with
// -bootstrap. A new node of a running cluster starts with -join instead, and
// a node restarts from its data dir with the same flags or with neither.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/allot-dev/allot/pkg/allocator"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:])
	stop()
	if err != nil && !errors.Is(err, flag.ErrHelp) {
		fmt.Fprintln(os.Stderr, "allocator:", err)
		os.Exit(1)
	}
}

type peerList []allocator.Peer

func (p *peerList) String() string { return fmt.Sprint(*p) }
func (p *peerList) Set(s string) error {
	peer, err := allocator.ParsePeer(s)
	if err != nil {
		return err
	}
	*p = append(*p, peer)
	return nil
}

func run(ctx context.Context, args []string) error {
	cfg, ro, logLevel, err := parseFlags(args)
	if err != nil {
		return err
	}
	if err := checkFlags(cfg, ro); err != nil {
		return err
	}
	zc := zap.NewProductionConfig()
	zc.Level = zap.NewAtomicLevelAt(logLevel)
	log, err := zc.Build()
	if err != nil {
		return fmt.Errorf("logger: %w", err)
	}
	defer func() { _ = log.Sync() }()
	return allocator.Run(ctx, cfg, ro, log)
}

// parseFlags reads the command line; -h and -help yield flag.ErrHelp.
func parseFlags(args []string) (allocator.Config, allocator.RunOptions, zapcore.Level, error) {
	cfg := allocator.DefaultConfig()
	var (
		peers    peerList
		ro       allocator.RunOptions
		logLevel = zapcore.InfoLevel
	)
	fs := flag.NewFlagSet("allocator", flag.ContinueOnError)
	fs.StringVar(&cfg.NodeID, "id", "", "Raft server ID of this node (unique, stable)")
	fs.StringVar(&cfg.RaftAddr, "raft-addr", "127.0.0.1:7001", "Raft transport address (bind and advertise)")
	fs.StringVar(&cfg.APIAddr, "api-addr", "127.0.0.1:8001", "Connect API address")
	fs.StringVar(&ro.GRPCAddr, "grpc-addr", "", "also serve Acquire and Release on grpc-go at this address (region agents' -allocators-grpc); empty: off")
	fs.StringVar(&cfg.DataDir, "data-dir", "", "directory for the Raft log, stable store and snapshots")
	fs.BoolVar(&cfg.Bootstrap, "bootstrap", false, "bootstrap a new cluster from -peer when the data dir is empty (needs -peer; not with -join)")
	fs.Var(&peers, "peer", "initial member id=raft_addr=api_addr of a -bootstrap (repeat; include this node, alone for a single-node cluster)")
	fs.StringVar(&ro.Join, "join", "", "API address of a member to ask to add this node (not with -bootstrap)")
	fs.DurationVar(&cfg.HeartbeatTimeout, "heartbeat-timeout", cfg.HeartbeatTimeout, "Raft heartbeat timeout")
	fs.DurationVar(&cfg.ElectionTimeout, "election-timeout", cfg.ElectionTimeout, "Raft election timeout")
	fs.DurationVar(&cfg.LeaderLeaseTimeout, "leader-lease-timeout", cfg.LeaderLeaseTimeout, "Raft leader lease timeout")
	fs.DurationVar(&cfg.CommitDelay, "commit-delay", cfg.CommitDelay, "under load, how long the leader may hold a batch of calls for companions (0: never)")
	fs.IntVar(&cfg.CommitSiblings, "commit-siblings", cfg.CommitSiblings, "calls in the previous Raft entry that count as load for -commit-delay")
	fs.Uint64Var(&cfg.SnapshotThreshold, "snapshot-threshold", cfg.SnapshotThreshold, "log entries between snapshots")
	fs.DurationVar(&cfg.LeaseMargin, "lease-margin", cfg.LeaseMargin, "lease deadline margin regions use (feeds the stated bound)")
	fs.Int64Var(&cfg.MaxDriftPPM, "max-drift-ppm", cfg.MaxDriftPPM, "assumed max clock drift between machines (feeds the stated bound)")
	fs.DurationVar(&cfg.MaxOneWayDelay, "max-store-delay", cfg.MaxOneWayDelay, "assumed max agent-to-store delay (feeds the stated bound)")
	fs.DurationVar(&cfg.MaxLeaderSkew, "max-leader-skew", cfg.MaxLeaderSkew, "assumed max clock offset between allocator nodes (feeds the stated bound)")
	fs.BoolVar(&cfg.StoreAsyncFailover, "store-async-failover", false, "regional stores fail over asynchronously (feeds the stated bound)")
	fs.Var(&logLevel, "log-level", "log level: debug, info, warn, error")
	if err := fs.Parse(args); err != nil {
		return cfg, ro, logLevel, err
	}
	if fs.NArg() > 0 {
		return cfg, ro, logLevel, fmt.Errorf("unexpected argument %q: %w", fs.Arg(0), allocator.ErrConfig)
	}
	cfg.Peers = peers
	return cfg, ro, logLevel, nil
}

// checkFlags refuses cluster flags that contradict each other or leave the
// membership to chance, naming the flags, then validates the configuration.
func checkFlags(cfg allocator.Config, ro allocator.RunOptions) error {
	switch {
	case cfg.Bootstrap && ro.Join != "":
		return fmt.Errorf("-bootstrap with -join: a node either bootstraps a new cluster or joins a running one: %w", allocator.ErrConfig)
	case !cfg.Bootstrap && len(cfg.Peers) > 0:
		return fmt.Errorf("-peer without -bootstrap: -peer lists the initial members of a new cluster and is read only with -bootstrap "+
			"(a restarting node needs neither, a new node of a running cluster uses -join): %w", allocator.ErrConfig)
	case cfg.Bootstrap && len(cfg.Peers) == 0:
		// Forgetting the -peer flags on one node of three would found a
		// cluster of its own, granting a full quota of its own.
		return fmt.Errorf("-bootstrap without -peer: list every initial member with -peer, this node included; "+
			"for a single-node cluster, this node alone (-peer %s=%s=%s): %w", cfg.NodeID, cfg.RaftAddr, cfg.APIAddr, allocator.ErrConfig)
	}
	return cfg.Validate()
}
