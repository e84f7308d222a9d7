package topology

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/allot-dev/allot/pkg/allocator"
	"github.com/allot-dev/allot/proto/allot/v1/allotv1connect"
)

// RegionConfig describes one region to start: a redis-server of its own
// (or none, with EmbeddedStore) and a regionagent process leasing from the
// allocator cluster.
type RegionConfig struct {
	// Name is the region ("eu"); it must be one of the policy's regions.
	Name string
	// AgentBin is the path of the regionagent binary.
	AgentBin string
	// RedisBin is the redis-server binary (default: from PATH).
	RedisBin string
	// EmbeddedStore starts no Redis: the agent decides on its in-process
	// store (regionagent -store embedded), for machines without
	// redis-server.
	EmbeddedStore bool
	// Dir holds the region's Redis directory and the agent's data dir.
	Dir string
	// Host is the address both listen on (default 127.0.0.1).
	Host string
	// Netns, when set, runs Redis and the agent inside that lab host's
	// network namespace, at fixed ports (each host is a namespace of its
	// own): Redis on the namespace's loopback (LabRedisPort), reachable only
	// by the agent, and the agent's APIs on the host's address
	// (LabAgentAPIPort, LabAgentEnvoyPort). Host is then ignored.
	Netns *Host
	// AllocatorEndpoints are the allocator API addresses.
	AllocatorEndpoints []string
	// AgentArgs are extra regionagent flags (for example "-lease-margin",
	// "50ms" to match the allocators' -lease-margin).
	AgentArgs []string
	// KeySalt is the secret salt of principal hashes in the region's Redis
	// keys, given to the agent in $ALLOT_KEY_SALT (not as -key-salt, which
	// ps shows), as docs/operations.md recommends. Empty, StartRegion
	// draws a random one. Every agent and gateway of the region must share
	// it: Region.KeySalt is the one in force.
	KeySalt string
	// Output receives both processes' output (nil: kept for diagnostics).
	Output io.Writer
}

// Region is a running region: its Redis and its agent.
type Region struct {
	// Name is the region.
	Name string
	// RedisAddr, APIAddr and EnvoyAddr are the Redis (empty with
	// RegionConfig.EmbeddedStore), the agent's Connect API (and /metrics,
	// /readyz) and its Envoy rate limit service.
	RedisAddr, APIAddr, EnvoyAddr string
	// DataDir is the agent's data dir (last-known-good policy).
	DataDir string
	// Redis and Agent are the running processes (Agent is replaced by
	// StartAgent; Redis is nil with RegionConfig.EmbeddedStore).
	Redis, Agent *Process
	// Args are the agent's arguments.
	Args []string
	// KeySalt is the region's key salt (RegionConfig.KeySalt, or the one
	// StartRegion drew): a gateway embedding the SDK on the region's Redis
	// sets it as admission.Config.KeySalt.
	KeySalt string
	// Env is what the agent's environment adds to this process's
	// ($ALLOT_KEY_SALT); StartAgent keeps it, so a restarted agent finds
	// its counters under the same key names.
	Env []string

	cfg       RegionConfig
	redisArgs []string
	dial      func(ctx context.Context, network, addr string) (net.Conn, error)
}

// KeySaltEnv is the environment variable regionagent reads its key salt
// from.
const KeySaltEnv = "ALLOT_KEY_SALT"

// The ports of a region in a Lab host (RegionConfig.Netns).
const (
	// LabRedisPort is the region's Redis, on the namespace's loopback.
	LabRedisPort = 6379
	// LabAgentAPIPort is the agent's Connect API (and /metrics, /readyz).
	LabAgentAPIPort = 8081
	// LabAgentEnvoyPort is the agent's Envoy rate limit service.
	LabAgentEnvoyPort = 8082
)

// StartRegion starts the region's redis-server (unless EmbeddedStore),
// then its agent, and waits until the agent answers /healthz. It does not
// wait for a policy: call WaitReady for that.
func StartRegion(ctx context.Context, cfg RegionConfig) (*Region, error) {
	if cfg.Name == "" || cfg.AgentBin == "" || cfg.Dir == "" {
		return nil, errors.New("region: Name, AgentBin and Dir are required")
	}
	if cfg.Host == "" {
		cfg.Host = "127.0.0.1"
	}
	r := &Region{Name: cfg.Name, cfg: cfg, DataDir: filepath.Join(cfg.Dir, "agent"), dial: (&net.Dialer{}).DialContext}
	r.KeySalt = cfg.KeySalt
	if r.KeySalt == "" {
		r.KeySalt = rand.Text()
	}
	r.Env = []string{KeySaltEnv + "=" + r.KeySalt}
	if h := cfg.Netns; h != nil {
		r.cfg.Host = "127.0.0.1" // Redis's bind address: the namespace's loopback
		r.APIAddr = net.JoinHostPort(h.IP, strconv.Itoa(LabAgentAPIPort))
		r.EnvoyAddr = net.JoinHostPort(h.IP, strconv.Itoa(LabAgentEnvoyPort))
		r.dial = func(ctx context.Context, network, addr string) (net.Conn, error) {
			return h.DialContext(ctx, nil, network, addr)
		}
	} else {
		var err error
		for _, addr := range []*string{&r.APIAddr, &r.EnvoyAddr} {
			if *addr, err = FreePort(cfg.Host); err != nil {
				return nil, err
			}
		}
	}
	store := []string{"-store", "embedded"}
	if !cfg.EmbeddedStore {
		if err := r.startRedis(ctx); err != nil {
			return nil, err
		}
		store = []string{"-store", "redis", "-redis", r.RedisAddr}
	}
	r.Args = append([]string{
		"-region", cfg.Name, "-allocators", strings.Join(cfg.AllocatorEndpoints, ","),
		"-data-dir", r.DataDir, "-api-addr", r.APIAddr, "-envoy-addr", r.EnvoyAddr,
	}, store...)
	r.Args = append(r.Args, cfg.AgentArgs...)
	if err := r.StartAgent(ctx); err != nil {
		// The region is not returned, so nothing else will stop what it
		// started: an agent that did not get healthy in time included.
		if r.Agent != nil {
			r.Agent.Kill()
		}
		if r.Redis != nil {
			r.Redis.Kill()
		}
		return nil, err
	}
	return r, nil
}

// startRedis starts the region's redis-server on a free port (a fixed one
// in a namespace) and waits until it answers.
func (r *Region) startRedis(ctx context.Context) error {
	cfg := &r.cfg
	if cfg.RedisBin == "" {
		p, err := exec.LookPath("redis-server")
		if err != nil {
			return fmt.Errorf("region %s: redis-server not found (RegionConfig.EmbeddedStore runs without it): %w", cfg.Name, err)
		}
		cfg.RedisBin = p
	}
	if cfg.Netns != nil {
		r.RedisAddr = net.JoinHostPort(cfg.Host, strconv.Itoa(LabRedisPort))
	} else {
		var err error
		if r.RedisAddr, err = FreePort(cfg.Host); err != nil {
			return err
		}
	}
	redisDir := filepath.Join(cfg.Dir, "redis")
	if err := os.MkdirAll(redisDir, 0o755); err != nil {
		return err
	}
	_, port, _ := net.SplitHostPort(r.RedisAddr)
	r.redisArgs = []string{"--port", port, "--bind", cfg.Host, "--dir", redisDir, "--save", "", "--appendonly", "no", "--daemonize", "no"}
	return r.runRedis(ctx)
}

// runRedis starts redis-server with the region's arguments and waits until
// it answers.
func (r *Region) runRedis(ctx context.Context) error {
	p, err := r.start(r.Name+"-redis", r.cfg.RedisBin, r.redisArgs, nil)
	if err != nil {
		return err
	}
	r.Redis = p
	if err := r.waitRedis(ctx); err != nil {
		r.Redis.Kill()
		r.Redis = nil
		return err
	}
	return nil
}

// RestartRedis kills the region's redis-server (SIGKILL: everything it held
// is lost, as in a crash without persistence) and starts it again on the
// same address, waiting until it answers. The agent's client reconnects.
func (r *Region) RestartRedis(ctx context.Context) error {
	if r.Redis == nil {
		return fmt.Errorf("region %s: no Redis to restart (embedded store)", r.Name)
	}
	r.Redis.Kill()
	return r.runRedis(ctx)
}

// start starts a process of the region, inside its namespace if it has one.
func (r *Region) start(name, bin string, args, env []string) (*Process, error) {
	if h := r.cfg.Netns; h != nil {
		return h.startProcess(name, bin, args, env, r.cfg.Output)
	}
	return startProcess(name, bin, args, env, r.cfg.Output)
}

func (r *Region) waitRedis(ctx context.Context) error {
	c := redis.NewClient(&redis.Options{Addr: r.RedisAddr, MaxRetries: -1, Dialer: r.dial})
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

// StartAgent (re)starts the agent with its recorded arguments and
// environment (its data dir keeps the last-known-good policy across
// restarts, its key salt the key names of its counters) and waits until it
// answers /healthz.
func (r *Region) StartAgent(ctx context.Context) error {
	p, err := r.start(r.Name+"-agent", r.cfg.AgentBin, r.Args, r.Env)
	if err != nil {
		return err
	}
	r.Agent = p
	return r.waitHTTP(ctx, "/healthz")
}

// WaitReady waits until the agent has a policy in force (/readyz).
func (r *Region) WaitReady(ctx context.Context) error { return r.waitHTTP(ctx, "/readyz") }

func (r *Region) waitHTTP(ctx context.Context, path string) error {
	hc := &http.Client{Timeout: 300 * time.Millisecond, Transport: &http.Transport{DialContext: r.dial}}
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
// h2c), dialling from the region's namespace when it has one.
func (r *Region) Client() allotv1connect.AdmissionServiceClient {
	hc := allocator.NewHTTPClient()
	if t, ok := hc.Transport.(*http.Transport); ok && r.cfg.Netns != nil {
		t.DialContext = r.dial
	}
	return allotv1connect.NewAdmissionServiceClient(hc, "http://"+r.APIAddr)
}

// Close stops the agent gracefully (SIGTERM: it hands its unspent tokens
// back to the allocator), then the Redis, if any.
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
