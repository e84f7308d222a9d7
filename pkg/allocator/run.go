package allocator

import (
	"context"
	"errors"
	"fmt"
	"net"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"go.uber.org/zap"

	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// RunOptions are the process-level settings of Run beyond the node's Config.
type RunOptions struct {
	// Join is the API address of an existing member to ask to add this node;
	// empty when the node bootstraps or restarts from its data dir.
	Join string
	// ShutdownGrace bounds the graceful shutdown of the HTTP server.
	ShutdownGrace time.Duration
	// Ready, when set, is called once the API listens.
	Ready func(apiAddr string)
}

// Run runs one allocator node with its HTTP server (Connect API, /metrics,
// /healthz, /readyz) until ctx ends, then shuts down gracefully: leadership is
// transferred first, in-flight calls finish, then Raft stops.
func Run(ctx context.Context, cfg Config, ro RunOptions, log *zap.Logger) error {
	if ro.ShutdownGrace <= 0 {
		ro.ShutdownGrace = 5 * time.Second
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	metrics := NewMetrics(reg)

	ln, err := net.Listen("tcp", cfg.APIAddr)
	if err != nil {
		return fmt.Errorf("listen api %s: %w", cfg.APIAddr, err)
	}
	node, err := NewNode(cfg, WithLogger(log), WithMetrics(metrics))
	if err != nil {
		ln.Close()
		return err
	}
	srv := NewServer(node, log, metrics)
	httpSrv := HTTPServer(cfg.APIAddr, Mux(srv, reg))
	serveCtx, stopServe := context.WithCancel(context.Background())
	serveErr := make(chan error, 1)
	go func() { serveErr <- Serve(serveCtx, httpSrv, ln, ro.ShutdownGrace) }()
	log.Info("allocator listening", zap.String("node", cfg.NodeID), zap.String("api", cfg.APIAddr), zap.String("raft", cfg.RaftAddr))
	if ro.Ready != nil {
		ro.Ready(cfg.APIAddr)
	}

	if ro.Join != "" {
		if err := join(ctx, cfg, ro.Join, log); err != nil {
			log.Error("join failed", zap.Error(err))
		}
	}

	var runErr error
	select {
	case <-ctx.Done():
	case runErr = <-serveErr:
	}
	log.Info("shutting down", zap.String("node", cfg.NodeID))
	node.TransferLeadership()
	stopServe()
	if runErr == nil {
		runErr = <-serveErr
	}
	return errors.Join(runErr, node.Close())
}

// join asks the cluster (through any member) to add this node, retrying until
// it succeeds or ctx ends.
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
		log.Warn("join attempt failed; retrying", zap.String("via", via), zap.Error(err))
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
	}
}
