package chaos

import (
	"context"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/allot-dev/allot/chaos/check"
	"github.com/allot-dev/allot/pkg/topology"
)

var (
	soakFlag = flag.Duration("chaos.soak", 0, "run random fault schedules for this long instead of the short schedule (raise -timeout to match)")
	seedFlag = flag.Int64("chaos.seed", 0, "seed of the run's random choices (0: from the time; printed either way)")
	onlyFlag = flag.String("chaos.scenarios", "", "comma-separated scenarios to run instead of all of them (short schedule only)")
	histFlag = flag.Bool("chaos.history", false, "write the whole history to chaos/out/history.jsonl even when every check passes")
	kindFlag = flag.String("chaos.regions", RegionAgent, "what runs each region of TestChaos: agent (regionagent + redis-server + load generator) or driver (the chaosregion driver)")
)

func runSeed(t *testing.T) int64 {
	seed := *seedFlag
	if seed == 0 {
		seed = time.Now().UnixNano() % 1_000_000_000
	}
	t.Logf("seed %d (replay: go test ./chaos -run '%s$' -chaos.seed=%d)", seed, t.Name(), seed)
	return seed
}

// newSuite starts a suite or, where network namespaces cannot be made,
// skips saying why (fails when CI is set).
func newSuite(t *testing.T, cfg Config) *Suite {
	t.Helper()
	ctx := context.Background()
	if err := topology.NetnsSupport(ctx); err != nil {
		if os.Getenv("CI") != "" {
			t.Fatalf("the chaos suite needs network namespaces, and CI must provide them: %v", err)
		}
		t.Skipf("skipping the chaos suite: %v", err)
	}
	cfg.OutDir = "out"
	cfg.Logf = t.Logf
	s, err := Start(ctx, cfg)
	if err != nil {
		t.Fatalf("start: %v (process logs: chaos/out/logs/processes.log)", err)
	}
	t.Cleanup(func() {
		if err := s.Close(); err != nil {
			t.Errorf("cleanup: %v", err)
		}
	})
	return s
}

// TestChaos runs every scenario once (or, with -chaos.soak, random
// schedules for that long) against a live topology and checks the whole
// history. The report goes to chaos/out/report.txt.
func TestChaos(t *testing.T) {
	seed := runSeed(t)
	began := time.Now()
	cfg := DefaultConfig(seed)
	cfg.RegionKind = *kindFlag
	if cfg.RegionKind == RegionDriver {
		// The driver has no starve wait: a clamped Birch would be denied
		// at every window's turn (docs/chaos.md, findings).
		for i := range cfg.Quotas {
			if cfg.Quotas[i].Birch {
				cfg.Quotas[i].Clamp = false
			}
		}
	}
	s := newSuite(t, cfg)
	ctx := context.Background()
	rng := rand.New(rand.NewPCG(uint64(seed), 2))
	steps, until := ShortSchedule(), time.Now().Add(time.Hour)
	if *onlyFlag != "" {
		steps = nil
		for _, name := range strings.Split(*onlyFlag, ",") {
			i := slices.IndexFunc(Scenarios(), func(sc Scenario) bool { return sc.Name == name })
			if i < 0 {
				t.Fatalf("-chaos.scenarios: no scenario %q", name)
			}
			steps = append(steps, Step{Scenarios()[i]})
		}
	}
	if *soakFlag > 0 {
		// A step takes at least two windows: this many always fill the soak.
		steps = RandomSchedule(rng, int(*soakFlag/(2*s.cfg.Window))+1, s.cfg.RegionKind == RegionAgent)
		until = time.Now().Add(*soakFlag)
	}
	// One calm window first.
	if err := s.waitUntil(ctx, s.nextBoundary(s.cfg.Window)); err != nil {
		t.Fatal(err)
	}
	runErr := s.RunSchedule(ctx, rng, steps, until)
	h, finErr := s.Finish(ctx)
	defer func() {
		// Last, so every failure below is known.
		if *histFlag || t.Failed() {
			if err := s.WriteHistory("history.jsonl", h); err != nil {
				t.Errorf("history: %v", err)
			}
		}
	}()
	res := check.Run(h, s.CheckParams())
	report, err := s.Report("report.txt", "allot chaos: "+scheduleName(steps), h, res, time.Since(began))
	t.Log("\n" + report)
	if err != nil {
		t.Errorf("report: %v", err)
	}
	if runErr != nil {
		t.Fatalf("schedule: %v", runErr)
	}
	if finErr != nil {
		t.Fatalf("finish: %v", finErr)
	}
	if d := s.WallClockStep(); !res.OK() && (d > maxWallStep || d < -maxWallStep) {
		// The processes stamp leases and ledgers with the wall clock, the
		// checkers judge them on CLOCK_MONOTONIC: a step of the machine's
		// clock (NTP, the hypervisor) beyond the lease margins shifts one
		// against the other, so the verdict of the checks that compare the
		// two is void, not a failure (outside CI: see standing).
		msg := fmt.Sprintf("the machine's wall clock stepped %s against CLOCK_MONOTONIC during the run (more than %s)", d, maxWallStep)
		n := standing(res.Violations, os.Getenv("CI") != "")
		if n == 0 {
			t.Skipf("%s: %d violations are void; replay with -chaos.seed=%d", msg, len(res.Violations), seed)
		}
		t.Logf("%s, but %d of %d violations stand (CI, or checks that compare no wall-clock stamp)", msg, n, len(res.Violations))
	}
	if s.cfg.RegionKind == RegionAgent && s.cfg.NewRegion == nil && s.GRPCChunks() == 0 {
		t.Errorf("the agents' leases never crossed the allocators' gRPC listeners")
	}
	// The checkers must have had something to check.
	if res.Grants == 0 || res.LedgerReads == 0 || res.Replays == 0 {
		t.Fatalf("vacuous history: %d grants, %d ledger reads, %d replays", res.Grants, res.LedgerReads, res.Replays)
	}
	for _, q := range s.Quotas() {
		if l := res.Linearizability[q.Name]; l.Windows == 0 || len(l.Unknown) > 0 {
			t.Errorf("quota %s: linearizability checked %d windows, undecided in %v", q.Name, l.Windows, l.Unknown)
		}
		var admitted int64
		for _, w := range res.Windows[q.Name] {
			admitted += w.Admitted
		}
		if admitted == 0 {
			t.Errorf("quota %s: nothing admitted", q.Name)
		}
	}
	if !res.OK() {
		t.Errorf("%d violations (listed in the report above and in chaos/out/report.txt)", len(res.Violations))
	}
}

// clockFree are the checks that compare no wall-clock stamp with the true
// clock: request and grant ids (double_grant: only a step of seconds, past
// the allocator's two-window id retention, could make a re-send a new
// grant), ledger reads against grants received before them (lost_grant,
// ledger_unread), tokens spent of a named grant (grant_overspent), and the
// pool model, split by the windows the allocator reported (linearizability:
// only an unanswered Acquire within the step of a window's turn could be
// put in the wrong window). A wall-clock step never voids them. The
// others do compare: bound counts admissions by windows of the true clock
// while the allocator opens each window's pool by its wall clock, so a step
// lets one true window see the admissions of two pools; the lease checks
// hold admissions and deposits (true clock) to the allocator's expiries
// (wall clock); window_reopened and birch_denied follow the allocator's and
// agents' windows.
var clockFree = map[string]bool{
	check.CheckDoubleGrant: true, check.CheckLostGrant: true, check.CheckUnverified: true,
	check.CheckOverspent: true, check.CheckLinearizable: true,
}

// standing counts the violations a wall-clock step does not void: under CI
// (the environment variable CI set) all of them, for the run must fail
// there whatever its clock did; otherwise those of the clockFree checks.
func standing(vs []check.Violation, ci bool) int {
	if ci {
		return len(vs)
	}
	n := 0
	for _, v := range vs {
		if clockFree[v.Check] {
			n++
		}
	}
	return n
}

// TestWallStepVoidsOnlyClockChecks: after a wall-clock step, a run skips
// (outside CI) only when every violation is of a check that compares
// wall-clock stamps with the true clock; under CI it fails.
func TestWallStepVoidsOnlyClockChecks(t *testing.T) {
	clocky := []check.Violation{{Check: check.CheckBound}, {Check: check.CheckLateSpend}, {Check: check.CheckDepositLate}, {Check: check.CheckReopened}, {Check: check.CheckBirch}}
	if n := standing(clocky, false); n != 0 {
		t.Errorf("violations of clock-comparing checks, outside CI: %d stand, want 0 (skip)", n)
	}
	if n := standing(clocky, true); n != len(clocky) {
		t.Errorf("under CI: %d of %d violations stand, want all", n, len(clocky))
	}
	for _, c := range []string{check.CheckDoubleGrant, check.CheckLinearizable, check.CheckLostGrant} {
		if n := standing(append(clocky, check.Violation{Check: c}), false); n != 1 {
			t.Errorf("a %s violation beside them, outside CI: %d stand, want 1", c, n)
		}
	}
}

// maxWallStep is how far the wall clock may move against CLOCK_MONOTONIC
// during a run before a run with violations is void (it stays within a few
// microseconds on a quiet machine).
const maxWallStep = 20 * time.Millisecond

func scheduleName(steps []Step) string {
	var names []string
	for _, st := range steps {
		names = append(names, st.String())
	}
	if len(names) > 12 {
		names = append(names[:12], "...")
	}
	return strings.Join(names, ", ")
}

// TestCheckerCatchesBrokenConfig runs deliberately broken configurations
// and asserts that the checkers report each of them:
//
//   - atlas: region us admits the full limit on its own, bypassing the
//     allocator, while eu leases from it: admitted > G + 0;
//   - noclamp: leases are not clamped (TTL runs into the next window) while
//     the bound the run is held to is the clamp-on one, 0; calm windows
//     followed by flood windows spend carried-over tokens on top of G;
//   - late: region ap trusts its wall clock, 500 ms behind, for lease
//     deadlines: it keeps grants spendable past the allocator's expiry
//     (the check agent regions are held to through their Redis expiry)
//     and spends after it.
//
// The regions are drivers: the broken modes are the driver's (the agent
// has none).
func TestCheckerCatchesBrokenConfig(t *testing.T) {
	seed := runSeed(t)
	began := time.Now()
	zero := int64(0)
	cfg := DefaultConfig(seed)
	cfg.RegionKind = RegionDriver
	cfg.Regions = []string{"ap", "eu", "us"}
	cfg.Quotas = []QuotaPlan{
		{Name: "atlas", Limit: 1000, Chunk: 100, Clamp: true, Demand: map[string]float64{"eu": 250, "us": 250}, Independent: map[string]int64{"us": 1000}},
		{Name: "noclamp", Limit: 1000, Chunk: 250, Clamp: false, Demand: map[string]float64{"eu": 150, "us": 150}, Flood: map[string]float64{"eu": 500, "us": 500}, ClaimBound: &zero},
		{Name: "late", Limit: 1000, Chunk: 100, Clamp: true, Demand: map[string]float64{"ap": 200}, WallDeadline: map[string]bool{"ap": true}},
	}
	s := newSuite(t, cfg)
	ctx := context.Background()
	for _, r := range s.regions {
		if r.Name() == "ap" {
			if err := r.SetClockSkew(ctx, -500*time.Millisecond); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := s.waitUntil(ctx, s.nextBoundary(5*s.cfg.Window)); err != nil {
		t.Fatal(err)
	}
	h, err := s.Finish(ctx)
	if err != nil {
		t.Fatalf("finish: %v", err)
	}
	res := check.Run(h, s.CheckParams())
	report, rerr := s.Report("broken-report.txt", "allot chaos: deliberately broken configurations (the checkers must object)", h, res, time.Since(began))
	t.Log("\n" + report)
	if rerr != nil {
		t.Errorf("report: %v", rerr)
	}
	want := []struct {
		check, quota, why string
	}{
		{check.CheckBound, "atlas", "a region given the full limit independently"},
		{check.CheckUnleased, "atlas", "admissions without any lease"},
		{check.CheckBound, "noclamp", "clamp off while the bound claims 0"},
		{check.CheckLateSpend, "late", "deadlines by a skewed wall clock"},
		{check.CheckDepositLate, "late", "grants kept spendable past the allocator's expiry"},
	}
	for _, w := range want {
		var found *check.Violation
		for i, v := range res.Violations {
			if v.Check == w.check && v.Quota == w.quota {
				found = &res.Violations[i]
				break
			}
		}
		if found == nil {
			t.Errorf("%s on %s (%s) was not reported", w.check, w.quota, w.why)
			continue
		}
		if w.check == check.CheckBound && !(strings.Contains(found.Detail, "admitted") && strings.Contains(found.Detail, "eu") && strings.Contains(found.Detail, "fault timeline")) {
			t.Errorf("bound violation lacks the window's ledgers or timeline:\n%s", found.Detail)
		}
	}
}
