package chaos

import (
	"context"
	"flag"
	"fmt"
	"os"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/allot-dev/allot/chaos/check"
	"github.com/allot-dev/allot/chaos/history"
	"github.com/allot-dev/allot/pkg/topology"
)

var (
	soakFlag = flag.Duration("chaos.soak", 0, "run random fault schedules for this long instead of the short schedule (raise -timeout to match)")
	seedFlag = flag.Int64("chaos.seed", 0, "seed of the run's random choices (0: from the time; printed either way)")
	onlyFlag = flag.String("chaos.scenarios", "", "comma-separated scenarios to run instead of all of them (short schedule only)")
	histFlag = flag.Bool("chaos.history", false, "write the whole history to chaos/out/history.jsonl even when every check passes")
	profFlag = flag.Bool("chaos.pauseprofiles", false, "keep CPU profiles of the test process around each of its pauses of 0.5 s or more in chaos/out/logs (pause-<end>-<n>.pprof)")
	kindFlag = flag.String("chaos.regions", RegionAgent, "what runs each region of TestChaos: agent (regionagent + redis-server + load generator) or driver (the chaosregion driver)")
)

// shapingFlags are the flags that shape a TestChaos run, all of which a
// replay needs (-chaos.history only adds output).
var shapingFlags = []string{"chaos.seed", "chaos.soak", "chaos.scenarios", "chaos.regions"}

// outputFlags are the chaos flags that only add output, which a replay
// need not repeat.
var outputFlags = []string{"chaos.history", "chaos.pauseprofiles"}

// runSeed returns the run's seed and logs it with the command that replays
// the run: the seed and the value of every flag in shaping.
func runSeed(t *testing.T, shaping ...string) (int64, string) {
	seed := *seedFlag
	if seed == 0 {
		seed = time.Now().UnixNano() % 1_000_000_000
	}
	replay := replayCommand(t.Name(), seed, shaping)
	t.Logf("seed %d (replay: %s)", seed, replay)
	return seed, replay
}

// replayCommand is the go test command that runs test as this run did:
// with seed, and every flag of names at its value in this run (a soak also
// gets a -timeout that fits it).
func replayCommand(test string, seed int64, names []string) string {
	args := []string{"go test ./chaos -run '" + test + "$'", "-chaos.seed=" + strconv.FormatInt(seed, 10)}
	for _, n := range names {
		f := flag.Lookup(n)
		if n == "chaos.seed" || f == nil {
			continue
		}
		args = append(args, "-"+n+"="+shellQuote(f.Value.String()))
	}
	if slices.Contains(names, "chaos.soak") && *soakFlag > 0 {
		args = append(args, "-timeout="+(*soakFlag+15*time.Minute).String())
	}
	return strings.Join(args, " ")
}

// shellQuote quotes v for a POSIX shell when it needs it.
func shellQuote(v string) string {
	if v != "" && strings.Trim(v, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.,:/=+") == "" {
		return v
	}
	return "'" + strings.ReplaceAll(v, "'", `'\''`) + "'"
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
	seed, replay := runSeed(t, shapingFlags...)
	began := time.Now()
	cfg := DefaultConfig(seed)
	cfg.RegionKind = *kindFlag
	cfg.PauseProfiles = *profFlag
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
	steps, until := ShortSchedule(seed), time.Now().Add(time.Hour)
	if *onlyFlag != "" {
		var scs []Scenario
		for _, name := range strings.Split(*onlyFlag, ",") {
			i := slices.IndexFunc(Scenarios(), func(sc Scenario) bool { return sc.Name == name })
			if i < 0 {
				t.Fatalf("-chaos.scenarios: no scenario %q", name)
			}
			scs = append(scs, Scenarios()[i])
		}
		steps = FixedSchedule(seed, scs)
	}
	if *soakFlag > 0 {
		// A step takes at least two windows: this many always fill the soak.
		steps = RandomSchedule(seed, int(*soakFlag/(2*s.cfg.Window))+1, s.cfg.RegionKind == RegionAgent)
		until = time.Now().Add(*soakFlag)
	}
	// One calm window first.
	if err := s.waitUntil(ctx, s.nextBoundary(s.cfg.Window)); err != nil {
		t.Fatal(err)
	}
	runErr := s.RunSchedule(ctx, steps, until)
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
	report, err := s.Report("report.txt", "allot chaos: "+scheduleName(steps)+"\nreplay: "+replay, h, res, time.Since(began))
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
	if d := s.WallClockStep(); d.Abs() > maxWallStep {
		// The processes stamp leases and ledgers with the wall clock, the
		// checkers judge them on CLOCK_MONOTONIC: a step of the machine's
		// clock (NTP, the hypervisor) beyond the lease margins shifts one
		// against the other, so the verdict of the checks that compare the
		// two is void, whether they found violations (a step can make
		// one) or not (a step can hide one): see wallStepVerdict.
		msg := fmt.Sprintf("the machine's wall clock stepped %s against CLOCK_MONOTONIC during the run (more than %s)", d, maxWallStep)
		ci := os.Getenv("CI") != ""
		switch wallStepVerdict(d, res.Violations, ci) {
		case wallVoid:
			t.Skipf("%s: the verdict of the checks that compare wall-clock stamps is void (%d violations); replay: %s", msg, len(res.Violations), replay)
		case wallFail:
			t.Errorf("%s: under CI a run whose clock checks are void fails, with %d violations or none", msg, len(res.Violations))
		default:
			t.Logf("%s, but %d of %d violations stand (checks that compare no wall-clock stamp)", msg, standing(res.Violations, ci), len(res.Violations))
		}
	}
	if s.cfg.RegionKind == RegionAgent && s.cfg.NewRegion == nil && s.GRPCChunks() == 0 {
		t.Errorf("the agents' leases never crossed the allocators' gRPC listeners")
	}
	// The checkers must have had something to check.
	if v := res.Vacuous(); len(v) > 0 {
		t.Fatalf("vacuous history: %s (%d grants, %d ledger reads, %d replays, %d deposit deadlines checked)",
			strings.Join(v, "; "), res.Grants, res.LedgerReads, res.Replays, res.DepositsChecked)
	}
	for _, q := range s.Quotas() {
		if l := res.Linearizability[q.Name]; l.Windows == 0 || len(l.Unknown) > 0 {
			t.Errorf("quota %s: linearizability checked %d windows, undecided in %v", q.Name, l.Windows, l.Unknown)
		}
	}
	for _, msg := range loadErrors(h, res, s.Quotas(), s.cfg.Regions, s.CheckParams().FaultGrace) {
		t.Error(msg)
	}
	if s.cfg.RegionKind == RegionAgent { // the driver has no fallback
		for _, msg := range fallbackErrors(h, res, s.Quotas(), s.CheckParams().FaultGrace) {
			t.Error(msg)
		}
	}
	if !res.OK() {
		t.Errorf("%d violations (listed in the report above and in chaos/out/report.txt)", len(res.Violations))
	}
}

// loadErrors says where a run's load left the checks nothing to bite on
// (empty when it did not). The bound check fails only in a window offered
// more than G + the bound, so an allocator granting twice G passes every
// run whose load stays below G: each quota that is not a Birch (a
// contended quota, like Atlas) must have had at least one calm window (no
// fault span, extended by grace, touches it) whose measured offered load,
// admitted + denied, exceeded G + the bound and in which requests were
// denied. And every region must have admitted something of every quota:
// a region that never admits has checked nothing of its own leases. The
// load is measured from the answers, not taken from the configured demand.
func loadErrors(h history.History, res *check.Result, quotas []check.Quota, regions []string, grace time.Duration) []string {
	var out []string
	for _, q := range quotas {
		l := check.MeasureLoad(h, res, q, grace)
		for _, r := range regions {
			if l.Admitted[r] == 0 {
				out = append(out, fmt.Sprintf("quota %s: region %s admitted nothing over the run", q.Name, r))
			}
		}
		if !q.Birch && l.Contended == 0 {
			out = append(out, fmt.Sprintf("quota %s: no calm window was offered more than G + bound = %d and denied some (%s): the bound check could not fail; raise the quota's demand",
				q.Name, q.Ceiling(), l))
		}
	}
	return out
}

// fallbackErrors says where a fallback quota's allowance went unexercised
// (empty when it did not): when a scenario cut regions off from the
// allocators (Span.CutOff), a quota with a fallback allowance must have
// admitted from it in at least one window such a span touches, in a region
// it cut off. Otherwise the agent's cut-off path (the allowance deposited
// by the leader's clock) ran through the fault unchecked: the checks that
// hold it to its allowance (spent_without_lease) and to G + the stated
// bound (bound) had nothing of it to bite on.
func fallbackErrors(h history.History, res *check.Result, quotas []check.Quota, grace time.Duration) []string {
	var out []string
	for _, q := range quotas {
		if q.FallbackPerRegion <= 0 {
			continue
		}
		if f := check.MeasureFallback(h, res, q, grace); f.CutOffSpans > 0 && f.CutOff == 0 {
			out = append(out, fmt.Sprintf("quota %s: no region admitted from its fallback allowance while cut off from the allocators (%s): the fallback path was not exercised",
				q.Name, f))
		}
	}
	return out
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
// (wall clock); deposit_unknown holds a deposit's times (the agent's wall
// clock) to the store faults' spans (true clock); window_reopened and
// birch_denied follow the allocator's and agents' windows; the fallback
// checks hold an allowance's times (the agent's wall clock) to its window
// (the allocators') and to the agent's Acquire attempts, milliseconds
// apart.
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

// The verdicts of wallStepVerdict.
const (
	// wallStands: no step beyond maxWallStep, or violations of clockFree
	// checks fail the run whatever the clock did.
	wallStands = iota
	// wallVoid: the run is skipped (outside CI): the checks that compare
	// wall-clock stamps with the true clock judged nothing.
	wallVoid
	// wallFail: the run fails (under CI), violations or none.
	wallFail
)

// wallStepVerdict says what a wall-clock step of d, the largest sampled
// during a run with violations vs, does to the run. A step voids the
// checks that compare wall-clock stamps with the true clock whether they
// found violations or not (it can make one as easily as hide one), so a
// run with such a step: under CI (ci) fails; outside CI is skipped, unless
// violations of the clockFree checks stand, which fail it anyway.
func wallStepVerdict(d time.Duration, vs []check.Violation, ci bool) int {
	switch {
	case d.Abs() <= maxWallStep:
		return wallStands
	case ci:
		return wallFail
	case standing(vs, false) > 0:
		return wallStands
	}
	return wallVoid
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
	// The verdict on the whole run: a step voids a passing run too (it can
	// hide a violation as easily as make one).
	step := maxWallStep + time.Millisecond
	free := []check.Violation{{Check: check.CheckDoubleGrant}}
	tests := []struct {
		name string
		d    time.Duration
		vs   []check.Violation
		ci   bool
		want int
	}{
		{name: "no step, passing", d: maxWallStep, want: wallStands},
		{name: "no step, failing", d: -maxWallStep, vs: clocky, want: wallStands},
		{name: "step, passing, outside CI", d: step, want: wallVoid},
		{name: "step back, passing, outside CI", d: -step, want: wallVoid},
		{name: "step, passing, under CI", d: step, ci: true, want: wallFail},
		{name: "step, clock violations only, outside CI", d: step, vs: clocky, want: wallVoid},
		{name: "step, clock violations only, under CI", d: step, vs: clocky, ci: true, want: wallFail},
		{name: "step, a clock-free violation, outside CI", d: step, vs: append(clocky, free...), want: wallStands},
	}
	for _, tt := range tests {
		if got := wallStepVerdict(tt.d, tt.vs, tt.ci); got != tt.want {
			t.Errorf("%s: verdict %d, want %d", tt.name, got, tt.want)
		}
	}
	// The step is the largest sampled during the run, not what is left of
	// it at the end: a step undone before the end still counts.
	var ds driftSamples
	for _, v := range []time.Duration{2 * time.Microsecond, -30 * time.Millisecond, 5 * time.Millisecond, time.Microsecond} {
		ds.add(v)
	}
	if worst, n := ds.max(); worst != -30*time.Millisecond || n != 4 {
		t.Errorf("largest drift sampled = %s of %d samples, want -30ms of 4", worst, n)
	}
	if got := wallStepVerdict(mustWorst(&ds), nil, false); got != wallVoid {
		t.Errorf("a passing run whose clock stepped 30 ms and back: verdict %d, want void (%d)", got, wallVoid)
	}
}

func mustWorst(d *driftSamples) time.Duration {
	w, _ := d.max()
	return w
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
	seed, _ := runSeed(t, "chaos.seed")
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

// TestReplayCommandNamesEveryFlag: the replay command a run prints sets
// every flag that shapes the run, at the value this run had.
func TestReplayCommandNamesEveryFlag(t *testing.T) {
	flag.VisitAll(func(f *flag.Flag) {
		if strings.HasPrefix(f.Name, "chaos.") && !slices.Contains(outputFlags, f.Name) && !slices.Contains(shapingFlags, f.Name) {
			t.Errorf("flag -%s is neither in shapingFlags nor known to only add output", f.Name)
		}
	})
	set := map[string]string{"chaos.soak": "12m0s", "chaos.scenarios": "stop-leader,membership", "chaos.regions": "driver"}
	for n, v := range set {
		old := flag.Lookup(n).Value.String()
		if err := flag.Set(n, v); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = flag.Set(n, old) })
	}
	got := replayCommand("TestChaos", 1234, shapingFlags)
	for _, want := range []string{"-run 'TestChaos$'", "-chaos.seed=1234", "-chaos.soak=12m0s", "-chaos.scenarios=stop-leader,membership",
		"-chaos.regions=driver", "-timeout=27m0s"} {
		if !strings.Contains(got, want) {
			t.Errorf("replay command %q lacks %q", got, want)
		}
	}
	if got := replayCommand("TestCheckerCatchesBrokenConfig", 7, []string{"chaos.seed"}); got != "go test ./chaos -run 'TestCheckerCatchesBrokenConfig$' -chaos.seed=7" {
		t.Errorf("broken-config replay %q", got)
	}
	if got := shellQuote(""); got != "''" {
		t.Errorf("an empty value quoted %q, want ''", got)
	}
}

// TestSampleDrift: on a machine whose wall clock does not step, a drift
// sample is within a millisecond of 0.
func TestSampleDrift(t *testing.T) {
	c := history.NewTrueClock()
	d, ok := sampleDrift(c)
	if !ok {
		t.Skip("no sample within the bracket (a loaded machine)")
	}
	if d.Abs() > time.Millisecond {
		t.Errorf("drift sampled right after the offset was measured: %s, want within 1ms", d)
	}
}

// TestLoadErrors: loadErrors objects to a run whose contended quota was
// never offered more than G + bound in a calm window (with denials), and to
// a region that admitted nothing of a quota; a Birch is never required to
// be contended.
func TestLoadErrors(t *testing.T) {
	const sec = int64(time.Second)
	atlas := check.Quota{Name: "atlas", Limit: 100, WindowMs: 1000}
	birch := check.Quota{Name: "birch", Limit: 10000, WindowMs: 1000, Birch: true}
	ev := func(kind history.Kind, quota, region string, n, at int64) history.Event {
		e := history.Event{Kind: kind, Quota: quota, Region: region, Tokens: n, At: at}
		if kind == history.KindDeny {
			e.Reason = history.ReasonLimited
		}
		return e
	}
	// Window 10: atlas offered 130 (eu 80 + us 20 admitted, 30 denied);
	// birch admitted in both regions.
	contended := []history.Event{
		ev(history.KindAdmit, "atlas", "eu", 80, 10*sec+100_000_000),
		ev(history.KindAdmit, "atlas", "us", 20, 10*sec+100_000_000),
		ev(history.KindDeny, "atlas", "eu", 30, 10*sec+200_000_000),
		ev(history.KindAdmit, "birch", "eu", 5, 10*sec+100_000_000),
		ev(history.KindAdmit, "birch", "us", 5, 10*sec+100_000_000),
	}
	// The same load at a fifth: atlas never above G.
	light := []history.Event{
		ev(history.KindAdmit, "atlas", "eu", 16, 10*sec+100_000_000),
		ev(history.KindAdmit, "atlas", "us", 4, 10*sec+100_000_000),
		ev(history.KindAdmit, "birch", "eu", 1, 10*sec+100_000_000),
		ev(history.KindAdmit, "birch", "us", 1, 10*sec+100_000_000),
	}
	tests := []struct {
		name    string
		events  []history.Event
		spans   []history.Span
		regions []string
		want    []string
	}{
		{name: "contended", events: contended, regions: []string{"eu", "us"}},
		{name: "load below G", events: light, regions: []string{"eu", "us"}, want: []string{"quota atlas: no calm window"}},
		{name: "contended only in a fault", events: contended, regions: []string{"eu", "us"},
			spans: []history.Span{{Scenario: "stop-leader", Start: 10 * sec, End: 10*sec + 500_000_000}}, want: []string{"quota atlas: no calm window"}},
		{name: "a region that admitted nothing", events: contended, regions: []string{"ap", "eu", "us"},
			want: []string{"quota atlas: region ap admitted nothing", "quota birch: region ap admitted nothing"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := history.History{Events: tt.events, Spans: tt.spans}
			p := check.Params{Quotas: []check.Quota{atlas, birch}, FaultGrace: time.Second}
			res := check.Run(h, p)
			got := loadErrors(h, res, p.Quotas, tt.regions, p.FaultGrace)
			if len(got) != len(tt.want) {
				t.Fatalf("loadErrors = %q, want %d errors starting %q", got, len(tt.want), tt.want)
			}
			for i, w := range tt.want {
				if !strings.HasPrefix(got[i], w) {
					t.Errorf("error %d = %q, want it to start %q", i, got[i], w)
				}
			}
		})
	}
}

// TestLoadErrorsFallback: fallbackErrors objects to a run whose cut-off
// spans saw no admission from a fallback quota's allowance in a region they
// cut off, and says nothing of a run with no cut-off or a fail-closed quota.
func TestLoadErrorsFallback(t *testing.T) {
	const sec = int64(time.Second)
	cedar := check.Quota{Name: "cedar", Limit: 100, WindowMs: 1000, Bound: 20, FallbackPerRegion: 10}
	closed := check.Quota{Name: "atlas", Limit: 100, WindowMs: 1000}
	cut := func(region string) history.Span {
		return history.Span{Scenario: "partition-region", Start: 10 * sec, End: 12 * sec, Regions: []string{region}, CutOff: true}
	}
	// eu admits 5 of cedar in window 11 with no grant: its allowance.
	fallback := []history.Event{{Kind: history.KindAdmit, Quota: "cedar", Region: "eu", Tokens: 5, At: 11*sec + 100_000_000}}
	tests := []struct {
		name   string
		events []history.Event
		spans  []history.Span
		quotas []check.Quota
		want   int
	}{
		{name: "allowance used in the cut-off region", events: fallback, spans: []history.Span{cut("eu")}, quotas: []check.Quota{cedar, closed}},
		{name: "allowance unused", spans: []history.Span{cut("eu")}, quotas: []check.Quota{cedar, closed}, want: 1},
		{name: "allowance used only by a region not cut off", events: fallback, spans: []history.Span{cut("us")}, quotas: []check.Quota{cedar}, want: 1},
		{name: "no cut-off ran", events: fallback, spans: []history.Span{{Scenario: "stop-leader", Start: 10 * sec, End: 12 * sec}}, quotas: []check.Quota{cedar}},
		{name: "a skipped cut-off", spans: []history.Span{{Scenario: "partition-region", Start: 10 * sec, End: 10 * sec, CutOff: true, Skipped: "skipped"}}, quotas: []check.Quota{cedar}},
		{name: "fail closed", spans: []history.Span{cut("eu")}, quotas: []check.Quota{closed}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := history.History{Events: tt.events, Spans: tt.spans}
			res := check.Run(h, check.Params{Quotas: tt.quotas, FaultGrace: time.Second})
			if got := fallbackErrors(h, res, tt.quotas, time.Second); len(got) != tt.want {
				t.Fatalf("fallbackErrors = %q, want %d", got, tt.want)
			}
		})
	}
}
