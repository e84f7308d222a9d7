// Command allotbench measures the admission engine against Redis: the raw
// script through go-redis (one call per decision, then pipelined), the SDK
// with 1 and 3 rules, and the SDK paced at half its maximum rate, with the
// Redis CPU each decision costs, and the machine's own stalls (the floor
// under the paced tail); -suite agent measures the region agent's
// Check, CheckBatch and Envoy endpoints the same way. Run -h for the modes
// and flags.
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
	"runtime"
	"runtime/pprof"
	"strconv"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/allot-dev/allot/internal/redistest"
	"github.com/allot-dev/allot/pkg/bench"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	if err != nil && err != flag.ErrHelp {
		fmt.Fprintln(os.Stderr, "allotbench:", err)
		os.Exit(1)
	}
}

const usage = `allotbench measures the admission engine against one Redis, in one run.

Modes (-mode, comma-separated; "all" runs them in this order):
  raw        (a)  the admission script through go-redis, one EVALSHA per decision
  pipelined  (a') the same script, -pipeline decisions per round trip
  sdk        (b)  the SDK: Engine.Decide on a RedisStore (auto-batched), 1 rule
  sdk3            the SDK with 3 rules per decision (tenant, user, route)
  paced           the SDK paced at -rate, or at half of sdk's rate: quote its p99
  paced-raw       the control: (a)'s calls at the paced rate, without the SDK
                  (-sweep F,F,...: the paced modes at each fraction of sdk's rate)
  paced3          the SDK with 3 rules at the paced rate (not in "all"): what
                  the two extra rules cost a caller in latency at one load
  sdk13           sdk and sdk3 in alternate -slice slices of one -duration run
                  (not in "all"): the 3-rule comparison with both sides meeting
                  the same machine, which moves within seconds on a shared VM
  stalls          no Redis: one spinner per CPU for -duration, counting the
                  moments the machine takes a busy CPU away; prints the share
                  of evenly paced calls such stalls alone hold up for 2 ms or
                  more, the floor under the paced p99 on this machine
The paced modes also count their calls of 2 ms and more by the 10 ms window they
ended in: a tail made by stalls shows as a few crowded windows.

With -suite agent, the region agent's APIs beside the raw ceiling:
  raw           (a)  as above
  connect       (c)  the agent's Check over Connect, HTTP/2 (-connections connections)
  connect-batch (cb) the same Check calls through pkg/checkclient, which coalesces
                concurrent callers' checks into CheckBatch calls (one client)
  connect-http1 (c') the same over HTTP/1.1, one keep-alive connection per worker
  connect-lean  (cl) the same over HTTP/1.1 from a lean load generator (prepared
                requests, one write and one read per call): the agent's Connect
                server without the CPU of Go's HTTP client on the same cores
  connect-grpc  (c'') the same Connect client with WithGRPC() against the gRPC listener
  grpc          (c*) Check from a grpc-go client on the gRPC listener
  envoy         (d)  the agent's Envoy RLS endpoint over gRPC (-connections connections)

Every mode runs -workers concurrent callers over -keys counters, bounded by
-requests calls and -duration, after -warmup, and reports decisions/s, latency
percentiles and Redis CPU microseconds per decision (INFO commandstats and
INFO cpu). With -redis "" a private redis-server is started from PATH.
When Redis runs on this machine, the admission suite holds itself to one
CPU fewer than the machine has (-procs), leaving the single-threaded Redis
a core of its own, as on a host of its own.

Flags:
`

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	cfg := bench.DefaultSuiteConfig()
	fs := flag.NewFlagSet("allotbench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() {
		fmt.Fprint(stderr, usage)
		fs.PrintDefaults()
	}
	mode := fs.String("mode", "all", "modes to run: all, or a comma-separated list of "+strings.Join(bench.Modes(), ", ")+", paced3 (-suite agent: "+strings.Join(bench.AgentModes(), ", ")+")")
	addr := fs.String("redis", "", `Redis address host:port; "" starts a private redis-server`)
	fs.IntVar(&cfg.Workers, "workers", cfg.Workers, "concurrent callers")
	fs.IntVar(&cfg.Keys, "keys", cfg.Keys, "distinct counters the requests spread over")
	fs.Int64Var(&cfg.Requests, "requests", cfg.Requests, "upper bound on calls per mode")
	fs.DurationVar(&cfg.Duration, "duration", cfg.Duration, "upper bound on the time per mode (warmup included)")
	fs.DurationVar(&cfg.Warmup, "warmup", cfg.Warmup, "warmup before each mode")
	fs.IntVar(&cfg.Pipeline, "pipeline", cfg.Pipeline, "decisions per round trip in the pipelined mode")
	fs.Float64Var(&cfg.Rate, "rate", 0, "paced mode's rate in decisions/s; 0 = half of the sdk mode's")
	sweep := fs.String("sweep", "", "run the paced modes at each of these fractions of the sdk mode's rate, e.g. 0.1,0.25,0.5,0.75, and print latency by rate")
	fs.IntVar(&cfg.Redis.BatchSize, "batch", cfg.Redis.BatchSize, "SDK and agent: most decisions per pipeline (-suite agent: the agent's default unless set)")
	fs.IntVar(&cfg.Redis.MaxPipelines, "pipelines", cfg.Redis.MaxPipelines, "SDK and agent: most pipelines in flight (-suite agent: the agent's default unless set)")
	fs.DurationVar(&cfg.Redis.BatchDelay, "batch-delay", cfg.Redis.BatchDelay, "SDK and agent: how long a partial batch may wait while pipelines are in flight (-suite agent: the agent's default, 300µs, unless set)")
	cpuprofile := fs.String("cpuprofile", "", "write a CPU profile of the benchmark client to this file")
	memprofile := fs.String("memprofile", "", "write an allocation profile of the benchmark client to this file at the end")
	suite := fs.String("suite", "admission", "admission: the engine's modes (a), (a'), (b); agent: the region agent's Connect (c) and Envoy RLS (d) beside the raw ceiling (a)")
	procs := fs.Int("procs", 0, "GOMAXPROCS of this process; 0: for -suite admission one fewer than the machine's CPUs when Redis runs on this machine (a loopback address, or the private server), so that the single-threaded Redis keeps a core as on a host of its own; for -suite agent all of them (the agent's RPC servers and clients share this process)")
	slice := fs.Duration("slice", bench.DefaultInterleaving.Slice, "admission suite, mode sdk13: how long each slice runs one side; the first tenth of it is not measured")
	repeat := fs.Int("repeat", 1, "admission suite: run the -mode list this many times in turn (e.g. -mode sdk,sdk3 -repeat 5: the 3-rule comparison is then made pair by pair, with the median)")
	bracket := fs.Bool("bracket", false, "agent suite: measure (a) before the first mode and after each, and compare each mode with the (a)s beside it")
	connections := fs.Int("connections", bench.DefaultAgentSuiteConfig().Connections, "agent suite: HTTP/2 connections the clients spread over")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q (every setting is a -flag)", fs.Args())
	}
	if *cpuprofile != "" {
		f, err := os.Create(*cpuprofile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	if *memprofile != "" {
		runtime.MemProfileRate = 4096
		defer func() {
			if err := writeHeapProfile(*memprofile); err != nil {
				fmt.Fprintln(stderr, "allotbench: memprofile:", err)
			}
		}()
	}
	if *suite != "admission" && *suite != "agent" {
		return fmt.Errorf("-suite: %q is neither admission nor agent", *suite)
	}
	acfg := bench.DefaultAgentSuiteConfig()
	acfg.Workers, acfg.Keys, acfg.Requests, acfg.Duration, acfg.Warmup = cfg.Workers, cfg.Keys, cfg.Requests, cfg.Duration, cfg.Warmup
	acfg.Connections = *connections
	fs.Visit(func(f *flag.Flag) { // the agent's store defaults, but what was set
		switch f.Name {
		case "batch":
			acfg.Redis.BatchSize = cfg.Redis.BatchSize
		case "pipelines":
			acfg.Redis.MaxPipelines = cfg.Redis.MaxPipelines
		case "batch-delay":
			acfg.Redis.BatchDelay = cfg.Redis.BatchDelay
		}
	})
	if *mode != "all" {
		cfg.Modes = strings.Split(*mode, ",")
		acfg.Modes = cfg.Modes
	}
	cfg.Interleave = bench.Interleaving{Slice: *slice, Guard: *slice / 10}
	if *repeat < 1 || *repeat > 100 {
		return fmt.Errorf("-repeat: %d is not between 1 and 100", *repeat)
	}
	if *repeat > 1 {
		if *suite != "admission" || *mode == "all" {
			return errors.New("-repeat: only with -suite admission and a -mode list")
		}
		one := cfg.Modes
		for i := 1; i < *repeat; i++ {
			cfg.Modes = append(cfg.Modes, one...)
		}
	}
	if *sweep != "" {
		if *suite != "admission" {
			return errors.New("-sweep: only with -suite admission")
		}
		for _, v := range strings.Split(*sweep, ",") {
			f, err := strconv.ParseFloat(strings.TrimSpace(v), 64)
			if err != nil {
				return fmt.Errorf("-sweep: %q is not a number", v)
			}
			cfg.Sweep = append(cfg.Sweep, f)
		}
	}
	if *bracket {
		if *suite != "agent" {
			return errors.New("-bracket: only with -suite agent")
		}
		acfg.Modes = bench.Bracket(acfg.Modes)
	}
	if *suite == "agent" {
		if err := acfg.Validate(); err != nil {
			return err
		}
	} else if err := cfg.Validate(); err != nil {
		return err
	}
	if *procs < 0 {
		return fmt.Errorf("-procs: %d is negative", *procs)
	}
	if *procs == 0 && *suite == "admission" && localRedis(*addr) {
		*procs = max(1, runtime.NumCPU()-1)
	}
	if *procs > 0 {
		runtime.GOMAXPROCS(*procs)
	}
	if *addr == "" {
		srv, err := redistest.StartServer(ctx)
		if err != nil {
			return fmt.Errorf("start redis-server: %w", err)
		}
		defer srv.Close()
		*addr = srv.Addr()
	}
	// Pipelines bounded by their deadline, as the agent's client
	// (agent.RedisConn) has them.
	client := redis.NewClient(&redis.Options{Addr: *addr, PoolSize: cfg.Workers, ContextTimeoutEnabled: true})
	defer client.Close()
	version, _ := client.Info(ctx, "server").Result()
	fmt.Fprintf(stdout, "allotbench: redis %s at %s, %d workers, %d keys, GOMAXPROCS %d of %d CPUs, %s\n",
		field(version, "redis_version"), *addr, cfg.Workers, cfg.Keys, runtime.GOMAXPROCS(0), runtime.NumCPU(), time.Now().UTC().Format(time.RFC3339))
	store := cfg.Redis
	if *suite == "agent" {
		store = acfg.Redis
	}
	fmt.Fprintf(stdout, "allotbench: store batcher: %d decisions per pipeline, %d pipelines in flight, a partial batch waits up to %s\n",
		store.BatchSize, store.MaxPipelines, store.BatchDelay)
	var (
		figs []bench.Figure
		err  error
	)
	if *suite == "agent" {
		figs, err = bench.RunAgentSuite(ctx, client, acfg, stdout)
	} else {
		figs, err = bench.RunSuite(ctx, client, cfg, stdout)
	}
	if err != nil {
		return err
	}
	if *suite == "agent" {
		bench.SummarizeAgent(stdout, figs)
	} else {
		bench.Summarize(stdout, figs)
	}
	return nil
}

// localRedis reports whether Redis at addr ("" for the private server) runs
// on this machine.
func localRedis(addr string) bool {
	if addr == "" {
		return true
	}
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

func field(info, key string) string {
	for _, line := range strings.Split(info, "\n") {
		if v, ok := strings.CutPrefix(strings.TrimSpace(line), key+":"); ok {
			return v
		}
	}
	return "?"
}

// writeHeapProfile writes the allocations made so far (alloc_space and
// alloc_objects samples) to path.
func writeHeapProfile(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := pprof.Lookup("allocs").WriteTo(f, 0); err != nil {
		f.Close()
		return err
	}
	return f.Close()
}
