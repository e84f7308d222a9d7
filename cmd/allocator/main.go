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
//
// A node refuses to start when its data dir shows Raft state that raft.db
// no longer holds (emptied, deleted, damaged, or its snapshots gone), and a
// -bootstrap from an empty data dir refuses when a -peer answers as a
// cluster with a policy: a node whose data is lost is removed and joins
// again (docs/operations.md, "Recover an allocator node"). A -join with a
// data dir that holds Raft state refuses when the member it joins through
// answers without listing this node (the state is another cluster's). The
// first leader of a cluster gives it a random id, which each node records in
// its data dir; a node restarting with -join or -bootstrap refuses when the
// member it joins through, or a -peer, runs a cluster with another id (one
// founded again with the same node ids and addresses).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
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
	fs.StringVar(&cfg.DataDir, "data-dir", "", "directory for the Raft log, stable store and snapshots (required)")
	fs.BoolVar(&cfg.Bootstrap, "bootstrap", false, "bootstrap a new cluster from -peer when the data dir is empty (needs -peer; not with -join); "+
		"refused when a -peer answers with a published policy: a node whose data is lost rejoins with -join")
	fs.Var(&peers, "peer", "initial member id=raft_addr=api_addr of a -bootstrap (repeat; include this node, alone for a single-node cluster)")
	fs.StringVar(&ro.Join, "join", "", "API address of a member to ask to add this node (not with -bootstrap)")
	fs.DurationVar(&cfg.HeartbeatTimeout, "heartbeat-timeout", cfg.HeartbeatTimeout, "Raft heartbeat timeout")
	fs.DurationVar(&cfg.ElectionTimeout, "election-timeout", cfg.ElectionTimeout, "Raft election timeout")
	fs.DurationVar(&cfg.LeaderLeaseTimeout, "leader-lease-timeout", cfg.LeaderLeaseTimeout, "Raft leader lease timeout")
	fs.DurationVar(&cfg.CommitDelay, "commit-delay", cfg.CommitDelay, "under load, how long the leader may hold a batch of calls for companions (0: never)")
	fs.IntVar(&cfg.CommitSiblings, "commit-siblings", cfg.CommitSiblings, "calls in the previous Raft entry that count as load for -commit-delay")
	fs.IntVar(&cfg.MaxWatchStreams, "max-watch-streams", cfg.MaxWatchStreams, "WatchPolicy streams served at once; more are refused with ResourceExhausted (allot_allocator_watch_streams)")
	fs.DurationVar(&cfg.WatchSendTimeout, "watch-send-timeout", cfg.WatchSendTimeout, "close a WatchPolicy stream whose client takes longer than this to read one policy version")
	fs.Uint64Var(&cfg.SnapshotThreshold, "snapshot-threshold", cfg.SnapshotThreshold, "log entries between snapshots")
	fs.DurationVar(&cfg.LeaseMargin, "lease-margin", cfg.LeaseMargin, "lease deadline margin regions use (feeds the stated bound)")
	fs.Int64Var(&cfg.MaxDriftPPM, "max-drift-ppm", cfg.MaxDriftPPM, "assumed max clock drift between machines (feeds the stated bound)")
	fs.DurationVar(&cfg.MaxOneWayDelay, "max-store-delay", cfg.MaxOneWayDelay, "assumed max agent-to-store delay (feeds the stated bound)")
	fs.DurationVar(&cfg.MaxLeaderSkew, "max-leader-skew", cfg.MaxLeaderSkew, "assumed max clock offset between allocator nodes (feeds the stated bound)")
	fs.BoolVar(&cfg.StoreAsyncFailover, "store-async-failover", false, "regional stores fail over asynchronously, or restart from an RDB or AOF file (feeds the stated bound)")
	fs.IntVar(&cfg.GatewaysPerRegion, "gateways-per-region", cfg.GatewaysPerRegion,
		"most gateways any region runs; every gateway's admission Config.Gateways must be at least this (feeds the stated bound)")
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
// membership to chance, naming the flags, then validates the configuration,
// naming the flags of the settings it refuses.
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
	var errs []error
	if cfg.DataDir == "" {
		errs = append(errs, fmt.Errorf("-data-dir must not be empty: it holds this node's Raft log and snapshots: %w", allocator.ErrConfig))
	}
	return errors.Join(append(errs, flagErrors(cfg.Validate())...)...)
}

// flagOf names the flag that sets each Config field Config.Validate names.
var flagOf = map[string]string{
	"NodeID": "-id", "RaftAddr": "-raft-addr", "APIAddr": "-api-addr", "DataDir": "-data-dir",
	"Bootstrap": "-bootstrap", "Peers": "-peer",
	"HeartbeatTimeout": "-heartbeat-timeout", "ElectionTimeout": "-election-timeout", "LeaderLeaseTimeout": "-leader-lease-timeout",
	"CommitDelay": "-commit-delay", "CommitSiblings": "-commit-siblings", "SnapshotThreshold": "-snapshot-threshold",
	"MaxWatchStreams": "-max-watch-streams", "WatchSendTimeout": "-watch-send-timeout",
	"LeaseMargin": "-lease-margin", "MaxDriftPPM": "-max-drift-ppm", "MaxOneWayDelay": "-max-store-delay",
	"MaxLeaderSkew": "-max-leader-skew", "StoreAsyncFailover": "-store-async-failover", "GatewaysPerRegion": "-gateways-per-region",
}

// flagErrors splits err, the joined errors of Config.Validate, and words
// each with the flags of the fields it names (the ErrConfig it wraps stays).
func flagErrors(err error) []error {
	if err == nil {
		return nil
	}
	errs := []error{err}
	if j, ok := err.(interface{ Unwrap() []error }); ok {
		errs = j.Unwrap()
	}
	out := make([]error, len(errs))
	for i, e := range errs {
		words := strings.Split(e.Error(), " ")
		for k, w := range words {
			field := strings.TrimRight(w, ":,")
			if f, ok := flagOf[field]; ok {
				words[k] = f + w[len(field):]
			}
		}
		out[i] = flagError{msg: strings.Join(words, " "), err: e}
	}
	return out
}

// flagError is an error of Config.Validate worded with flags.
type flagError struct {
	msg string
	err error
}

func (e flagError) Error() string { return e.msg }
func (e flagError) Unwrap() error { return e.err }
