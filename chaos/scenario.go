package chaos

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/allot-dev/allot/chaos/history"
	"github.com/allot-dev/allot/pkg/topology"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// Scenario is one named fault. Run injects it, heals it, records the fault
// timeline and returns the scenario's span.
type Scenario struct {
	// Name identifies the scenario in schedules and reports.
	Name string
	// Touches names what it disturbs; a random schedule runs two scenarios
	// at once only when they touch nothing in common.
	Touches []string
	// Run runs the scenario; rng draws its parameters.
	Run func(ctx context.Context, s *Suite, rng *rand.Rand) (history.Span, error)
}

// Scenarios returns every scenario, in the order of the short schedule.
func Scenarios() []Scenario {
	return []Scenario{
		{Name: "partition-region", Touches: []string{"region-net"}, Run: partitionRegion},
		{Name: "isolate-leader", Touches: []string{"leader", "alloc-net"}, Run: isolateLeader},
		{Name: "kill-leader-storm", Touches: []string{"leader", "alloc-procs"}, Run: killLeaderStorm},
		{Name: "stop-leader", Touches: []string{"leader", "alloc-procs"}, Run: stopLeader},
		{Name: "skew-region", Touches: []string{"clock"}, Run: skewRegion},
		{Name: "cut-allocators", Touches: []string{"alloc-net", "region-net"}, Run: cutAllocators},
		{Name: "membership", Touches: []string{"leader", "alloc-procs", "membership"}, Run: membership},
		{Name: "restart-all", Touches: []string{"leader", "alloc-procs", "alloc-net", "membership"}, Run: restartAll},
		{Name: "restart-store", Touches: []string{"store"}, Run: restartStore},
	}
}

// Step is one step of a schedule: one scenario, or two run at once, each
// with the seed of its random parameters.
type Step struct {
	// Scenarios run at once.
	Scenarios []Scenario
	// Seeds seed the scenarios' parameters, one per scenario.
	Seeds []uint64
}

// stepRand is the random source of step i of a run seeded with seed: what
// the step runs and with which parameters depend on (seed, i) alone, so a
// step is the same in a soak of any length, and in the short schedule or
// a -chaos.scenarios list the same scenario at the same place gets the
// same parameters.
func stepRand(seed int64, i int) *rand.Rand {
	return rand.New(rand.NewPCG(uint64(seed), 1<<32|uint64(i)))
}

// stepOf makes a step of scs, drawing each scenario's seed from rng (the
// step's stepRand, after what it drew to choose scs).
func stepOf(rng *rand.Rand, scs ...Scenario) Step {
	st := Step{Scenarios: scs}
	for range scs {
		st.Seeds = append(st.Seeds, rng.Uint64())
	}
	return st
}

// FixedSchedule runs the given scenarios in order, one at a time, with
// parameters drawn from seed and each step's place.
func FixedSchedule(seed int64, scs []Scenario) []Step {
	var out []Step
	for i, sc := range scs {
		out = append(out, stepOf(stepRand(seed, i), sc))
	}
	return out
}

// ShortSchedule runs every scenario once, one at a time.
func ShortSchedule(seed int64) []Step { return FixedSchedule(seed, Scenarios()) }

// RandomSchedule draws n steps from seed: each a random scenario, and with
// probability 1/3 a second one that touches nothing the first touches.
// restart-store is drawn only when the regions have a store (withStore:
// agent regions). Step i depends on (seed, i) only: a longer soak with the
// same seed starts with the same steps.
func RandomSchedule(seed int64, n int, withStore bool) []Step {
	var pool []Scenario
	for _, sc := range Scenarios() {
		if withStore || sc.Name != "restart-store" {
			pool = append(pool, sc)
		}
	}
	var out []Step
	for i := range n {
		rng := stepRand(seed, i)
		a := pool[rng.IntN(len(pool))]
		scs := []Scenario{a}
		if rng.IntN(3) == 0 {
			var ok []Scenario
			for _, b := range pool {
				if !slices.ContainsFunc(b.Touches, func(t string) bool { return slices.Contains(a.Touches, t) }) {
					ok = append(ok, b)
				}
			}
			if len(ok) > 0 {
				scs = append(scs, ok[rng.IntN(len(ok))])
			}
		}
		out = append(out, stepOf(rng, scs...))
	}
	return out
}

// String names the step's scenarios.
func (st Step) String() string {
	var names []string
	for _, sc := range st.Scenarios {
		names = append(names, sc.Name)
	}
	return strings.Join(names, "+")
}

// RunSchedule runs the steps in order, each starting 500 ms into a fresh
// window and followed by a ledger read of every quota (after every
// failover) and one calm window, and stops early when until passes.
func (s *Suite) RunSchedule(ctx context.Context, steps []Step, until time.Time) error {
	for i, st := range steps {
		if time.Now().After(until) {
			s.logf("schedule: stopping after %d of %d steps (time is up)", i, len(steps))
			break
		}
		if err := s.waitUntil(ctx, s.nextBoundary(500*time.Millisecond)); err != nil {
			return err
		}
		s.logf("step %d/%d: %s", i+1, len(steps), st)
		var (
			wg   sync.WaitGroup
			mu   sync.Mutex
			errs []error
		)
		for k, sc := range st.Scenarios {
			seed := st.Seeds[k]
			wg.Add(1)
			go func() {
				defer wg.Done()
				sp, err := sc.Run(ctx, s, rand.New(rand.NewPCG(seed, 1)))
				sp.Scenario = sc.Name
				s.rec.Span(sp)
				if err != nil {
					mu.Lock()
					errs = append(errs, fmt.Errorf("%s: %w", sc.Name, err))
					mu.Unlock()
				}
			}()
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			return err
		}
		rctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		err := s.obs.readAll(rctx)
		cancel()
		if err != nil {
			return fmt.Errorf("after %s: %w", st, err)
		}
		// One calm window before the next step.
		if err := s.waitUntil(ctx, s.nextBoundary(s.cfg.Window)); err != nil {
			return err
		}
	}
	return nil
}

// fault records a fault timeline entry and logs it.
func (s *Suite) fault(scenario, action, format string, args ...any) int64 {
	at := s.clock.Now()
	detail := fmt.Sprintf(format, args...)
	s.rec.Fault(history.Fault{Scenario: scenario, Action: action, Detail: detail, At: at})
	s.logf("  %s %s: %s", scenario, action, detail)
	return at
}

func sleepCtx(ctx context.Context, d time.Duration) error {
	select {
	case <-time.After(d):
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// leader returns the current leader node and its host.
func (s *Suite) leader(ctx context.Context) (*topology.AllocatorNode, *topology.Host, error) {
	cctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	n, err := s.allocs.WaitLeader(cctx)
	if err != nil {
		return nil, nil, err
	}
	return n, s.hostOf(n.ID), nil
}

// newLeader waits for a leader other than old.
func (s *Suite) newLeader(ctx context.Context, old string) (*topology.AllocatorNode, error) {
	cctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	for {
		n, err := s.allocs.WaitLeader(cctx)
		if err != nil {
			return nil, err
		}
		if n.ID != old {
			return n, nil
		}
		if err := sleepCtx(cctx, 50*time.Millisecond); err != nil {
			return nil, err
		}
	}
}

func (s *Suite) hostOf(id string) *topology.Host {
	for _, h := range s.allocHosts {
		if h.Name == id {
			return h
		}
	}
	return nil
}

// partition drops every packet between h and peers, by two iptables rules
// in h's namespace tagged with tag (a comma-separated address list expands
// into one rule per peer in one call: under load each iptables call costs
// a few hundred milliseconds, which would stretch the fault).
func (s *Suite) partition(ctx context.Context, h *topology.Host, peers []*topology.Host, tag string) error {
	var ips []string
	for _, p := range peers {
		if p != h {
			ips = append(ips, p.IP)
		}
	}
	if len(ips) == 0 {
		return nil
	}
	list := strings.Join(ips, ",")
	for _, rule := range [][]string{
		{"INPUT", "-s", list, "-j", "DROP", "-m", "comment", "--comment", tag},
		{"OUTPUT", "-d", list, "-j", "DROP", "-m", "comment", "--comment", tag},
	} {
		if err := h.IPTables(ctx, append([]string{"-I"}, rule...)...); err != nil {
			return err
		}
		s.mu.Lock()
		k := h.NS + "/" + tag
		s.cuts[k] = append(s.cuts[k], rule)
		s.mu.Unlock()
	}
	return nil
}

// heal removes the rules partition added to h under tag: with the specs it
// inserted them with (-D with an address list deletes every rule it
// expanded to) or, when partition did not finish, by listing the tagged
// rules and deleting them by number.
func (s *Suite) heal(ctx context.Context, h *topology.Host, tag string) error {
	s.mu.Lock()
	k := h.NS + "/" + tag
	rules := s.cuts[k]
	delete(s.cuts, k)
	s.mu.Unlock()
	for _, rule := range rules {
		if err := h.IPTables(ctx, append([]string{"-D"}, rule...)...); err != nil {
			return err
		}
	}
	if len(rules) == 2 {
		return nil // both rules were in and are out
	}
	for _, chain := range []string{"INPUT", "OUTPUT"} {
		out, err := h.Run(ctx, "iptables", "-w", "-L", chain, "--line-numbers", "-n")
		if err != nil {
			return err
		}
		var nums []int
		for _, line := range strings.Split(string(out), "\n") {
			f := strings.Fields(line)
			if len(f) == 0 || !strings.Contains(line, "/* "+tag+" */") {
				continue
			}
			if n, err := strconv.Atoi(f[0]); err == nil {
				nums = append(nums, n)
			}
		}
		for i := len(nums) - 1; i >= 0; i-- { // highest first: numbers below stay valid
			if err := h.IPTables(ctx, "-D", chain, strconv.Itoa(nums[i])); err != nil {
				return err
			}
		}
	}
	return nil
}

// dropped sums the packet counters of the DROP rules partition added under
// tag on hosts (one iptables call per host, all at once): a cut that
// matched no packet did not take effect.
func (s *Suite) dropped(ctx context.Context, hosts []*topology.Host, tag string) (int64, error) {
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		n    int64
		errs []error
	)
	for _, h := range hosts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			out, err := h.Run(ctx, "iptables", "-w", "-L", "-v", "-x", "-n")
			mu.Lock()
			defer mu.Unlock()
			n += countDropped(string(out), tag)
			errs = append(errs, err)
		}()
	}
	wg.Wait()
	return n, errors.Join(errs...)
}

// countDropped sums the packet counters (first column of `iptables -L -v
// -x -n`) of the DROP rules commented tag.
func countDropped(out, tag string) int64 {
	var n int64
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		if len(f) < 3 || f[2] != "DROP" || !strings.Contains(line, "/* "+tag+" */") {
			continue
		}
		if p, err := strconv.ParseInt(f[0], 10, 64); err == nil {
			n += p
		}
	}
	return n
}

// healCtx is a context for healing that outlives a cancelled run.
func healCtx() (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.Background(), 20*time.Second)
}

func (s *Suite) regionHostList() []*topology.Host {
	var out []*topology.Host
	for _, r := range s.cfg.Regions {
		out = append(out, s.regionHosts[r])
	}
	return out
}

// partitionRegion cuts one region from every allocator for 2-3 TTLs. The
// cut must have dropped packets: the region renews its leases (and pings
// its connections) every second or so, so rules that matched nothing
// mean the fault did not take effect, and the step fails.
func partitionRegion(ctx context.Context, s *Suite, rng *rand.Rand) (history.Span, error) {
	r := s.cfg.Regions[rng.IntN(len(s.cfg.Regions))]
	h := s.regionHosts[r]
	d := 2*s.cfg.TTL + time.Duration(rng.Int64N(int64(s.cfg.TTL)))
	start := s.fault("partition-region", "inject", "region %s: iptables DROP to and from every allocator, for %s (TTL %s)", r, d.Round(time.Millisecond), s.cfg.TTL)
	err := s.partition(ctx, h, s.allocHosts, "chaos-partition")
	if err == nil {
		err = sleepCtx(ctx, d)
	}
	var drops int64
	if err == nil {
		// Read before the heal deletes the rules (the cut lasts one
		// iptables call longer).
		if drops, err = s.dropped(ctx, []*topology.Host{h}, "chaos-partition"); err == nil && drops == 0 {
			err = fmt.Errorf("the fault did not take effect: region %s's DROP rules matched no packet in %s", r, time.Duration(s.clock.Now()-start).Round(time.Millisecond))
		}
	}
	hctx, cancel := healCtx()
	defer cancel()
	err = errors.Join(err, s.heal(hctx, h, "chaos-partition"))
	end := s.fault("partition-region", "heal", "region %s reconnected (%d packets dropped)", r, drops)
	return history.Span{Start: start, End: end, RecoverFrom: end, Regions: []string{r}, CutOff: true}, err
}

// isolateLeader cuts the leader from the other allocators (the minority
// side) for 3 s; regions still reach it and are answered with hints.
func isolateLeader(ctx context.Context, s *Suite, rng *rand.Rand) (history.Span, error) {
	l, h, err := s.leader(ctx)
	if err != nil {
		return history.Span{}, err
	}
	d := 3*time.Second + time.Duration(rng.Int64N(int64(time.Second)))
	start := s.fault("isolate-leader", "inject", "leader %s: iptables DROP to and from the other allocators for %s (regions still reach it)", l.ID, d.Round(time.Millisecond))
	err = s.partition(ctx, h, s.allocHosts, "chaos-isolate")
	if err == nil {
		// The majority must elect another leader (1-1.6 s here; newLeader
		// waits 20 s): if it does not, the fault did not take effect and
		// the step fails.
		if nl, lerr := s.newLeader(ctx, l.ID); lerr != nil {
			err = fmt.Errorf("the fault did not take effect: no leader but %s within 20s of isolating it: %w", l.ID, lerr)
		} else {
			s.fault("isolate-leader", "note", "majority elected %s after %s", nl.ID, time.Duration(s.clock.Now()-start).Round(time.Millisecond))
			err = sleepCtx(ctx, time.Duration(start+int64(d)-s.clock.Now()))
		}
	}
	hctx, cancel := healCtx()
	defer cancel()
	err = errors.Join(err, s.heal(hctx, h, "chaos-isolate"))
	end := s.fault("isolate-leader", "heal", "%s rejoined", l.ID)
	if _, _, lerr := s.leader(ctx); lerr != nil {
		err = errors.Join(err, lerr)
	}
	return history.Span{Start: start, End: end, RecoverFrom: start}, err
}

// killLeaderStorm fires a renewal storm from every region just after a
// window boundary (when every clamped lease has just ended and regions
// renew anyway), kills the leader with SIGKILL in the middle of it, and
// restarts the killed node from its data dir 2 s later.
func killLeaderStorm(ctx context.Context, s *Suite, rng *rand.Rand) (history.Span, error) {
	if err := s.waitUntil(ctx, s.nextBoundary(20*time.Millisecond)); err != nil {
		return history.Span{}, err
	}
	l, _, err := s.leader(ctx)
	if err != nil {
		return history.Span{}, err
	}
	n := 3 + rng.IntN(3)
	detail := fmt.Sprintf("renewal storm: %d extra Acquires per quota from every region", n)
	if len(s.regions) > 0 {
		if d, ok := s.regions[0].(interface{ StormDetail(n int) string }); ok {
			detail = d.StormDetail(n)
		}
	}
	start := s.fault("kill-leader-storm", "inject", "%s", detail)
	var (
		wg        sync.WaitGroup
		mu        sync.Mutex
		stormErrs []error
	)
	for _, r := range s.regions {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := r.Storm(ctx, n); err != nil {
				// No storm in this region: the step fails (the kill
				// still happens, the run carries on to the heal).
				mu.Lock()
				stormErrs = append(stormErrs, fmt.Errorf("storm in region %s: %w", r.Name(), err))
				mu.Unlock()
			}
		}()
	}
	_ = sleepCtx(ctx, time.Duration(10+rng.IntN(40))*time.Millisecond)
	l.Proc.Kill()
	killed := s.fault("kill-leader-storm", "inject", "kill -9 leader %s (pid %d) during the storm", l.ID, l.Proc.Pid())
	wg.Wait()
	stormErr := errors.Join(stormErrs...)
	nl, err := s.newLeader(ctx, l.ID)
	if err != nil {
		return history.Span{Start: start, End: s.clock.Now(), RecoverFrom: killed}, errors.Join(stormErr, err)
	}
	s.fault("kill-leader-storm", "note", "new leader %s after %s", nl.ID, time.Duration(s.clock.Now()-killed).Round(time.Millisecond))
	_ = sleepCtx(ctx, 2*time.Second)
	err = s.allocs.Start(l)
	if err == nil {
		wctx, cancel := context.WithTimeout(ctx, 20*time.Second)
		err = s.allocs.WaitUp(wctx, l)
		cancel()
	}
	// The span ends, like restart-all's, once the restarted node is up and
	// a leader is known (nl, elected before the restart).
	end := s.fault("kill-leader-storm", "heal", "%s restarted from its data dir", l.ID)
	return history.Span{Start: start, End: end, RecoverFrom: killed}, errors.Join(stormErr, err)
}

// stopLeader freezes the leader with SIGSTOP for 2-3 s, well past the
// election timeout, then lets it run again (it wakes up believing it leads).
func stopLeader(ctx context.Context, s *Suite, rng *rand.Rand) (history.Span, error) {
	l, _, err := s.leader(ctx)
	if err != nil {
		return history.Span{}, err
	}
	d := 2*time.Second + time.Duration(rng.Int64N(int64(time.Second)))
	if err := l.Proc.Signal(syscall.SIGSTOP); err != nil {
		return history.Span{}, err
	}
	start := s.fault("stop-leader", "inject", "SIGSTOP leader %s for %s (election timeout 500ms)", l.ID, d.Round(time.Millisecond))
	// The others must elect a new leader (1-1.6 s here; newLeader waits
	// 20 s): if they do not, the fault did not take effect and the step
	// fails (after the SIGCONT).
	nl, lerr := s.newLeader(ctx, l.ID)
	if lerr != nil {
		lerr = fmt.Errorf("the fault did not take effect: no leader but %s within 20s of stopping it: %w", l.ID, lerr)
	} else {
		s.fault("stop-leader", "note", "new leader %s after %s", nl.ID, time.Duration(s.clock.Now()-start).Round(time.Millisecond))
	}
	_ = sleepCtx(ctx, time.Duration(start+int64(d)-s.clock.Now()))
	err = errors.Join(lerr, l.Proc.Signal(syscall.SIGCONT))
	end := s.fault("stop-leader", "heal", "SIGCONT %s", l.ID)
	if _, _, lerr := s.leader(ctx); lerr != nil {
		err = errors.Join(err, lerr)
	}
	return history.Span{Start: start, End: end, RecoverFrom: start}, err
}

// restartAll kills every allocator with SIGKILL and starts them all again
// from their data dirs: every acknowledged grant must come back.
func restartAll(ctx context.Context, s *Suite, _ *rand.Rand) (history.Span, error) {
	return s.restartAll(ctx, &clusterRestart{allocs: s.allocs})
}

// restarter is what restart-all does to the allocators (the lab's
// processes, or a test's stand-in).
type restarter interface {
	// kill kills every running allocator with SIGKILL and says how many.
	kill() int
	// start starts the killed allocators again from their data dirs.
	start() error
	// waitUp waits until every restarted allocator answers.
	waitUp(ctx context.Context) error
	// waitLeader waits for a leader and names it.
	waitLeader(ctx context.Context) (string, error)
}

// restartAll runs restart-all on c. Its span ends, like kill-leader-storm's,
// only when the restarted allocators are up and a leader is known (or
// waiting for them failed): Birch is excused until the cluster serves
// again, not merely until its processes were started. Recovery is measured
// from the restart.
func (s *Suite) restartAll(ctx context.Context, c restarter) (history.Span, error) {
	start := s.fault("restart-all", "inject", "kill -9 every allocator (%d)", c.kill())
	_ = sleepCtx(ctx, 500*time.Millisecond)
	err := c.start()
	restarted := s.fault("restart-all", "note", "every allocator restarted from its data dir")
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err == nil {
		err = c.waitUp(wctx)
	}
	what := "not back"
	if err == nil {
		var l string
		if l, err = c.waitLeader(wctx); err == nil {
			what = fmt.Sprintf("up, leader %s after %s", l, time.Duration(s.clock.Now()-restarted).Round(time.Millisecond))
		}
	}
	end := s.fault("restart-all", "heal", "every allocator restarted: %s", what)
	return history.Span{Start: start, End: end, RecoverFrom: restarted}, err
}

// clusterRestart is the lab's restarter.
type clusterRestart struct {
	allocs *topology.Allocators
	nodes  []*topology.AllocatorNode // the killed ones
}

func (c *clusterRestart) kill() int {
	for _, n := range c.allocs.Nodes {
		if n.Proc != nil && !n.Proc.Exited() {
			c.nodes = append(c.nodes, n)
		}
	}
	for _, n := range c.nodes {
		n.Proc.Kill()
	}
	return len(c.nodes)
}

func (c *clusterRestart) start() error {
	var err error
	for _, n := range c.nodes {
		err = errors.Join(err, c.allocs.Start(n))
	}
	return err
}

func (c *clusterRestart) waitUp(ctx context.Context) error {
	for _, n := range c.nodes {
		if err := c.allocs.WaitUp(ctx, n); err != nil {
			return err
		}
	}
	return nil
}

func (c *clusterRestart) waitLeader(ctx context.Context) (string, error) {
	l, err := c.allocs.WaitLeader(ctx)
	if err != nil {
		return "", err
	}
	return l.ID, nil
}

// skewRegion moves one region's wall clock 500 ms ahead and another's 500
// ms behind (one region, random sign, when there is only one) for two
// windows. Deadlines by the send-time rule must not move. Agent regions
// restart their agent with the skewed clock (and again without it at the
// heal): the restarts are part of the fault window.
func skewRegion(ctx context.Context, s *Suite, rng *rand.Rand) (history.Span, error) {
	order := rng.Perm(len(s.cfg.Regions))
	skews := map[string]time.Duration{s.cfg.Regions[order[0]]: 500 * time.Millisecond}
	if len(order) > 1 {
		skews[s.cfg.Regions[order[1]]] = -500 * time.Millisecond
	} else if rng.IntN(2) == 0 {
		skews[s.cfg.Regions[order[0]]] = -500 * time.Millisecond
	}
	var names, touched []string
	for _, r := range s.regions {
		if d, ok := skews[r.Name()]; ok {
			names = append(names, fmt.Sprintf("%s %+dms", r.Name(), d.Milliseconds()))
			touched = append(touched, r.Name())
		}
	}
	how := "wall clocks skewed"
	if s.cfg.RegionKind == RegionAgent && s.cfg.NewRegion == nil {
		how = "agents restarted with their clocks skewed (-clock-offset)"
	}
	start := s.fault("skew-region", "inject", "%s: %s, for two windows", how, strings.Join(names, ", "))
	err := s.setSkews(ctx, skews)
	if errors.Is(err, ErrNeedsAgent) {
		s.logf("  skew-region skipped: %v", err)
		now := s.clock.Now()
		return history.Span{Start: now, End: now, RecoverFrom: now, Skipped: "skipped: the region cannot skew its clock"}, nil
	}
	s.fault("skew-region", "note", "skews in force after %s", time.Duration(s.clock.Now()-start).Round(time.Millisecond))
	if err == nil {
		err = sleepCtx(ctx, 2*s.cfg.Window)
	}
	hctx, cancel := healCtx()
	defer cancel()
	for r := range skews {
		skews[r] = 0
	}
	err = errors.Join(err, s.setSkews(hctx, skews))
	end := s.fault("skew-region", "heal", "skews removed")
	return history.Span{Start: start, End: end, RecoverFrom: start, Regions: touched}, err
}

// setSkews sets the clock skews of the named regions, all at once (an agent
// region restarts its agent for it).
func (s *Suite) setSkews(ctx context.Context, skews map[string]time.Duration) error {
	var (
		wg   sync.WaitGroup
		mu   sync.Mutex
		errs []error
	)
	for _, r := range s.regions {
		d, ok := skews[r.Name()]
		if !ok {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := r.SetClockSkew(ctx, d); err != nil {
				mu.Lock()
				errs = append(errs, err)
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// cutAllocators cuts every allocator from every region for 1.5-2 TTLs:
// regions spend only what they hold, then deny. The cut must have dropped
// packets (every region renews with the leader within a TTL): rules that
// matched nothing on every allocator mean the fault did not take effect,
// and the step fails.
func cutAllocators(ctx context.Context, s *Suite, rng *rand.Rand) (history.Span, error) {
	d := s.cfg.TTL*3/2 + time.Duration(rng.Int64N(int64(s.cfg.TTL/2)))
	start := s.fault("cut-allocators", "inject", "every allocator: iptables DROP to and from every region, for %s (TTL %s)", d.Round(time.Millisecond), s.cfg.TTL)
	var err error
	for _, h := range s.allocHosts {
		err = errors.Join(err, s.partition(ctx, h, s.regionHostList(), "chaos-cut"))
	}
	if err == nil {
		err = sleepCtx(ctx, d)
	}
	var drops int64
	if err == nil {
		// Read before the heal deletes the rules (the cut lasts one
		// iptables call longer: every allocator is read at once).
		if drops, err = s.dropped(ctx, s.allocHosts, "chaos-cut"); err == nil && drops == 0 {
			err = fmt.Errorf("the fault did not take effect: the allocators' DROP rules matched no packet in %s", time.Duration(s.clock.Now()-start).Round(time.Millisecond))
		}
	}
	hctx, cancel := healCtx()
	defer cancel()
	for _, h := range s.allocHosts {
		err = errors.Join(err, s.heal(hctx, h, "chaos-cut"))
	}
	end := s.fault("cut-allocators", "heal", "allocators reachable again (%d packets dropped)", drops)
	return history.Span{Start: start, End: end, RecoverFrom: end, CutOff: true}, err
}

// membership, under load: adds the spare host as a fourth member, removes
// a follower, re-adds it with an empty data dir (it catches up from the
// others), then removes the spare again.
func membership(ctx context.Context, s *Suite, rng *rand.Rand) (history.Span, error) {
	spare := s.allocHosts[len(s.allocHosts)-1]
	l, lh, err := s.leader(ctx)
	if err != nil {
		return history.Span{}, err
	}
	start := s.fault("membership", "inject", "add %s (join via leader %s)", spare.Name, l.ID)
	fail := func(err error) (history.Span, error) {
		return history.Span{Start: start, End: s.clock.Now(), RecoverFrom: start}, err
	}
	added, err := s.join(ctx, spare, lh)
	if err != nil {
		return fail(err)
	}
	var followers []*topology.AllocatorNode
	for _, n := range s.allocs.Nodes {
		if n.ID != l.ID && n.ID != spare.Name && n.Proc != nil && !n.Proc.Exited() {
			followers = append(followers, n)
		}
	}
	if len(followers) == 0 {
		return fail(errors.New("no follower to remove"))
	}
	f := followers[rng.IntN(len(followers))]
	if err := s.removeMember(ctx, f); err != nil {
		return fail(err)
	}
	s.fault("membership", "inject", "removed follower %s; re-adding it with an empty data dir", f.ID)
	if _, err := s.join(ctx, s.hostOf(f.ID), lh); err != nil {
		return fail(err)
	}
	if err := s.removeMember(ctx, added); err != nil {
		return fail(err)
	}
	end := s.fault("membership", "heal", "removed %s: back to %d members", spare.Name, s.cfg.Allocators)
	return history.Span{Start: start, End: end, RecoverFrom: start}, nil
}

// join starts an allocator on h with an empty data dir that joins through
// via, replacing any earlier node of h, and waits until the leader lists
// it as a voter and it has applied what the leader had committed.
func (s *Suite) join(ctx context.Context, h, via *topology.Host) (*topology.AllocatorNode, error) {
	dataDir := s.allocs.Nodes[0].DataDir
	n := topology.AllocatorNodeIn(h, s.bins["./cmd/allocator"], dirOf(dataDir), append([]string{"-join", apiAddr(via)}, allocatorArgs()...)...)
	if err := os.RemoveAll(n.DataDir); err != nil {
		return nil, err
	}
	idx := slices.IndexFunc(s.allocs.Nodes, func(x *topology.AllocatorNode) bool { return x.ID == n.ID })
	if idx >= 0 {
		s.allocs.Nodes[idx] = n
	} else {
		s.allocs.Nodes = append(s.allocs.Nodes, n)
	}
	if err := s.allocs.Start(n); err != nil {
		return nil, err
	}
	wctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	if err := s.allocs.WaitUp(wctx, n); err != nil {
		return nil, err
	}
	for {
		// GetCluster answers from the node called: ask the leader itself.
		if l, err := s.allocs.WaitLeader(wctx); err == nil {
			cl, err := s.nodeCluster(wctx, l)
			if err == nil && cl.GetState() == "Leader" &&
				slices.ContainsFunc(cl.GetMembers(), func(m *allotv1.Member) bool { return m.GetId() == n.ID && m.GetSuffrage() == "Voter" }) {
				if self, err := s.nodeCluster(wctx, n); err == nil && self.GetAppliedIndex() >= cl.GetCommitIndex() {
					s.fault("membership", "note", "%s is a voter and caught up (applied %d)", n.ID, self.GetAppliedIndex())
					return n, nil
				}
			}
		}
		if err := sleepCtx(wctx, 100*time.Millisecond); err != nil {
			return nil, fmt.Errorf("%s did not join: %w", n.ID, err)
		}
	}
}

func dirOf(dataDir string) string {
	i := strings.LastIndex(dataDir, "/")
	if i < 0 {
		return "."
	}
	return dataDir[:i]
}

// nodeCluster asks node n itself (not the leader) for its view.
func (s *Suite) nodeCluster(ctx context.Context, n *topology.AllocatorNode) (*allotv1.GetClusterResponse, error) {
	c, err := newSingleClient(n.APIAddr)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	return c.Operator().GetCluster(ctx, &allotv1.GetClusterRequest{})
}

// removeMember removes n from the cluster and stops its process.
func (s *Suite) removeMember(ctx context.Context, n *topology.AllocatorNode) error {
	cctx, cancel := context.WithTimeout(ctx, 20*time.Second)
	defer cancel()
	if _, err := s.client.Operator().RemoveMember(cctx, &allotv1.RemoveMemberRequest{Id: n.ID}); err != nil {
		return fmt.Errorf("remove %s: %w", n.ID, err)
	}
	_ = n.Proc.Stop(5 * time.Second) // a removed node may not exit cleanly
	if i := slices.Index(s.allocs.Nodes, n); i >= 0 && n.ID == s.allocHosts[len(s.allocHosts)-1].Name {
		s.allocs.Nodes = slices.Delete(s.allocs.Nodes, i, i+1)
	}
	return nil
}

// restartStore kills one region's Redis (SIGKILL, no persistence: every
// deposited token is lost) and starts it again on the same address; the
// region may then only under-admit until its agent renews. Region drivers
// have no store: with them it is reported as skipped.
func restartStore(ctx context.Context, s *Suite, rng *rand.Rand) (history.Span, error) {
	r := s.regions[rng.IntN(len(s.regions))]
	start := s.clock.Now()
	err := r.RestartStore(ctx)
	if errors.Is(err, ErrNeedsAgent) {
		s.logf("  restart-store skipped: %v", err)
		return history.Span{Start: start, End: start, RecoverFrom: start, Regions: []string{r.Name()}, Skipped: "skipped: needs the region agent"}, nil
	}
	end := s.fault("restart-store", "inject", "region %s: store restarted (its tokens are lost)", r.Name())
	return history.Span{Start: start, End: end, RecoverFrom: end, Regions: []string{r.Name()}, Store: true}, err
}
