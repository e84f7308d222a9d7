package topology

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/allot-dev/allot/examples"
	"github.com/allot-dev/allot/pkg/allocator"
	"github.com/allot-dev/allot/pkg/faultproxy"
	"github.com/allot-dev/allot/pkg/policy"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
	"github.com/allot-dev/allot/proto/allot/v1/allotv1connect"
)

// The quotas and the route the demo drives: Northstar's P-TENANT rules of
// Atlas (the flood) and Birch (the small customer that must never be
// denied), on a route no per-user or per-route rule matches, so only the
// tenant quotas apply.
const (
	// AtlasQuota is the global quota Atlas's requests spend.
	AtlasQuota = "p-tenant-atlas"
	// BirchQuota is the global quota Birch's requests spend.
	BirchQuota = "p-tenant-birch"
	// DemoRoute is the route of every request the demo sends.
	DemoRoute = "GET /orders"
)

// Store modes of DemoConfig.Store.
const (
	// StoreAuto uses a redis-server per region when one is installed, and
	// the agents' embedded store otherwise.
	StoreAuto = ""
	// StoreRedis starts a redis-server per region (it must be installed).
	StoreRedis = "redis"
	// StoreEmbedded starts no Redis: each agent decides on its in-process
	// store (regionagent -store embedded).
	StoreEmbedded = "embedded"
)

// DemoConfig configures the local multi-region run of deploy/multiregion:
// real allocator processes, and per region a redis-server and a region
// agent, with Atlas and Birch load offered through the agents' Check API.
type DemoConfig struct {
	// Allocators is the number of allocator nodes (3 tolerates one failure).
	Allocators int
	// Regions are the regions to start, each with its own store and agent;
	// they replace the policy's regions.
	Regions []string
	// Atlas is Atlas's offered requests per second by region; regions it
	// does not name offer none. Nil spreads 500/s (3x G per 6 s window) 90%
	// to the first region and 10% over the others, the reference design's
	// EU 900 / US 100 demand split.
	Atlas map[string]float64
	// Birch is Birch's offered requests per second by region. Nil spreads
	// 300/s evenly over the regions.
	Birch map[string]float64
	// Window rescales the windows of AtlasQuota and BirchQuota (their lease
	// TTL becomes a quarter of it) so a run takes seconds; 0 keeps the
	// policy's windows.
	Window time.Duration
	// Windows is how many full windows to report before stopping; 0 runs
	// until the context ends.
	Windows int
	// WANLatency is the one-way delay added to every link between a region's
	// agent and an allocator, by one fault proxy per link; 0 adds none.
	// During an election a leader hint may send an agent to an allocator
	// directly, without the delay, until it fails over again.
	WANLatency time.Duration
	// Store picks the regions' store: StoreAuto, StoreRedis or
	// StoreEmbedded.
	Store string
	// MaxInFlight bounds the Check calls in flight per region and tenant;
	// requests due while it is full are counted as offered and not sent.
	MaxInFlight int
	// CallTimeout bounds one Check call.
	CallTimeout time.Duration
	// Keep keeps the topology running after the last window, without load,
	// until the context ends, for trying the API by hand.
	Keep bool
	// Dir holds binaries, data and logs. Empty makes a temporary directory,
	// removed at the end unless KeepDir; a given Dir is never removed.
	Dir string
	// KeepDir keeps the temporary Dir after the run.
	KeepDir bool
	// Root is the module root the binaries are built from.
	Root string
	// BinDir, when set, holds the allocator, regionagent and allotctl
	// binaries already built; empty builds them from Root into Dir/bin.
	BinDir string
	// Policy is the policy document (YAML or JSON); nil is the embedded
	// Northstar example. It must have the global quotas AtlasQuota and
	// BirchQuota, matching tenant=atlas and tenant=birch.
	Policy []byte
	// Output receives the processes' output in addition to the log files
	// under Dir/logs (nil: only the files).
	Output io.Writer
}

// DefaultDemoConfig returns the defaults of deploy/multiregion: 3
// allocators, regions eu and us, 6 s windows, 5 of them, the default Atlas
// and Birch load.
func DefaultDemoConfig() DemoConfig {
	return DemoConfig{
		Allocators:  3,
		Regions:     []string{"eu", "us"},
		Window:      6 * time.Second,
		Windows:     5,
		MaxInFlight: 256,
		CallTimeout: 5 * time.Second,
	}
}

// Validate says what is wrong with c, naming every bad field, or returns nil.
func (c DemoConfig) Validate() error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if c.Allocators < 1 || c.Allocators > 9 {
		bad("Allocators must be in [1, 9], got %d", c.Allocators)
	}
	if len(c.Regions) == 0 {
		bad("Regions: at least one region is required")
	}
	for i, r := range c.Regions {
		if j := slices.Index(c.Regions, r); j < i {
			bad("Regions: %q appears twice", r)
		}
	}
	for name, rates := range map[string]map[string]float64{"Atlas": c.Atlas, "Birch": c.Birch} {
		for r, rate := range rates {
			if !slices.Contains(c.Regions, r) {
				bad("%s: region %q is not one of Regions %v", name, r, c.Regions)
			}
			if !(rate >= 0 && rate <= 100_000) {
				bad("%s: region %q: rate %v is not in [0, 100000] per second", name, r, rate)
			}
		}
	}
	if c.Window < 0 || (c.Window > 0 && c.Window < 100*time.Millisecond) {
		bad("Window must be 0 or at least 100ms, got %s", c.Window)
	}
	if c.Windows < 0 {
		bad("Windows must not be negative, got %d", c.Windows)
	}
	if c.WANLatency < 0 || c.WANLatency > 5*time.Second {
		bad("WANLatency must be in [0, 5s], got %s", c.WANLatency)
	}
	switch c.Store {
	case StoreAuto, StoreRedis, StoreEmbedded:
	default:
		bad("Store must be %q, %q or %q, got %q", StoreAuto, StoreRedis, StoreEmbedded, c.Store)
	}
	if c.MaxInFlight < 1 {
		bad("MaxInFlight must be at least 1, got %d", c.MaxInFlight)
	}
	if c.CallTimeout <= 0 {
		bad("CallTimeout must be positive, got %s", c.CallTimeout)
	}
	if c.Root == "" && c.BinDir == "" {
		bad("Root (the module root to build from) or BinDir is required")
	}
	if len(errs) > 0 {
		return fmt.Errorf("demo config: %w", errors.Join(errs...))
	}
	return nil
}

// defaultRates spreads total requests per second over regions: first to
// the first region and the rest evenly over the others (all of it to a
// lone region).
func defaultRates(regions []string, total, first float64) map[string]float64 {
	out := map[string]float64{}
	if len(regions) == 1 {
		out[regions[0]] = total
		return out
	}
	out[regions[0]] = total * first
	for _, r := range regions[1:] {
		out[r] = total * (1 - first) / float64(len(regions)-1)
	}
	return out
}

// Demo is a running local topology: the allocator cluster, the regions
// (store and agent each) and the fault proxies of the WAN links. StartDemo
// makes it, Run drives the load and prints the tables, Close stops
// everything and removes what it made. RunDemo does all three.
type Demo struct {
	cfg DemoConfig
	out io.Writer

	// Dir holds the binaries (bin), the logs (logs) and the data.
	Dir       string
	removeDir bool
	bins      map[string]string
	embedded  bool
	logs      []*os.File

	hc       *http.Client            // the load's, to the agents
	rules    map[string]*policy.Rule // AtlasQuota and BirchQuota as published
	version  uint64
	bound    *allotv1.QuotaBound
	allocs   *Allocators
	client   *allocator.Client
	op       *allocator.OperatorClient
	regions  []*Region
	clients  map[string]allotv1connect.AdmissionServiceClient
	stopWAN  context.CancelFunc
	wan      sync.WaitGroup
	closeMu  sync.Mutex
	closed   bool
	closeErr error
}

// RunDemo starts the topology (StartDemo), drives it for cfg.Windows
// windows or until ctx ends (Run), and stops every process and removes
// every file it made (Close). It writes its progress and one table per
// window to out.
func RunDemo(ctx context.Context, cfg DemoConfig, out io.Writer) error {
	d, err := StartDemo(ctx, cfg, out)
	if err != nil {
		return err
	}
	err = d.Run(ctx)
	return errors.Join(err, d.Close())
}

// StartDemo builds the binaries, starts the allocator cluster, publishes the
// policy (the tenant windows rescaled, the regions replaced), starts every
// region (Redis, or none with the embedded store, and agent; behind a fault
// proxy per allocator link when cfg.WANLatency is set) and waits until
// every agent has the policy. On error it stops what it started.
func StartDemo(ctx context.Context, cfg DemoConfig, out io.Writer) (*Demo, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if cfg.Atlas == nil {
		cfg.Atlas = defaultRates(cfg.Regions, 500, 0.9)
	}
	if cfg.Birch == nil {
		cfg.Birch = defaultRates(cfg.Regions, 300, 1/float64(len(cfg.Regions)))
	}
	doc, rules, err := demoPolicy(cfg)
	if err != nil {
		return nil, err
	}
	d := &Demo{cfg: cfg, out: out, rules: rules, hc: allocator.NewHTTPClient(), clients: map[string]allotv1connect.AdmissionServiceClient{}}
	if err := d.start(ctx, doc); err != nil {
		return nil, errors.Join(err, d.Close())
	}
	return d, nil
}

// start does StartDemo's work; the caller closes d when it fails.
func (d *Demo) start(ctx context.Context, doc []byte) error {
	cfg, out := d.cfg, d.out
	if err := d.makeDir(); err != nil {
		return err
	}
	if err := d.pickStore(); err != nil {
		return err
	}
	var err error
	if d.bins, err = d.binaries(ctx); err != nil {
		return err
	}
	alog, alogPath, err := d.logFile("allocators.log")
	if err != nil {
		return err
	}
	startCtx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	d.allocs, err = StartAllocators(startCtx, AllocatorConfig{
		Nodes: cfg.Allocators, Bin: d.bins["./cmd/allocator"], Dir: filepath.Join(d.Dir, "allocators"), Output: alog,
	})
	if err != nil {
		return fmt.Errorf("allocators: %w", err)
	}
	eps := d.allocs.Endpoints()
	nodes := "nodes"
	if len(eps) == 1 {
		nodes = "node"
	}
	fmt.Fprintf(out, "allocator cluster up: %d %s at %s (log: %s)\n", len(eps), nodes, strings.Join(eps, ", "), alogPath)
	if d.client, err = allocator.NewClient(eps); err != nil {
		return err
	}
	d.op = d.client.Operator()
	if err := d.publish(startCtx, doc); err != nil {
		return err
	}

	wanCtx, stopWAN := context.WithCancel(context.Background())
	d.stopWAN = stopWAN
	for i, name := range cfg.Regions {
		// The agents lease over the allocators' gRPC listeners, the
		// cheaper transport, and watch the policy over the Connect API.
		endpoints, grpcEps := eps, d.allocs.GRPCEndpoints()
		if cfg.WANLatency > 0 {
			if endpoints, err = d.startWAN(wanCtx, i, 0, eps); err != nil {
				return err
			}
			if grpcEps, err = d.startWAN(wanCtx, i, len(eps), grpcEps); err != nil {
				return err
			}
		}
		rlog, rlogPath, err := d.logFile(name + ".log")
		if err != nil {
			return err
		}
		r, err := StartRegion(startCtx, RegionConfig{
			Name: name, AgentBin: d.bins["./cmd/regionagent"], Dir: filepath.Join(d.Dir, "regions", name),
			EmbeddedStore: d.embedded, AllocatorEndpoints: endpoints, Output: rlog,
			AgentArgs: []string{"-allocators-grpc", strings.Join(grpcEps, ",")},
		})
		if err != nil {
			return err
		}
		d.regions = append(d.regions, r)
		d.clients[name] = allotv1connect.NewAdmissionServiceClient(d.hc, "http://"+r.APIAddr)
		store := "redis " + r.RedisAddr
		if d.embedded {
			store = "embedded store"
		}
		wan := ""
		if cfg.WANLatency > 0 {
			wan = fmt.Sprintf(", +%s each way to the allocators", cfg.WANLatency)
		}
		fmt.Fprintf(out, "region %s: agent %s, %s%s (log: %s)\n", name, r.APIAddr, store, wan, rlogPath)
	}
	for _, r := range d.regions {
		if err := r.WaitReady(startCtx); err != nil {
			return fmt.Errorf("region %s: no policy in force: %w", r.Name, err)
		}
	}
	return nil
}

// demoPolicy parses the policy, rescales the tenant quotas' windows and
// replaces its regions, and returns the canonical document and the two
// rules as they will be published.
func demoPolicy(cfg DemoConfig) ([]byte, map[string]*policy.Rule, error) {
	src := cfg.Policy
	if src == nil {
		src = examples.Northstar
	}
	parsed, err := policy.Parse(src)
	if err != nil {
		return nil, nil, fmt.Errorf("policy: %w", err)
	}
	rules := map[string]*policy.Rule{}
	for _, name := range []string{AtlasQuota, BirchQuota} {
		r := parsed.Rule(name)
		if r == nil || r.Kind != policy.KindGlobalQuota || r.Lease == nil {
			return nil, nil, fmt.Errorf("policy has no global quota %q (the demo drives %s and %s)", name, AtlasQuota, BirchQuota)
		}
		if cfg.Window > 0 {
			r.Window = cfg.Window
			r.Lease.TTL = cfg.Window / 4
		}
		rules[name] = r
	}
	parsed.Regions = slices.Clone(cfg.Regions)
	canonical, err := policy.Canonical(parsed)
	if err != nil {
		return nil, nil, fmt.Errorf("policy: %w", err)
	}
	if _, err := policy.Parse(canonical); err != nil {
		return nil, nil, fmt.Errorf("rescaled policy: %w", err)
	}
	return canonical, rules, nil
}

// demoCommands are the packages of the binaries the demo runs.
var demoCommands = []string{"./cmd/allocator", "./cmd/regionagent", "./cmd/allotctl"}

// binaries builds the demo's binaries into Dir/bin, or finds them in
// cfg.BinDir, and returns their paths by package.
func (d *Demo) binaries(ctx context.Context) (map[string]string, error) {
	if d.cfg.BinDir == "" {
		fmt.Fprintf(d.out, "building binaries into %s ...\n", filepath.Join(d.Dir, "bin"))
		return Build(ctx, d.cfg.Root, filepath.Join(d.Dir, "bin"), demoCommands...)
	}
	bins := map[string]string{}
	for _, pkg := range demoCommands {
		p := filepath.Join(d.cfg.BinDir, filepath.Base(pkg))
		if _, err := os.Stat(p); err != nil {
			return nil, fmt.Errorf("binary of %s: %w", pkg, err)
		}
		bins[pkg] = p
	}
	return bins, nil
}

// makeDir makes (or checks) the demo's directory.
func (d *Demo) makeDir() error {
	if d.cfg.Dir == "" {
		dir, err := os.MkdirTemp("", "allot-multiregion-")
		if err != nil {
			return err
		}
		d.Dir, d.removeDir = dir, !d.cfg.KeepDir
		return nil
	}
	d.Dir = d.cfg.Dir
	for _, sub := range []string{"allocators", "regions"} {
		if _, err := os.Stat(filepath.Join(d.Dir, sub)); err == nil {
			return fmt.Errorf("data dir %s holds a previous run (%s/): remove it or pick another -data-dir", d.Dir, sub)
		}
	}
	return os.MkdirAll(d.Dir, 0o755)
}

// pickStore resolves StoreAuto and says which store the regions use.
func (d *Demo) pickStore() error {
	switch d.cfg.Store {
	case StoreEmbedded:
		d.embedded = true
		fmt.Fprintln(d.out, "store: each region's agent decides on its embedded in-process store (no Redis)")
	case StoreRedis:
		if _, err := exec.LookPath("redis-server"); err != nil {
			return fmt.Errorf("store redis: redis-server not found: %w", err)
		}
	default:
		if _, err := exec.LookPath("redis-server"); err != nil {
			d.embedded = true
			fmt.Fprintln(d.out, "store: redis-server is not installed, so each region's agent decides on its embedded in-process store instead (regionagent -store embedded)")
		}
	}
	return nil
}

// logFile creates Dir/logs/name (Close closes it) and returns the writer
// of the processes' output (the file, and cfg.Output if set) and its path.
func (d *Demo) logFile(name string) (io.Writer, string, error) {
	if err := os.MkdirAll(filepath.Join(d.Dir, "logs"), 0o755); err != nil {
		return nil, "", err
	}
	f, err := os.Create(filepath.Join(d.Dir, "logs", name))
	if err != nil {
		return nil, "", err
	}
	d.logs = append(d.logs, f)
	if d.cfg.Output != nil {
		return io.MultiWriter(f, d.cfg.Output), f.Name(), nil
	}
	return f, f.Name(), nil
}

// publish publishes the policy and reads the stated bound of AtlasQuota.
func (d *Demo) publish(ctx context.Context, doc []byte) error {
	atlas := d.rules[AtlasQuota]
	pub, err := d.op.PublishPolicy(ctx, &allotv1.PublishPolicyRequest{
		Document: doc, ExpectedVersion: 1, Author: "multiregion",
		Reason: fmt.Sprintf("local demo: tenant windows %s, regions %s", atlas.Window, strings.Join(d.cfg.Regions, ",")),
	})
	if err != nil {
		return fmt.Errorf("publish policy: %w", err)
	}
	d.version = pub.GetPolicy().GetVersion()
	bnd, err := d.op.GetBound(ctx, &allotv1.GetBoundRequest{Quota: AtlasQuota})
	if err != nil {
		return fmt.Errorf("bound of %s: %w", AtlasQuota, err)
	}
	if len(bnd.GetBounds()) != 1 {
		return fmt.Errorf("bound of %s: %d bounds in the answer, want 1", AtlasQuota, len(bnd.GetBounds()))
	}
	d.bound = bnd.GetBounds()[0]
	birch := d.rules[BirchQuota]
	fmt.Fprintf(d.out, "policy v%d published; %s: G=%d per %s, chunk %d, TTL %s, stated bound +%d (admitted per window <= %d); %s: G=%d per %s\n",
		d.version, AtlasQuota, atlas.Limit, atlas.Window, atlas.Lease.Chunk, atlas.Lease.TTL, d.bound.GetOvershoot(),
		d.bound.GetMaxAdmittedPerWindow(), BirchQuota, birch.Limit, birch.Window)
	return nil
}

// startWAN starts one fault proxy per allocator endpoint for region i, each
// adding cfg.WANLatency in both directions, and returns their addresses;
// seed0 keeps the seeds of one region's several sets of proxies apart.
func (d *Demo) startWAN(ctx context.Context, i, seed0 int, eps []string) ([]string, error) {
	var addrs []string
	for j, target := range eps {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("wan proxy: %w", err)
		}
		dialer := &net.Dialer{Timeout: 2 * time.Second}
		p := faultproxy.New(ln, func(ctx context.Context) (net.Conn, error) {
			return dialer.DialContext(ctx, "tcp", target)
		}, faultproxy.Config{DelayMin: d.cfg.WANLatency, DelayMax: d.cfg.WANLatency}, uint64(i*100+seed0+j+1))
		d.wan.Add(1)
		go func() {
			defer d.wan.Done()
			_ = p.Run(ctx) // it only fails when the listener does; the agent then reports the link down
		}()
		addrs = append(addrs, p.Addr().String())
	}
	return addrs, nil
}

// Processes returns every child process the demo started: allocators,
// Redis servers and agents.
func (d *Demo) Processes() []*Process {
	var ps []*Process
	if d.allocs != nil {
		for _, n := range d.allocs.Nodes {
			if n.Proc != nil {
				ps = append(ps, n.Proc)
			}
		}
	}
	for _, r := range d.regions {
		for _, p := range []*Process{r.Redis, r.Agent} {
			if p != nil {
				ps = append(ps, p)
			}
		}
	}
	return ps
}

// Embedded reports whether the regions decide on the agents' embedded
// store (no Redis).
func (d *Demo) Embedded() bool { return d.embedded }

// Close stops the agents (they hand their unspent tokens back through the
// WAN proxies), the proxies, the allocators, closes the log files and
// removes the temporary directory unless it is kept. It is safe to call more
// than once; later calls return the first call's result.
func (d *Demo) Close() error {
	d.closeMu.Lock()
	defer d.closeMu.Unlock()
	if d.closed {
		return d.closeErr
	}
	d.closed = true
	d.hc.CloseIdleConnections()
	var errs []error
	for _, r := range d.regions {
		if err := r.Close(10 * time.Second); err != nil {
			errs = append(errs, fmt.Errorf("region %s: %w", r.Name, err))
		}
	}
	if d.stopWAN != nil {
		d.stopWAN()
		d.wan.Wait()
	}
	if d.allocs != nil {
		if err := d.allocs.Close(10 * time.Second); err != nil {
			errs = append(errs, fmt.Errorf("allocators: %w", err))
		}
	}
	for _, f := range d.logs {
		if err := f.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	switch {
	case d.Dir == "":
	case d.removeDir:
		if err := os.RemoveAll(d.Dir); err != nil {
			errs = append(errs, fmt.Errorf("remove %s: %w", d.Dir, err))
		}
	default:
		fmt.Fprintf(d.out, "kept %s (binaries, data and logs)\n", d.Dir)
	}
	d.closeErr = errors.Join(errs...)
	return d.closeErr
}

// ratesString formats rates per region in region order, e.g. "eu 450/s,
// us 50/s".
func ratesString(regions []string, rates map[string]float64) string {
	parts := make([]string, 0, len(regions))
	for _, r := range regions {
		parts = append(parts, fmt.Sprintf("%s %s/s", r, formatRate(rates[r])))
	}
	return strings.Join(parts, ", ")
}

// formatRate prints a rate to a tenth, without a needless fraction.
func formatRate(v float64) string {
	return strconv.FormatFloat(math.Round(v*10)/10, 'f', -1, 64)
}
