package allocator

import (
	"context"
	"errors"
	"fmt"
	"net"
	"time"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"go.uber.org/zap"
	"google.golang.org/grpc"

	"github.com/allot-dev/allot/internal/pausewatch"

	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// RunOptions are the process-level settings of Run beyond the node's Config.
type RunOptions struct {
	// Join is the API address of an existing member to ask to add this node;
	// empty when the node bootstraps or restarts from its data dir. Run
	// refuses it with Config.Bootstrap.
	Join string
	// ShutdownGrace bounds the graceful shutdown of the HTTP server.
	ShutdownGrace time.Duration
	// Ready, when set, is called once the API listens.
	Ready func(apiAddr string)
	// GRPCAddr, when set, is where AllocatorService (Acquire and Release)
	// is also served on grpc-go (NewGRPCServer), for callers that make many
	// calls; empty: the Connect API only.
	GRPCAddr string
}

// Run runs one allocator node with its HTTP server (Connect API, /metrics,
// /healthz, /readyz) until ctx ends, then shuts down gracefully: leadership is
// transferred first, in-flight calls finish, then Raft stops.
func Run(ctx context.Context, cfg Config, ro RunOptions, log *zap.Logger) error {
	if cfg.Bootstrap && ro.Join != "" {
		// Bootstrapping would found a cluster of its own, granting quotas
		// of its own, before the node asks to join another one.
		return fmt.Errorf("Join %q with Bootstrap: a node either bootstraps a new cluster or joins a running one: %w", ro.Join, ErrConfig)
	}
	if ro.ShutdownGrace <= 0 {
		ro.ShutdownGrace = 5 * time.Second
	}
	if ro.Join != "" && cfg.DataDir != "" {
		// Before Raft starts on the data dir: it must be this cluster's.
		m, err := readMarker(cfg.DataDir)
		if err != nil {
			return err
		}
		if m != nil {
			if err := probeJoinTarget(cfg, ro.Join, m, log); err != nil {
				return err
			}
		}
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	metrics := NewMetrics(reg)

	ln, err := net.Listen("tcp", cfg.APIAddr)
	if err != nil {
		return fmt.Errorf("listen api %s: %w", cfg.APIAddr, err)
	}
	var grpcLn net.Listener
	if ro.GRPCAddr != "" {
		if grpcLn, err = net.Listen("tcp", ro.GRPCAddr); err != nil {
			ln.Close()
			return fmt.Errorf("listen grpc %s: %w", ro.GRPCAddr, err)
		}
	}
	node, err := NewNode(cfg, WithLogger(log), WithMetrics(metrics))
	if err != nil {
		ln.Close()
		if grpcLn != nil {
			grpcLn.Close()
		}
		return err
	}
	srv := NewServer(node, log, metrics)
	watchCtx, stopWatch := context.WithCancel(context.Background())
	defer stopWatch()
	go pausewatch.Run(watchCtx, pausewatch.Config{Histogram: metrics.Pauses, OnPause: pausewatch.LogTo(log.With(zap.String("node", cfg.NodeID)))})
	var grpcSrv *grpc.Server
	if grpcLn != nil {
		grpcSrv = NewGRPCServer(srv)
		go func() {
			if err := grpcSrv.Serve(grpcLn); err != nil {
				log.Error("gRPC listener stopped", zap.Error(err))
			}
		}()
		log.Info("allocator gRPC listening", zap.String("grpc", ro.GRPCAddr))
	}
	httpSrv := HTTPServer(cfg.APIAddr, Mux(srv, reg))
	// Open WatchPolicy streams end when the graceful shutdown begins,
	// rather than hold it until ShutdownGrace runs out.
	httpSrv.RegisterOnShutdown(srv.Shutdown)
	serveCtx, stopServe := context.WithCancel(context.Background())
	serveErr := make(chan error, 1)
	go func() { serveErr <- Serve(serveCtx, httpSrv, ln, ro.ShutdownGrace) }()
	log.Info("allocator listening", zap.String("node", cfg.NodeID), zap.String("api", cfg.APIAddr), zap.String("raft", cfg.RaftAddr))
	if ro.Ready != nil {
		ro.Ready(cfg.APIAddr)
	}

	var runErr error
	served := false // serveErr has been received
	if ro.Join != "" {
		if err := join(ctx, cfg, ro.Join, log); err != nil {
			log.Error("join failed", zap.Error(err))
			if ctx.Err() == nil { // refused for good: a node outside the cluster is of no use
				runErr = fmt.Errorf("join through %s: %w", ro.Join, err)
			}
		}
	}
	if runErr == nil {
		select {
		case <-ctx.Done():
		case runErr = <-serveErr:
			served = true
		}
	}
	log.Info("shutting down", zap.String("node", cfg.NodeID))
	node.TransferLeadership()
	stopServe() // the HTTP drain runs while gRPC drains: one grace period for both
	if grpcSrv != nil {
		stopGRPC(grpcSrv, ro.ShutdownGrace)
	}
	if !served {
		runErr = errors.Join(runErr, <-serveErr)
	}
	return errors.Join(runErr, node.Close())
}

// stopGRPC lets the calls in flight on g finish, for at most grace, then
// closes it.
func stopGRPC(g *grpc.Server, grace time.Duration) {
	done := make(chan struct{})
	go func() {
		g.GracefulStop()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(grace):
		g.Stop()
		<-done
	}
}

// join asks the cluster (through any member) to add this node, retrying until
// it succeeds or ctx ends; a refusal of the request itself (InvalidArgument:
// an id or address the cluster cannot use; AlreadyExists: an id or Raft
// address another member holds) is not retried. A FailedPrecondition is:
// the cluster added this node as a non-voter and promotes it to voter on a
// retry once it has caught up.
func join(ctx context.Context, cfg Config, via string, log *zap.Logger) error {
	c, err := NewClient([]string{via})
	if err != nil {
		return err
	}
	defer c.Close()
	req := &allotv1.AddMemberRequest{Id: cfg.NodeID, RaftAddress: cfg.RaftAddr, ApiAddress: cfg.APIAddr}
	for {
		cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		_, err := c.Operator().AddMember(cctx, req)
		cancel()
		if err == nil {
			log.Info("joined cluster", zap.String("via", via))
			return nil
		}
		if code := connect.CodeOf(err); code == connect.CodeInvalidArgument || code == connect.CodeAlreadyExists {
			return err
		}
		log.Warn("join attempt failed; retrying", zap.String("via", via), zap.Error(err))
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
	}
}
