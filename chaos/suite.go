package chaos

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/allot-dev/allot/chaos/check"
	"github.com/allot-dev/allot/chaos/history"
	"github.com/allot-dev/allot/chaos/wan"
	"github.com/allot-dev/allot/internal/pausewatch"
	"github.com/allot-dev/allot/pkg/allocator"
	"github.com/allot-dev/allot/pkg/faultproxy"
	"github.com/allot-dev/allot/pkg/lease"
	"github.com/allot-dev/allot/pkg/topology"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// Names and addresses the suite gives the lab. Everything it creates starts
// with LabPrefix so a later run can sweep the leftovers of a crashed one.
const (
	// LabPrefix starts every namespace, link and lock of a chaos run.
	LabPrefix = "allotc-"
	// LabSubnet is the lab's /24 (the root namespace is .1).
	LabSubnet = "10.77.0"
	// proxyMark marks the WAN proxies' own upstream sockets so the DNAT
	// that steers regions into the proxies does not loop them back.
	proxyMark = 0x77
	// proxyBasePort is the first port of a region's WAN proxies.
	proxyBasePort = 9001
)

// QuotaPlan is one leased quota of a run and the load regions offer for it.
type QuotaPlan struct {
	// Name of the quota (and its tenant).
	Name string
	// Limit is G per window; Chunk the policy's chunk.
	Limit, Chunk int64
	// Clamp ends leases at the window end.
	Clamp bool
	// MaxHeldPerRegion is the policy's lease.max_held_per_region (0: no
	// cap); the pool model of the linearizability check is told it.
	MaxHeldPerRegion int64
	// FallbackPerRegion, when positive, makes the quota fail_mode fallback
	// with this lease.fallback_per_region: a region cut off from the
	// allocators gets this many tokens per window deposited into its store
	// by its agent (and its agent's engine admits as many in process per
	// window while the store fails). 0: fail_mode closed.
	FallbackPerRegion int64
	// Birch marks the well-behaved tenant: no denials outside fault windows.
	Birch bool
	// Demand is the offered requests per second per region; Flood, when
	// set for a region, alternates with Demand by window.
	Demand, Flood map[string]float64
	// Independent and WallDeadline are broken region modes (checker tests).
	Independent  map[string]int64
	WallDeadline map[string]bool
	// ClaimBound, when set, is the bound the checkers hold the quota to
	// instead of the one GetBound states (the checker's own tests claim 0
	// for a quota run with clamp off).
	ClaimBound *int64
	// ClaimFallback, when set, is the per-region fallback allowance the
	// checkers hold the quota to instead of FallbackPerRegion (a claim
	// under test: a smaller one must make them object).
	ClaimFallback *int64
}

// Config configures a chaos run.
type Config struct {
	// Seed seeds every random choice of the run (printed; replay with
	// -chaos.seed).
	Seed int64
	// Window is every quota's window; TTL every lease's TTL.
	Window, TTL time.Duration
	// Regions are the region names.
	Regions []string
	// Quotas are the leased quotas.
	Quotas []QuotaPlan
	// WAN is the fault set of every region-to-allocator link.
	WAN faultproxy.Config
	// Allocators is the cluster size; one more host is kept for membership
	// changes.
	Allocators int
	// OutDir receives the processes' logs (OutDir/logs) and the report.
	OutDir string
	// Logf prints progress (t.Logf in tests).
	Logf func(format string, args ...any)
	// RegionKind chooses the regions: RegionAgent (the default: redis-server,
	// regionagent and a load generator per region) or RegionDriver (the
	// chaosregion driver, which also has the broken modes the checkers'
	// own test needs).
	RegionKind string
	// NewRegion, when set, makes every region instead (RegionKind is then
	// only reported).
	NewRegion func(name string) Region
	// PauseProfiles keeps CPU profiles of the test process around each of
	// its pauses in OutDir/logs (profilePauses). Off by default: profiling
	// costs the process a little CPU, and the suite's checks are timing
	// sensitive.
	PauseProfiles bool
}

// The region kinds of Config.RegionKind.
const (
	// RegionAgent runs each region as the real thing: redis-server and
	// regionagent in the region's namespace, with a load generator there
	// sending requests to the agent's Check API (AgentRegion).
	RegionAgent = "agent"
	// RegionDriver runs each region as the chaosregion driver, which leases
	// and spends in one process (DriverRegion).
	RegionDriver = "driver"
)

// DefaultConfig is the short schedule's topology: 3 allocators, regions
// eu, us and ap (each a region agent with its Redis and a load generator)
// reaching them over a 40-60 ms (each way) WAN with 0.5% loss; leases of
// 1.5 s in 3 s windows; Atlas floods a 1,000-per-3s quota (clamp on) from
// every region (430/s offered against 333/s), Birch sends well under its
// 20,000-per-3s quota (clamp on too: the agent's starve wait covers the gap
// at a window's turn, see docs/chaos.md), and Cedar, fail_mode fallback with
// 15 tokens per region per window (GetBound states +90: the fallback and
// store_fallback terms, 3 x 15 each), floods a 200-per-3s quota (130/s
// offered against 67/s, above G + bound = 290 per window): a scenario
// that cuts a region off from the allocators makes its agent deposit the
// allowance, which the checks count as such (docs/chaos.md).
func DefaultConfig(seed int64) Config {
	return Config{
		Seed: seed, Window: 3 * time.Second, TTL: 1500 * time.Millisecond,
		Regions:    []string{"ap", "eu", "us"},
		Allocators: 3,
		RegionKind: RegionAgent,
		WAN:        faultproxy.Config{DelayMin: 40 * time.Millisecond, DelayMax: 60 * time.Millisecond, Loss: 0.005, LossPenalty: 200 * time.Millisecond},
		Quotas: []QuotaPlan{
			{Name: "atlas", Limit: 1000, Chunk: 100, Clamp: true, Demand: map[string]float64{"eu": 250, "us": 120, "ap": 60}},
			{Name: "birch", Limit: 20000, Chunk: 200, Clamp: true, Birch: true, Demand: map[string]float64{"eu": 40, "us": 30, "ap": 20}},
			{Name: "cedar", Limit: 200, Chunk: 25, Clamp: true, FallbackPerRegion: 15, Demand: map[string]float64{"eu": 65, "us": 40, "ap": 25}},
		},
	}
}

// Suite is a running chaos topology: a lab of namespaces, the allocator
// cluster, WAN proxies, regions, and an observer reading ledgers.
type Suite struct {
	cfg   Config
	clock history.TrueClock
	rec   *history.Recorder
	dir   string
	bins  map[string]string
	logw  *os.File

	lab         *topology.Lab
	allocHosts  []*topology.Host
	regionHosts map[string]*topology.Host
	allocs      *topology.Allocators
	client      *allocator.Client
	regions     []Region
	wans        []*wanProc // each region's WAN proxies
	ctl         *control
	obs         *observer
	quotas      []check.Quota
	stated      map[string]*allotv1.QuotaBound
	start       int64

	bgCancel context.CancelFunc
	bg       sync.WaitGroup
	mu       sync.Mutex
	closed   bool
	cuts     map[string][][]string // iptables rules of partitions in force, by namespace/tag
	pauses   []pausewatch.Pause    // of this process (notePause); guarded by mu
}

func (s *Suite) logf(format string, args ...any) {
	if s.cfg.Logf != nil {
		s.cfg.Logf(format, args...)
	}
}

// Start builds the binaries and brings the topology up. Close tears it
// down (also after a failed Start).
func Start(ctx context.Context, cfg Config) (s *Suite, err error) {
	if cfg.Allocators < 1 {
		cfg.Allocators = 3
	}
	switch cfg.RegionKind {
	case "":
		cfg.RegionKind = RegionAgent
	case RegionAgent, RegionDriver:
	default:
		return nil, fmt.Errorf("chaos: region kind %q: want %s or %s", cfg.RegionKind, RegionAgent, RegionDriver)
	}
	s = &Suite{cfg: cfg, clock: history.NewTrueClock(), rec: &history.Recorder{}, regionHosts: map[string]*topology.Host{}, stated: map[string]*allotv1.QuotaBound{}, cuts: map[string][][]string{}}
	defer func() {
		if err != nil {
			err = errors.Join(err, s.Close())
		}
	}()
	if s.dir, err = os.MkdirTemp("", LabPrefix+"run-"); err != nil {
		return s, err
	}
	logDir := filepath.Join(cfg.OutDir, "logs")
	if err = os.MkdirAll(logDir, 0o755); err != nil {
		return s, err
	}
	if s.logw, err = os.Create(filepath.Join(logDir, "processes.log")); err != nil {
		return s, err
	}
	wd, err := os.Getwd()
	if err != nil {
		return s, err
	}
	root, err := topology.ModuleRoot(wd)
	if err != nil {
		return s, err
	}
	pkgs := []string{"./cmd/allocator", "./chaos/cmd/chaosregion"}
	if cfg.RegionKind == RegionAgent {
		pkgs = append(pkgs, "./cmd/regionagent")
	}
	s.logf("building %s ...", strings.Join(pkgs, ", "))
	if s.bins, err = topology.Build(ctx, root, filepath.Join(s.dir, "bin"), pkgs...); err != nil {
		return s, err
	}
	if s.lab, err = topology.NewLab(ctx, topology.LabConfig{Prefix: LabPrefix, Subnet: LabSubnet}); err != nil {
		return s, err
	}
	for i := 0; i <= cfg.Allocators; i++ { // one spare host for membership changes
		h, err := s.lab.AddHost(ctx, fmt.Sprintf("a%d", i+1), 11+i)
		if err != nil {
			return s, err
		}
		s.allocHosts = append(s.allocHosts, h)
	}
	for i, r := range cfg.Regions {
		h, err := s.lab.AddHost(ctx, r, 21+i)
		if err != nil {
			return s, err
		}
		s.regionHosts[r] = h
	}
	s.logf("lab up: bridge %s, allocators %s, regions %v (%s)", s.lab.Bridge(), hostIPs(s.allocHosts), cfg.Regions, cfg.RegionKind)

	startCtx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	s.allocs, err = topology.StartAllocatorsIn(startCtx, topology.AllocatorConfig{
		Bin: s.bins["./cmd/allocator"], Dir: filepath.Join(s.dir, "data"), Output: s.logw,
		ExtraArgs: allocatorArgs(),
	}, s.allocHosts[:cfg.Allocators])
	if err != nil {
		return s, err
	}
	var eps, grpcEps []string
	for _, h := range s.allocHosts {
		eps = append(eps, apiAddr(h))
		grpcEps = append(grpcEps, grpcAddr(h))
	}
	if s.client, err = allocator.NewClient(eps, allocator.WithAttempts(8), allocator.WithBackoff(50*time.Millisecond)); err != nil {
		return s, err
	}
	if err = s.publish(startCtx); err != nil {
		return s, err
	}

	bgCtx, bgCancel := context.WithCancel(context.Background())
	s.bgCancel = bgCancel
	s.bg.Add(1)
	go func() { defer s.bg.Done(); _ = pausewatch.Run(bgCtx, pausewatch.Config{OnPause: s.notePause}) }()
	if cfg.PauseProfiles {
		s.bg.Add(1)
		go func() { defer s.bg.Done(); s.profilePauses(bgCtx, logDir, pauseProfileSegment) }()
	}
	if s.ctl, err = newControl(filepath.Join(s.dir, "ctl.sock"), s.rec.Record); err != nil {
		return s, err
	}
	if err = s.startProxies(startCtx); err != nil {
		return s, err
	}
	s.obs = &observer{client: s.client, clock: s.clock, record: s.rec.Record, quotas: s.quotas}
	s.bg.Add(1)
	go func() { defer s.bg.Done(); s.obs.Run(bgCtx) }()

	s.start = s.clock.Now()
	newRegion := cfg.NewRegion
	switch {
	case newRegion != nil:
	case cfg.RegionKind == RegionAgent:
		newRegion = func(name string) Region {
			return newAgentRegion(name, s.bins["./cmd/regionagent"], s.bins["./chaos/cmd/chaosregion"], s.ctl)
		}
	default:
		newRegion = func(name string) Region { return newDriverRegion(name, s.bins["./chaos/cmd/chaosregion"], s.ctl) }
	}
	for i, name := range cfg.Regions {
		r := newRegion(name)
		s.regions = append(s.regions, r)
		env := RegionEnv{
			Host: s.regionHosts[name], Allocators: eps, AllocatorsGRPC: grpcEps, Clock: s.clock, Record: s.rec.Record,
			Margin: allocator.DefaultConfig().LeaseMargin, Dir: s.dir, Log: s.logw, LogDir: logDir, Seed: uint64(cfg.Seed)*31 + uint64(i),
		}
		for _, q := range cfg.Quotas {
			env.Quotas = append(env.Quotas, QuotaLoad{
				Quota: q.Name, Window: cfg.Window, Chunk: q.Chunk, TTL: cfg.TTL, Clamp: q.Clamp,
				Rate: q.Demand[name], FloodRate: q.Flood[name], Independent: q.Independent[name], WallDeadline: q.WallDeadline[name],
			})
		}
		if err = r.Start(startCtx, env); err != nil {
			return s, err
		}
	}
	s.logf("regions up; true clock offset %d ns", s.clock.Offset)
	return s, nil
}

// allocatorArgs are the flags every allocator of the lab runs with: quiet
// logs, and snapshots often enough that restarts restore from one.
func allocatorArgs() []string {
	return []string{"-log-level", "warn", "-snapshot-threshold", "256"}
}

func apiAddr(h *topology.Host) string { return fmt.Sprintf("%s:%d", h.IP, topology.LabAPIPort) }

func grpcAddr(h *topology.Host) string { return fmt.Sprintf("%s:%d", h.IP, topology.LabGRPCPort) }

func hostIPs(hs []*topology.Host) string {
	var ips []string
	for _, h := range hs {
		ips = append(ips, h.IP)
	}
	return strings.Join(ips, ",")
}

// policyDoc is the run's policy: one global quota per plan, fail_mode
// closed, or fallback for a plan with a fallback allowance.
func (s *Suite) policyDoc() []byte {
	var b strings.Builder
	regions := append([]string(nil), s.cfg.Regions...)
	sort.Strings(regions)
	fmt.Fprintf(&b, "name: chaos\ndescription: chaos suite quotas\nregions: [%s]\nrules:\n", strings.Join(regions, ", "))
	for _, q := range s.cfg.Quotas {
		fmt.Fprintf(&b, `  - name: %s
    description: "chaos quota %s"
    scope: tenant
    match:
      - {key: tenant, value: %s}
    kind: global_quota
    limit: %d
    window: %s
    lease:
      chunk: %d
      ttl: %s
      clamp: %t
      strategy: demand
`, q.Name, q.Name, q.Name, q.Limit, s.cfg.Window, q.Chunk, s.cfg.TTL, q.Clamp)
		if q.MaxHeldPerRegion > 0 {
			fmt.Fprintf(&b, "      max_held_per_region: %d\n", q.MaxHeldPerRegion)
		}
		if q.FallbackPerRegion > 0 {
			fmt.Fprintf(&b, "      fallback_per_region: %d\n", q.FallbackPerRegion)
			b.WriteString("    fail_mode: fallback\n")
			continue
		}
		b.WriteString("    fail_mode: closed\n")
	}
	return []byte(b.String())
}

// publish publishes the policy and reads the bound GetBound states for
// every quota.
func (s *Suite) publish(ctx context.Context) error {
	op := s.client.Operator()
	if _, err := op.PublishPolicy(ctx, &allotv1.PublishPolicyRequest{Document: s.policyDoc(), ExpectedVersion: 1, Author: "chaos", Reason: fmt.Sprintf("chaos run, seed %d", s.cfg.Seed)}); err != nil {
		return fmt.Errorf("publish: %w", err)
	}
	bnd, err := op.GetBound(ctx, &allotv1.GetBoundRequest{})
	if err != nil {
		return fmt.Errorf("bound: %w", err)
	}
	for _, b := range bnd.GetBounds() {
		s.stated[b.GetQuota()] = b
	}
	for _, q := range s.cfg.Quotas {
		b := s.stated[q.Name]
		if b == nil {
			return fmt.Errorf("GetBound states nothing for %s", q.Name)
		}
		cq := check.Quota{Name: q.Name, Limit: q.Limit, WindowMs: s.cfg.Window.Milliseconds(), Bound: b.GetOvershoot(), Birch: q.Birch, MaxHeldPerRegion: q.MaxHeldPerRegion,
			FallbackPerRegion: q.FallbackPerRegion}
		if q.ClaimBound != nil {
			cq.Bound = *q.ClaimBound
		}
		if q.ClaimFallback != nil {
			cq.FallbackPerRegion = *q.ClaimFallback
		}
		// The checkers let each region admit its allowance per window on
		// top of its grants: the stated bound must count it, the fallback
		// term, for every region.
		if want := int64(len(s.cfg.Regions)) * q.FallbackPerRegion; boundTerm(b, "fallback") != want {
			return fmt.Errorf("GetBound states a fallback term of %d for %s, want %d regions x fallback_per_region %d = %d (%s)",
				boundTerm(b, "fallback"), q.Name, len(s.cfg.Regions), q.FallbackPerRegion, want, boundTerms(b))
		}
		s.quotas = append(s.quotas, cq)
		s.logf("quota %s: G=%d per %s, TTL %s, clamp %t, fallback %d per region; GetBound states +%d (%s); checked against +%d, fallback %d per region",
			q.Name, q.Limit, s.cfg.Window, s.cfg.TTL, q.Clamp, q.FallbackPerRegion, b.GetOvershoot(), boundTerms(b), cq.Bound, cq.FallbackPerRegion)
	}
	return nil
}

// startProxies puts a fault proxy on every region-to-allocator link, one
// for the Connect API port and one for the gRPC port. A region's proxies
// run in a process of their own (chaosregion -mode wan, package chaos/wan)
// inside the region's namespace, so that a stall of this process does not
// stall the network: they listen there, dial the allocators from there (so
// the region's iptables rules cut them), and a DNAT rule in the region
// steers the region's own connections to each allocator port through its
// proxy.
func (s *Suite) startProxies(ctx context.Context) error {
	for i, name := range s.cfg.Regions {
		rh := s.regionHosts[name]
		cfg := wan.Config{Region: name, Mark: proxyMark, WAN: s.cfg.WAN, StatsPath: filepath.Join(s.dir, name+"-wan-stats.json")}
		type rule struct{ dst, port, listen string }
		var rules []rule
		for j, ah := range s.allocHosts {
			for k, port := range []int{topology.LabAPIPort, topology.LabGRPCPort} {
				listen := fmt.Sprintf("%s:%d", rh.IP, proxyBasePort+100*k+j)
				cfg.Links = append(cfg.Links, wan.Link{Listen: listen, Target: fmt.Sprintf("%s:%d", ah.IP, port),
					Seed: uint64(s.cfg.Seed)*1000 + uint64(500*k+i*10+j), GRPC: port == topology.LabGRPCPort})
				rules = append(rules, rule{dst: ah.IP, port: strconv.Itoa(port), listen: listen})
			}
		}
		proc, conn, err := s.ctl.start(ctx, rh, "chaoswan-"+name, s.bins["./chaos/cmd/chaosregion"], []string{"-mode", "wan"},
			filepath.Join(s.dir, name+"-wan.json"), cfg, name+wan.HelloSuffix, "region "+name+": WAN proxies", s.logw)
		if proc != nil {
			s.wans = append(s.wans, &wanProc{region: name, proc: proc, conn: conn, stats: cfg.StatsPath})
		}
		if err != nil {
			return err
		}
		// The proxies listen before their hello: the rules steer
		// connections to open ports only.
		for _, r := range rules {
			if err := rh.IPTables(ctx, "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-d", r.dst, "--dport", r.port,
				"-m", "mark", "!", "--mark", fmt.Sprintf("0x%x", proxyMark), "-j", "DNAT", "--to-destination", r.listen); err != nil {
				return err
			}
		}
	}
	return nil
}

// wanProc is a region's WAN process.
type wanProc struct {
	region  string
	proc    *topology.Process
	conn    *driverConn
	stats   string // its stats file
	stopped bool   // stopProxies has stopped it (or found it gone)
}

// stopProxies stops the WAN processes (after the regions: their last
// releases cross the WAN). It is safe to call more than once.
func (s *Suite) stopProxies(ctx context.Context) error {
	var errs []error
	for _, w := range s.wans {
		if w.stopped {
			continue
		}
		w.stopped = true
		if w.proc.Exited() {
			// It carried the region's every call to the allocators: a
			// run it left early is not the run the history says.
			errs = append(errs, fmt.Errorf("region %s: the WAN proxies exited during the run: %s", w.region, w.proc.Output()))
			continue
		}
		if w.conn == nil { // it never said hello: nothing to hand over
			w.proc.Kill()
		} else if err := w.conn.call(ctx, history.Command{Op: history.OpStop}); err != nil {
			errs = append(errs, fmt.Errorf("region %s: stop the WAN proxies: %w", w.region, err))
		}
		select {
		case <-w.proc.Done():
		case <-ctx.Done():
			w.proc.Kill()
			errs = append(errs, fmt.Errorf("region %s: WAN proxies killed after %w", w.region, ctx.Err()))
		}
		if w.conn != nil {
			w.conn.wait(time.Second)
		}
	}
	return errors.Join(errs...)
}

// GRPCChunks is how many chunks the WAN proxies carried between regions
// and the allocators' gRPC listeners (agents lease there), by the stats
// their processes last wrote (each second, and when they stop).
func (s *Suite) GRPCChunks() int64 {
	var n int64
	for _, w := range s.wans {
		if st, err := wan.ReadStats(w.stats); err == nil {
			n += st.GRPCChunks
		}
	}
	return n
}

// Close stops every process and removes everything the suite made. It is
// safe to call more than once.
func (s *Suite) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	s.mu.Unlock()
	var errs []error
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, r := range s.regions {
		if err := r.Stop(ctx); err != nil {
			errs = append(errs, err)
		}
	}
	if err := s.stopProxies(ctx); err != nil {
		errs = append(errs, err)
	}
	if s.bgCancel != nil {
		s.bgCancel()
	}
	s.bg.Wait()
	if s.ctl != nil {
		s.ctl.close()
	}
	if s.allocs != nil {
		_ = s.allocs.Close(5 * time.Second) // nodes killed by a scenario exit unclean
	}
	if s.lab != nil {
		if err := s.lab.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	if s.logw != nil {
		s.logw.Close()
	}
	if s.dir != "" {
		os.RemoveAll(s.dir)
	}
	return errors.Join(errs...)
}

// windowOf is the window index of true instant ns.
func (s *Suite) windowOf(ns int64) int64 {
	return lease.WindowIndex(ns/1e6, s.cfg.Window.Milliseconds())
}

// waitUntil sleeps until true instant ns (or ctx ends).
func (s *Suite) waitUntil(ctx context.Context, ns int64) error {
	d := time.Duration(ns - s.clock.Now())
	if d <= 0 {
		return ctx.Err()
	}
	select {
	case <-time.After(d):
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// nextBoundary returns the start of the next window plus offset (true ns).
func (s *Suite) nextBoundary(offset time.Duration) int64 {
	w := s.windowOf(s.clock.Now())
	return lease.WindowEnd(w, s.cfg.Window.Milliseconds())*1e6 + int64(offset)
}

// boundTerms lists the stated bound's nonzero terms ("no nonzero term"
// when every term is zero).
func boundTerms(b *allotv1.QuotaBound) string {
	var out []string
	for _, t := range b.GetTerms() {
		if t.GetTokens() != 0 {
			out = append(out, fmt.Sprintf("%s %d", t.GetName(), t.GetTokens()))
		}
	}
	if len(out) == 0 {
		return "no nonzero term"
	}
	return strings.Join(out, " + ")
}

// boundTerm is the tokens of the stated bound's term name (0 when absent).
func boundTerm(b *allotv1.QuotaBound, name string) int64 {
	for _, t := range b.GetTerms() {
		if t.GetName() == name {
			return t.GetTokens()
		}
	}
	return 0
}
