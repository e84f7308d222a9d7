// Command regionagent runs allot's region agent: it leases the region's share
// of every global quota from the allocator into the region's Redis, follows
// the allocator's policy (keeping the last-known-good one in -data-dir), and
// serves admission decisions over Connect (allot.v1.AdmissionService on
// -api-addr, with /metrics, /healthz and /readyz) and Envoy's rate limit
// service (gRPC on -envoy-addr, which also serves allot.v1.AdmissionService
// to gRPC clients: gRPC's own transport is the cheaper one per call). With -store embedded it decides on an
// in-process store instead of Redis (one agent per region, counters lost on
// restart, no tokens handed back on shutdown): for trying allot on a machine
// without redis-server.
//
//	regionagent -region eu -allocators 127.0.0.1:8001,127.0.0.1:8002,127.0.0.1:8003 \
//	  -redis 127.0.0.1:6379 -data-dir /var/lib/allot/eu -api-addr :8081 -envoy-addr :8082
//
// Secrets come from the environment, which ps does not show:
// ALLOT_KEY_SALT, the salt of principal hashes in Redis key names (the same
// secret on every agent and gateway of the region; without it the agent
// warns at start, as principals can then be recovered from the key names),
// ALLOT_LOG_SALT (decision logs), ALLOT_REDIS_PASSWORD and
// ALLOT_REDIS_SENTINEL_PASSWORD. The flags -key-salt and -log-salt still
// work, with a warning; given with its variable, each must agree with it.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"golang.org/x/sync/errgroup"

	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/agent"
	"github.com/allot-dev/allot/pkg/allocator"
)

// Secrets come from the environment, never from flags: ps and
// /proc/<pid>/cmdline show a process's flags to every local user. The salts'
// flags remain for the deployments that used them (see secretSetting).
const (
	redisPasswordEnv    = "ALLOT_REDIS_PASSWORD"
	sentinelPasswordEnv = "ALLOT_REDIS_SENTINEL_PASSWORD"
	keySaltEnv          = "ALLOT_KEY_SALT"
	logSaltEnv          = "ALLOT_LOG_SALT"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:])
	stop()
	if err != nil && !errors.Is(err, flag.ErrHelp) {
		fmt.Fprintln(os.Stderr, "regionagent:", err)
		os.Exit(1)
	}
}

func run(ctx context.Context, args []string) error {
	cfg := agent.DefaultConfig()
	var (
		allocators, clearKeys string
		allocatorsGRPC        string
		redisAddrs, apiAddr   string
		envoyAddr, storeKind  string
		conn                  = agent.DefaultRedisConn()
		memoryKeys            int
		clockOffset           time.Duration
		journalPath           string
		logLevel              = zapcore.InfoLevel
	)
	fs := flag.NewFlagSet("regionagent", flag.ContinueOnError)
	fs.StringVar(&cfg.Region, "region", "", "region this agent leases for (one of the policy's regions; /readyz answers 503 while it is not)")
	fs.StringVar(&allocators, "allocators", "", "comma-separated allocator API addresses (empty: standalone on -policy)")
	fs.StringVar(&allocatorsGRPC, "allocators-grpc", "", "comma-separated allocator gRPC addresses (allocator -grpc-addr) for Acquire and Release; empty: the Connect API")
	fs.StringVar(&storeKind, "store", "redis", "where counters live: redis (-redis) or embedded (in this process; one agent per region)")
	fs.StringVar(&redisAddrs, "redis", strings.Join(conn.Addrs, ","), "the region's Redis: its address (standalone), seed nodes (cluster) or Sentinels (sentinel), comma-separated")
	fs.StringVar(&conn.Mode, "redis-mode", conn.Mode, "standalone, cluster (a Redis Cluster) or sentinel (a primary watched by Sentinels; see -redis-master)")
	fs.StringVar(&conn.MasterName, "redis-master", "", "sentinel mode: the name the Sentinels monitor the primary under")
	fs.StringVar(&conn.Username, "redis-user", "", "Redis ACL user (the password is read from $"+redisPasswordEnv+", the Sentinels' from $"+sentinelPasswordEnv+")")
	fs.BoolVar(&conn.TLS, "redis-tls", false, "connect to Redis over TLS")
	fs.StringVar(&conn.CAFile, "redis-tls-ca", "", "PEM roots for Redis's certificates (default: the system's)")
	fs.StringVar(&conn.ServerName, "redis-tls-server-name", "", "name checked in Redis's certificates (default: the host dialed)")
	fs.StringVar(&conn.CertFile, "redis-tls-cert", "", "PEM client certificate for Redis nodes that authenticate clients (tls-auth-clients yes); read again at each new connection")
	fs.StringVar(&conn.KeyFile, "redis-tls-key", "", "PEM key of -redis-tls-cert")
	fs.DurationVar(&conn.DialTimeout, "redis-dial-timeout", conn.DialTimeout, "bound on one connection attempt to Redis")
	fs.IntVar(&memoryKeys, "memory-keys", admission.DefaultMemoryConfig().MaxKeys, "most keys the embedded store holds")
	fs.IntVar(&conn.PoolSize, "redis-pool", conn.PoolSize, "Redis connections (per node)")
	fs.IntVar(&cfg.Store.BatchSize, "redis-batch", cfg.Store.BatchSize, "most decisions in one Redis pipeline")
	fs.DurationVar(&cfg.Store.BatchDelay, "redis-batch-delay", cfg.Store.BatchDelay, "how long a partial batch may wait for companions while other pipelines are in flight (0: sent as soon as a pipeline slot is free)")
	fs.IntVar(&cfg.Store.MaxPipelines, "redis-pipelines", cfg.Store.MaxPipelines, "most Redis pipelines in flight")
	fs.StringVar(&cfg.Store.StateForm, "redis-state", cfg.Store.StateForm, "form counters are written in: binary, or text while gateways of builds that read only text share the Redis")
	fs.StringVar(&cfg.DataDir, "data-dir", "", "directory for the last-known-good policy")
	fs.StringVar(&cfg.PolicyFile, "policy", "", "policy file in force (as version 0) until the allocator's arrives")
	fs.StringVar(&apiAddr, "api-addr", "127.0.0.1:8081", "Connect API, /metrics, /healthz, /readyz address")
	fs.StringVar(&envoyAddr, "envoy-addr", "127.0.0.1:8082", "gRPC address: Envoy's rate limit service and allot.v1.AdmissionService; empty disables it")
	fs.StringVar(&cfg.EnvoyDomain, "envoy-domain", "", "the only Envoy rate limit domain accepted (empty: any)")
	fs.StringVar(&cfg.EnvoyRequestIDKey, "envoy-request-id-key", "", "Envoy descriptor key whose value is the request id (idempotency, concurrency slot names), e.g. "+agent.RequestIDKey+"; only for ids your own edge generates per request, never clients' (a repeated id is replayed uncharged); empty: none, every entry is a descriptor entry")
	fs.StringVar(&cfg.Engine.Namespace, "namespace", cfg.Engine.Namespace, "Redis key namespace")
	fs.StringVar(&cfg.Engine.KeySalt, "key-salt", "", "deprecated, shown by ps: set $"+keySaltEnv+" instead. Secret salt of principal hashes in Redis keys: the same on every agent and gateway of the region, or counters split; changing it starts every counter afresh")
	fs.IntVar(&cfg.Engine.Gateways, "gateways", cfg.Engine.Gateways, "gateways sharing the region's Redis (sizes fallback buckets)")
	fs.DurationVar(&cfg.Engine.StoreTimeout, "store-timeout", cfg.Engine.StoreTimeout, "bound on one Redis call on the decision path")
	fs.DurationVar(&cfg.Engine.NegativeCacheTTL, "negative-cache", cfg.Engine.NegativeCacheTTL, "negative cache ceiling (0: off, see package agent)")
	fs.IntVar(&cfg.Engine.KeyCacheSize, "key-cache", cfg.Engine.KeyCacheSize, "counter keys kept made, about 200 bytes each: a principal seen again costs no hash and no allocation for its keys (0: off)")
	fs.DurationVar(&cfg.Lease.Tick, "lease-tick", cfg.Lease.Tick, "lease manager tick")
	fs.DurationVar(&cfg.Lease.Lead, "lease-lead", cfg.Lease.Lead, "renew this long before a pool runs dry at its demand")
	fs.DurationVar(&cfg.Lease.PregrantLead, "pregrant-lead", cfg.Lease.PregrantLead, "how long before a window ends a clamped pool with demand takes a chunk of the next window; 0 turns pre-grants off")
	fs.DurationVar(&cfg.Lease.DepositTimeout, "deposit-timeout", cfg.Lease.DepositTimeout, "shortest bound on one deposit into Redis; a chunk's TTL leaves this much of its lease unused")
	fs.DurationVar(&cfg.Lease.Margin, "lease-margin", cfg.Lease.Margin, "margin subtracted from lease deadlines (match the allocator's; a larger one the allocator states is used instead)")
	fs.Int64Var(&cfg.Lease.MaxDriftPPM, "max-drift-ppm", cfg.Lease.MaxDriftPPM, "assumed maximum rate error of this machine's clock against the allocator leader's, in ppm (the bound's assumption); widens the leader's-clock estimate fallback allowances are placed by")
	fs.Int64Var(&cfg.Lease.MinChunk, "min-chunk", cfg.Lease.MinChunk, "smallest chunk asked for")
	fs.DurationVar(&cfg.Lease.AcquireTimeout, "acquire-timeout", cfg.Lease.AcquireTimeout, "bound on one Acquire call")
	fs.DurationVar(&cfg.StarveWait, "starve-wait", cfg.StarveWait, "longest wait of a request for a lease renewal")
	fs.IntVar(&cfg.MaxRequestBytes, "max-request-bytes", cfg.MaxRequestBytes, "largest request message")
	fs.Float64Var(&cfg.DecisionLogSample, "log-sample", cfg.DecisionLogSample, "fraction of decisions logged")
	fs.StringVar(&cfg.LogSalt, "log-salt", "", "deprecated, shown by ps: set $"+logSaltEnv+" instead. Secret salt of principal hashes in decision logs; empty: a random one per process, so hashes do not correlate across restarts or agents")
	fs.StringVar(&clearKeys, "log-clear-keys", strings.Join(cfg.LogClearKeys, ","), "descriptor keys logged in clear")
	fs.DurationVar(&cfg.ShutdownTimeout, "shutdown-timeout", cfg.ShutdownTimeout, "bound on the shutdown, from SIGTERM: handing unspent tokens back, and draining the calls in flight")
	fs.StringVar(&journalPath, "lease-journal", "", "append every Acquire, grant, deposit and Release to this file as JSON lines (audits, the chaos suite)")
	fs.DurationVar(&clockOffset, "clock-offset", 0, "fault injection only: run the agent's clock this far from the machine's (lease deadlines must not move)")
	fs.Var(&logLevel, "log-level", "log level: debug, info, warn, error")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		// Flags stop at the first word that is not one: what follows it
		// would be silently ignored.
		return fmt.Errorf("unexpected arguments %q (every setting is a -flag)", fs.Args())
	}
	var notes []string
	for _, sec := range []struct {
		dst       *string
		flag, env string
	}{{&cfg.Engine.KeySalt, "key-salt", keySaltEnv}, {&cfg.LogSalt, "log-salt", logSaltEnv}} {
		v, note, err := secretSetting(*sec.dst, sec.flag, sec.env, os.Getenv)
		if err != nil {
			return err
		}
		*sec.dst = v
		if note != "" {
			notes = append(notes, note)
		}
	}
	if allocatorsGRPC != "" {
		cfg.AllocatorGRPCEndpoints = strings.Split(allocatorsGRPC, ",")
	}
	if allocators != "" {
		cfg.AllocatorEndpoints = strings.Split(allocators, ",")
	}
	cfg.LogClearKeys = nil
	if clearKeys != "" {
		cfg.LogClearKeys = strings.Split(clearKeys, ",")
	}
	if err := cfg.Validate(); err != nil {
		return err
	}
	zc := zap.NewProductionConfig()
	zc.Level = zap.NewAtomicLevelAt(logLevel)
	log, err := zc.Build()
	if err != nil {
		return fmt.Errorf("logger: %w", err)
	}
	defer func() { _ = log.Sync() }()
	for _, n := range notes {
		log.Warn(n)
	}

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	opts := []agent.Option{agent.WithLogger(log), agent.WithRegisterer(reg)}
	var clock admission.Clock = admission.SystemClock{}
	if clockOffset != 0 {
		clock = agent.OffsetClock{Offset: clockOffset}
		opts = append(opts, agent.WithClock(clock))
		log.Warn("agent clock offset from the machine's (fault injection)", zap.Duration("offset", clockOffset))
	}
	if journalPath != "" {
		f, w, err := openJournal(journalPath)
		if err != nil {
			return fmt.Errorf("-lease-journal: %w", err)
		}
		defer f.Close()
		j := agent.NewLeaseJournal(w)
		j.SetLogger(log.With(zap.String("file", journalPath)))
		j.Record(agent.LeaseEvent{Kind: agent.LeaseEventStart, At: clock.Now().UnixNano(), Region: cfg.Region,
			ClockOffsetNs: int64(clockOffset), Pid: os.Getpid()})
		opts = append(opts, agent.WithLeaseObserver(j.Record))
		defer func() {
			if err := j.Close(); err != nil {
				log.Error("lease journal incomplete", zap.String("file", journalPath), zap.Error(err))
			}
		}()
	}
	var rdb redis.UniversalClient // stays nil for the embedded store
	switch storeKind {
	case "redis":
		conn.Addrs = strings.Split(redisAddrs, ",")
		conn.Password = os.Getenv(redisPasswordEnv)
		conn.SentinelPassword = os.Getenv(sentinelPasswordEnv)
		c, err := conn.Client()
		if err != nil {
			return fmt.Errorf("redis connection (-redis, -redis-mode, -redis-master, -redis-tls*, -redis-pool, -redis-dial-timeout): %w", err)
		}
		defer c.Close()
		// The client's own messages (failed dials, a Sentinel switching
		// primaries) go to this process's log, not to stderr as plain lines.
		redis.SetLogger(admission.RedisLog{Logger: log})
		if conn.Mode == agent.RedisSentinel {
			log.Info("Sentinel fails over asynchronously: debits the old primary acknowledged can be lost; run the allocator with -store-async-failover so that the stated bound accounts for them",
				zap.String("master", conn.MasterName))
		}
		rdb = c
	case "embedded":
		ms, err := admission.NewMemoryStore(admission.MemoryConfig{MaxKeys: memoryKeys}, nil)
		if err != nil {
			return fmt.Errorf("-memory-keys: %w", err)
		}
		opts = append(opts, agent.WithStore(ms))
	default:
		return fmt.Errorf("-store: %q is neither redis nor embedded", storeKind)
	}
	// Both listeners before the agent: a port taken fails the start before
	// anything runs that would have to be stopped and waited for (the
	// agent's Run, the servers).
	apiLn, err := net.Listen("tcp", apiAddr)
	if err != nil {
		return fmt.Errorf("listen api: %w", err)
	}
	defer apiLn.Close() // the server closes it too; this is for the early returns
	var envoyLn net.Listener
	if envoyAddr != "" {
		if envoyLn, err = net.Listen("tcp", envoyAddr); err != nil {
			return fmt.Errorf("listen envoy: %w", err)
		}
		defer envoyLn.Close()
	}
	a, err := agent.New(cfg, rdb, opts...)
	if err != nil {
		return err
	}

	// The whole shutdown is bounded by -shutdown-timeout from SIGTERM: the
	// agent's hand-back of its tokens, and the servers' drain of the calls
	// in flight, which are cut when it runs out (a client holding a call
	// open must not hold the process).
	g, gctx := errgroup.WithContext(ctx)
	g.Go(func() error { return a.Run(gctx) })
	g.Go(func() error {
		return allocator.Serve(gctx, allocator.HTTPServer(apiAddr, agent.Mux(a, reg)), apiLn, cfg.ShutdownTimeout)
	})
	if envoyLn != nil {
		gs := agent.NewGRPCServer(a)
		g.Go(func() error { return gs.Serve(envoyLn) })
		g.Go(func() error {
			<-gctx.Done()
			stopped := make(chan struct{})
			go func() {
				gs.GracefulStop()
				close(stopped)
			}()
			t := time.NewTimer(cfg.ShutdownTimeout)
			defer t.Stop()
			select {
			case <-stopped:
			case <-t.C:
				gs.Stop() // cuts the calls still in flight; GracefulStop then returns
				<-stopped
			}
			return nil
		})
	}
	log.Info("region agent listening", zap.String("region", cfg.Region), zap.String("store", storeKind), zap.String("api", apiLn.Addr().String()),
		zap.String("envoy", envoyAddr), zap.Strings("allocators", cfg.AllocatorEndpoints))
	return g.Wait()
}

// secretSetting returns the secret that comes from the environment variable
// env, or (for the deployments that set it before the variable existed) from
// the flag named flagName, whose value is fromFlag. Given both, they must be
// the same, or neither wins: a region whose agents disagree on the key salt
// splits its counters without a word. note, when not empty, is a warning
// to log: the flag shows the secret to every local user (ps,
// /proc/<pid>/cmdline), the environment only to the process's user and root.
func secretSetting(fromFlag, flagName, env string, getenv func(string) string) (value, note string, err error) {
	fromEnv := getenv(env)
	switch {
	case fromFlag == "":
		return fromEnv, "", nil
	case fromEnv != "" && fromEnv != fromFlag:
		return "", "", fmt.Errorf("-%s and $%s are both set and differ: set $%s only", flagName, env, env)
	}
	return fromFlag, fmt.Sprintf("-%s shows its secret to every local user (ps, /proc/<pid>/cmdline): set $%s instead", flagName, env), nil
}

// openJournal opens the lease journal at path for appending, and returns the
// file (for the caller to close) and the writer to journal through.
//
// The journal is appended without fsync, so a power loss or a full disk can
// leave its last line torn. The next process's events would then be appended
// to that line, the first of them (its start event: the process boundary,
// pid and clock offset) lost with it as one malformed line. So when the file
// does not end in a newline, the writer puts one before the first event, in
// the same write: if that write fails, the journal stops there (and says
// so) rather than the start failing.
func openJournal(path string) (*os.File, io.Writer, error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR|os.O_APPEND, 0o644)
	if err != nil {
		return nil, nil, err
	}
	torn, err := tornLastLine(f)
	if err != nil {
		f.Close()
		return nil, nil, err
	}
	if torn {
		return f, &newlineFirst{w: f}, nil
	}
	return f, f, nil
}

// tornLastLine reports whether f, a regular file, is not empty and does not
// end in a newline.
func tornLastLine(f *os.File) (bool, error) {
	st, err := f.Stat()
	if err != nil || !st.Mode().IsRegular() || st.Size() == 0 {
		return false, err
	}
	var last [1]byte
	if _, err := f.ReadAt(last[:], st.Size()-1); err != nil {
		return false, fmt.Errorf("reading its last byte: %w", err)
	}
	return last[0] != '\n', nil
}

// newlineFirst writes a newline and its first write's bytes in one write,
// then passes writes through. The journal makes one write at a time.
type newlineFirst struct {
	w    io.Writer
	done bool
}

// Write implements io.Writer.
func (n *newlineFirst) Write(p []byte) (int, error) {
	if n.done {
		return n.w.Write(p)
	}
	k, err := n.w.Write(append([]byte{'\n'}, p...))
	if k > 0 {
		n.done = true
	}
	return max(k-1, 0), err
}
