// Package wan runs the chaos suite's WAN links in a process of their own:
// one per region, inside the region's network namespace, a fault proxy
// (package faultproxy) on every link from the region to an allocator. The
// suite steers the region's connections to the allocators through them
// with DNAT rules; the proxies' own upstream sockets carry a firewall mark
// those rules skip.
//
// Out of the test process, a stall of the test process (its garbage
// collector, the event recorder, the checkers) no longer stalls the
// network the system under test runs on: the proxies pause only when their
// own process does, and that process reports its pauses like the others.
package wan

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/allot-dev/allot/chaos/history"
	"github.com/allot-dev/allot/internal/pausewatch"
	"github.com/allot-dev/allot/pkg/faultproxy"
	"github.com/allot-dev/allot/pkg/topology"
)

// HelloSuffix ends the hello of a region's WAN process on the control
// socket ("eu" + HelloSuffix).
const HelloSuffix = "/wan"

// Link is one proxied path from the region to an allocator port.
type Link struct {
	// Listen is where the proxy listens, an address of the region.
	Listen string `json:"listen"`
	// Target is the allocator's address the proxy dials.
	Target string `json:"target"`
	// Seed seeds the link's delays and losses.
	Seed uint64 `json:"seed"`
	// GRPC marks a link to an allocator's gRPC listener (counted apart in
	// Stats).
	GRPC bool `json:"grpc,omitempty"`
}

// Config is a WAN process's configuration.
type Config struct {
	// Region names the region whose links these are.
	Region string `json:"region"`
	// Mark is the firewall mark of the proxies' upstream sockets.
	Mark int `json:"mark"`
	// WAN is every link's delay and loss.
	WAN faultproxy.Config `json:"wan"`
	// Links are the proxied paths.
	Links []Link `json:"links"`
	// StatsPath is where the process keeps its Stats (JSON, rewritten
	// every second and when it stops).
	StatsPath string `json:"stats_path"`
}

// Stats counts what the links carried.
type Stats struct {
	// Chunks is how many chunks of bytes all links carried.
	Chunks int64 `json:"chunks"`
	// GRPCChunks is how many of them crossed links to gRPC listeners.
	GRPCChunks int64 `json:"grpc_chunks"`
}

// ReadStats reads the Stats a WAN process wrote at path.
func ReadStats(path string) (Stats, error) {
	var s Stats
	b, err := os.ReadFile(path)
	if err != nil {
		return s, err
	}
	if err := json.Unmarshal(b, &s); err != nil {
		return s, fmt.Errorf("%s: %w", path, err)
	}
	return s, nil
}

// Serve runs a region's WAN process: it reads its Config from configPath,
// listens on every link, dials the suite's control socket ctlPath, says
// hello, and proxies until the suite says stop, ctx ends or the suite goes
// away.
func Serve(ctx context.Context, configPath, ctlPath string) error {
	var cfg Config
	if err := history.ReadConfig(configPath, &cfg); err != nil {
		return err
	}
	if err := cfg.WAN.Validate(); err != nil {
		return fmt.Errorf("wan: %w", err)
	}
	if cfg.StatsPath == "" {
		return errors.New("wan: stats_path is required")
	}
	log, err := zap.NewProduction()
	if err != nil {
		return err
	}
	log = log.Named("wan-" + cfg.Region)
	defer func() { _ = log.Sync() }()
	s, err := newSet(cfg)
	if err != nil {
		return err
	}
	for _, l := range cfg.Links {
		log.Info("WAN link listening", zap.String("listen", l.Listen), zap.String("target", l.Target), zap.Bool("grpc", l.GRPC))
	}
	conn, out, err := history.DialControl(ctlPath, cfg.Region+HelloSuffix)
	if err != nil {
		s.close()
		return err
	}
	defer conn.Close()
	defer out.Close()
	return history.ServeCommands(ctx, conn, out, func(ctx context.Context) error {
		var wg sync.WaitGroup
		wg.Add(1)
		go func() { defer wg.Done(); _ = pausewatch.Run(ctx, pausewatch.Config{OnPause: pausewatch.LogTo(log)}) }()
		err := s.run(ctx, time.Second)
		wg.Wait()
		return err
	}, func(_ context.Context, c *history.Command) error {
		return fmt.Errorf("unknown op %q", c.Op)
	}, func(context.Context) error { return nil })
}

// set is a WAN process's proxies.
type set struct {
	cfg     Config
	lns     []net.Listener
	proxies []*faultproxy.Proxy
	grpc    []bool // of each proxy: a link to a gRPC listener
}

func newSet(cfg Config) (*set, error) {
	s := &set{cfg: cfg}
	for _, l := range cfg.Links {
		ln, err := net.Listen("tcp", l.Listen)
		if err != nil {
			s.close()
			return nil, fmt.Errorf("wan %s: %w", cfg.Region, err)
		}
		s.lns = append(s.lns, ln)
		target := l.Target
		dialer := topology.MarkedDialer(cfg.Mark, 2*time.Second)
		s.proxies = append(s.proxies, faultproxy.New(ln, func(ctx context.Context) (net.Conn, error) {
			return dialer.DialContext(ctx, "tcp", target)
		}, cfg.WAN, l.Seed))
		s.grpc = append(s.grpc, l.GRPC)
	}
	return s, nil
}

// close closes the listeners of proxies that never ran.
func (s *set) close() {
	for _, ln := range s.lns {
		ln.Close()
	}
}

// run runs every proxy until ctx ends, writing the stats every interval
// and once more at the end.
func (s *set) run(ctx context.Context, every time.Duration) error {
	var wg sync.WaitGroup
	for _, p := range s.proxies {
		wg.Add(1)
		go func() { defer wg.Done(); _ = p.Run(ctx) }()
	}
	t := time.NewTicker(every)
	defer t.Stop()
	var err error
	for ctx.Err() == nil {
		select {
		case <-t.C:
			err = s.writeStats()
		case <-ctx.Done():
		}
	}
	wg.Wait()
	return errors.Join(err, s.writeStats())
}

func (s *set) stats() Stats {
	var st Stats
	for i, p := range s.proxies {
		n := p.Stats().Chunks
		st.Chunks += n
		if s.grpc[i] {
			st.GRPCChunks += n
		}
	}
	return st
}

// writeStats replaces the stats file atomically.
func (s *set) writeStats() error {
	b, err := json.Marshal(s.stats())
	if err != nil {
		return err
	}
	tmp := s.cfg.StatsPath + ".tmp"
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return err
	}
	return os.Rename(tmp, s.cfg.StatsPath)
}
