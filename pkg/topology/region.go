package topology

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/allot-dev/allot/pkg/allocator"
	"github.com/allot-dev/allot/proto/allot/v1/allotv1connect"
)

// RegionConfig describes one region to start: a redis-server of its own
// and a regionagent process leasing from the allocator cluster.
type RegionConfig struct {
	// Name is the region ("eu"); it must be one of the policy's regions.
	Name string
	// AgentBin is the path of the regionagent binary.
	AgentBin string
	// RedisBin is the redis-server binary (default: from PATH).
	RedisBin string
	// Dir holds the region's Redis directory and the agent's data dir.
	Dir string
	// Host is the address both listen on (default 127.0.0.1).
	Host string
	// AllocatorEndpoints are the allocator API addresses.
	AllocatorEndpoints []string
	// AgentArgs are extra regionagent flags (for example "-lease-margin",
	// "50ms" to match the allocators' -lease-margin).
	AgentArgs []string
	// Output receives both processes' output (nil: kept for diagnostics).
	Output io.Writer
}

// Region is a running region: its Redis and its agent.
type Region struct {
	// Name is the region.
	Name string
	// RedisAddr, APIAddr and EnvoyAddr are the Redis, the agent's Connect
	// API (and /metrics, /readyz) and its Envoy rate limit service.
	RedisAddr, APIAddr, EnvoyAddr string
	// DataDir is the agent's data dir (last-known-good policy).
	DataDir string
	// Redis and Agent are the running processes (Agent is replaced by
	// StartAgent).
	Redis, Agent *Process
	// Args are the agent's arguments.
	Args []string

	cfg RegionConfig
}

// StartRegion starts the region's redis-server, then its agent, and waits
// until the agent answers /healthz. It does not wait for a policy: call
// WaitReady for that.
func StartRegion(ctx context.Context, cfg RegionConfig) (*Region, error) {
	if cfg.Name == "" || cfg.AgentBin == "" || cfg.Dir == "" {
		return nil, errors.New("region: Name, AgentBin and Dir are required")
	}
	if cfg.Host == "" {
		cfg.Host = "127.0.0.1"
	}
	if cfg.RedisBin == "" {
		p, err := exec.LookPath("redis-server")
		if err != nil {
			return nil, fmt.Errorf("region %s: redis-server not found: %w", cfg.Name, err)
		}
		cfg.RedisBin = p
	}
	r := &Region{Name: cfg.Name, cfg: cfg, DataDir: filepath.Join(cfg.Dir, "agent")}
	var err error
	for _, addr := range []*string{&r.RedisAddr, &r.APIAddr, &r.EnvoyAddr} {
		if *addr, err = FreePort(cfg.Host); err != nil {
			return nil, err
		}
	}
	redisDir := filepath.Join(cfg.Dir, "redis")
	if err := os.MkdirAll(redisDir, 0o755); err != nil {
		return nil, err
	}
	_, port, _ := net.SplitHostPort(r.RedisAddr)
	r.Redis, err = StartProcess(cfg.Name+"-redis", cfg.RedisBin, []string{
		"--port", port, "--bind", cfg.Host, "--dir", redisDir, "--save", "", "--appendonly", "no", "--daemonize", "no",
	}, cfg.Output)
	if err != nil {
		return nil, err
	}
	if err := r.waitRedis(ctx); err != nil {
		r.Redis.Kill()
		return nil, err
	}
	r.Args = append([]string{
		"-region", cfg.Name, "-allocators", strings.Join(cfg.AllocatorEndpoints, ","), "-redis", r.RedisAddr,
		"-data-dir", r.DataDir, "-api-addr", r.APIAddr, "-envoy-addr", r.EnvoyAddr,
	}, cfg.AgentArgs...)
	if err := r.StartAgent(ctx); err != nil {
		r.Redis.Kill()
		return nil, err
	}
	return r, nil
}

func (r *Region) waitRedis(ctx context.Context) error {
	c := redis.NewClient(&redis.Options{Addr: r.RedisAddr, MaxRetries: -1})
	defer c.Close()
	for {
		pctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
		err := c.Ping(pctx).Err()
		cancel()
		if err == nil {
			return nil
		}
		if r.Redis.Exited() {
			return fmt.Errorf("%s redis exited: %s", r.Name, lastLines(r.Redis.Output(), 5))
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s redis did not come up: %w", r.Name, err)
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// StartAgent (re)starts the agent with its recorded arguments (its data dir
// keeps the last-known-good policy across restarts) and waits until it
// answers /healthz.
func (r *Region) StartAgent(ctx context.Context) error {
	p, err := StartProcess(r.Name+"-agent", r.cfg.AgentBin, r.Args, r.cfg.Output)
	if err != nil {
		return err
	}
	r.Agent = p
	return r.waitHTTP(ctx, "/healthz")
}

// WaitReady waits until the agent has a policy in force (/readyz).
func (r *Region) WaitReady(ctx context.Context) error { return r.waitHTTP(ctx, "/readyz") }

func (r *Region) waitHTTP(ctx context.Context, path string) error {
	hc := &http.Client{Timeout: 300 * time.Millisecond}
	defer hc.CloseIdleConnections()
	for {
		resp, err := hc.Get("http://" + r.APIAddr + path)
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return nil
			}
			err = fmt.Errorf("%s: %s", path, resp.Status)
		}
		if r.Agent.Exited() {
			return fmt.Errorf("%s agent exited: %s", r.Name, lastLines(r.Agent.Output(), 5))
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s agent %s: %w", r.Name, path, errors.Join(ctx.Err(), err))
		case <-time.After(20 * time.Millisecond):
		}
	}
}

// Client returns an AdmissionService client of the agent (Connect over
// HTTP/1.1 or h2c).
func (r *Region) Client() allotv1connect.AdmissionServiceClient {
	return allotv1connect.NewAdmissionServiceClient(allocator.NewHTTPClient(), "http://"+r.APIAddr)
}

// Close stops the agent gracefully (SIGTERM: it hands its unspent tokens
// back to the allocator), then the Redis.
func (r *Region) Close(grace time.Duration) error {
	var err error
	if r.Agent != nil {
		err = r.Agent.Stop(grace)
	}
	if r.Redis != nil {
		r.Redis.Kill()
	}
	return err
}
