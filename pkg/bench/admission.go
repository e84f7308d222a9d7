package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"runtime"
	"runtime/metrics"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/policy"
)

// The admission suite: the figures issue 3 asks for, measured in one run on
// one Redis.
//
//	raw        (a)  the admission script through go-redis, one EVALSHA per decision
//	pipelined  (a') the same script, Pipeline decisions per round trip
//	sdk        (b)  the SDK (Engine.Decide on a RedisStore), 1 rule per decision
//	sdk3            the SDK, 3 rules per decision (tenant, user, route)
//	paced           the SDK at half of sdk's maximum rate: the latency to quote
//	paced-raw       the script through go-redis, one EVALSHA per decision, at
//	                the paced mode's rate: the same load without the SDK, the
//	                control for the paced tail
//	paced3          the SDK with 3 rules at the paced mode's rate: what the
//	                two extra rules cost a caller in latency at one load
//	                (not in "all")
//	sdk13           sdk and sdk3 in alternate slices of one run (see
//	                Interleave): the 3-rule comparison with both sides
//	                meeting the same machine (not in "all")
//	stalls          no Redis: one spinner per CPU, counting the moments the
//	                machine took its CPU away (MeasureStalls), the floor
//	                under any paced tail on this machine
//
// Every mode reports Redis CPU microseconds per decision from INFO
// commandstats (the script's usec per call) and INFO cpu (the whole server,
// networking included), which are steadier than decisions per second on a
// shared machine.

// Modes lists the suite's modes in the order "all" runs them.
func Modes() []string {
	return []string{"raw", "pipelined", "sdk", "sdk3", "paced", "paced-raw", "stalls"}
}

// PacedTarget is issue 3's bound on the paced mode's p99; the paced modes
// count the calls over it by window (Config.SlowOver).
const PacedTarget = 2 * time.Millisecond

// stallsName names the stalls mode's figure.
const stallsName = "stalls of this machine"

// knownModes are the modes a list may name: Modes(), paced3 and sdk13.
func knownModes() []string { return append(Modes(), "paced3", "sdk13") }

// rawModes are the modes that send prepared script calls themselves.
var rawModes = []string{"raw", "pipelined", "paced-raw"}

// SuiteConfig configures the admission suite.
type SuiteConfig struct {
	// Modes to run, from Modes() and paced3; the paced modes without a Rate
	// need "sdk" first.
	Modes []string
	// Workers is the number of concurrent callers.
	Workers int
	// Keys is the number of distinct counters (users) requests spread over.
	Keys int
	// Requests and Duration bound each mode.
	Requests int64
	Duration time.Duration
	// Warmup runs before each measurement.
	Warmup time.Duration
	// Pipeline is the decisions per round trip of the pipelined mode.
	Pipeline int
	// Rate is the paced modes' rate; 0 means half of the sdk mode's.
	Rate float64
	// Sweep, when set, runs the paced modes once per fraction of the sdk
	// mode's rate (in (0, 1], e.g. 0.1, 0.25, 0.5, 0.75) instead of once at
	// Rate: latency against load, with the control beside the SDK.
	Sweep []float64
	// Interleave shapes the sdk13 mode's slices.
	Interleave Interleaving
	// Redis configures the SDK's store and batcher.
	Redis admission.RedisConfig
}

// DefaultSuiteConfig returns 64 workers over 10,000 keys, 10 s or 3 million
// calls per mode after 1 s of warmup, pipelines of 16.
func DefaultSuiteConfig() SuiteConfig {
	return SuiteConfig{
		Modes:      Modes(),
		Workers:    64,
		Keys:       10_000,
		Requests:   3_000_000,
		Duration:   10 * time.Second,
		Warmup:     time.Second,
		Pipeline:   16,
		Interleave: DefaultInterleaving,
		Redis:      admission.DefaultRedisConfig(),
	}
}

// checkModesAndKeys holds the checks every suite's config shares.
func checkModesAndKeys(modes, known []string, keys int) []error {
	var errs []error
	for _, m := range modes {
		if !slices.Contains(known, m) {
			errs = append(errs, fmt.Errorf("unknown mode %q; want one of %s", m, strings.Join(known, ", ")))
		}
	}
	if keys < 1 || keys > 10_000_000 {
		errs = append(errs, fmt.Errorf("Keys must be in [1, 1e7], got %d", keys))
	}
	return errs
}

// Validate says what is wrong with c, or returns nil.
func (c SuiteConfig) Validate() error {
	errs := checkModesAndKeys(c.Modes, knownModes(), c.Keys)
	if c.Pipeline < 1 || c.Pipeline > 1024 {
		errs = append(errs, fmt.Errorf("Pipeline must be in [1, 1024], got %d", c.Pipeline))
	}
	if err := (Config{Workers: c.Workers, Requests: c.Requests, Duration: c.Duration, Warmup: c.Warmup, Rate: c.Rate}).Validate(); err != nil {
		errs = append(errs, err)
	}
	if err := c.Redis.Validate(); err != nil {
		errs = append(errs, err)
	}
	if slices.Contains(c.Modes, "sdk13") {
		if err := c.Interleave.Validate(); err != nil {
			errs = append(errs, err)
		}
	}
	for _, f := range c.Sweep {
		if !(f > 0 && f <= 1) {
			errs = append(errs, fmt.Errorf("Sweep fractions must be in (0, 1], got %v", f))
		}
	}
	if len(c.Sweep) > 0 && c.Rate > 0 {
		errs = append(errs, errors.New("Sweep and Rate exclude each other: a sweep's rates are fractions of the sdk mode's"))
	}
	if len(c.Sweep) > 0 && !slices.Contains(c.Modes, "sdk") {
		errs = append(errs, errors.New(`Sweep needs the "sdk" mode, whose rate it divides`))
	}
	return errors.Join(errs...)
}

// Figure is one mode's result with the Redis CPU it cost.
type Figure struct {
	Result
	// ScriptUsec is the script's CPU time per call, from INFO commandstats
	// (cmdstat_evalsha usec_per_call).
	ScriptUsec float64
	// ServerUsec is the server's whole CPU time (user + sys, from INFO cpu)
	// per decision, networking included.
	ServerUsec float64
	// ProcessUsec is this process's CPU time (user + sys, getrusage) per
	// decision: the load generator plus, in the agent suite, the agent and
	// its clients. Like ServerUsec it is steadier than decisions/s when
	// other work shares the machine.
	ProcessUsec float64
	// AllocBytes is what this process allocated on the heap per decision,
	// and GCs the collector's cycles during the run: what drives a paced
	// run's tail (runtime/metrics; the same process as ProcessUsec).
	AllocBytes float64
	GCs        uint64
	// Rate is the rate a paced mode was run at; 0 for the others.
	Rate float64
	// Fraction is the share of the sdk mode's rate (the last sdk run
	// before it) a paced mode was run at; 0 when Config.Rate set the rate.
	Fraction float64
	// Stalls is the stalls mode's result; nil for the others.
	Stalls *Stalls
}

// String formats the figure on one line (the stalls mode's on one per CPU
// more).
func (f Figure) String() string {
	if f.Stalls != nil {
		return f.Stalls.String()
	}
	s := fmt.Sprintf("%s  redis cpu/decision: script %.2f us, server %.2f us; this process %.1f us, %.0f B allocated, %d GCs",
		f.Result, f.ScriptUsec, f.ServerUsec, f.ProcessUsec, f.AllocBytes, f.GCs)
	if a := f.ArrivalLine(); a != "" {
		s += "\n" + a
	}
	if sl := f.Slow.String(); sl != "" {
		s += fmt.Sprintf("\n%-28s %s", "", sl)
	}
	return s
}

const onePolicy = `
name: bench-1
rules:
  - name: user
    scope: user
    match: [{key: tenant}, {key: user}]
    kind: token_bucket
    capacity: 1000000000
    refill_per_second: 1000000
`

// ThreeRulePolicy is the 3-rule hierarchical policy (tenant bucket, user
// bucket, route window) the benchmarks decide against, with limits no load
// reaches, so every decision runs the whole script.
const ThreeRulePolicy = `
name: bench-3
rules:
  - name: tenant
    scope: tenant
    match: [{key: tenant}]
    kind: token_bucket
    capacity: 1000000000
    refill_per_second: 1000000
  - name: user
    scope: user
    match: [{key: tenant}, {key: user}]
    kind: token_bucket
    capacity: 1000000000
    refill_per_second: 1000000
  - name: route
    scope: route
    match: [{key: tenant}, {key: route}]
    kind: fixed_window
    limit: 1000000000
    window: 1m
`

// requests returns one request per key: 100 tenants, one user per key.
func requests(keys int) []*admission.Request {
	rs := make([]*admission.Request, keys)
	for i := range rs {
		rs[i] = &admission.Request{Descriptors: []policy.Entry{
			{Key: "tenant", Value: "t" + strconv.Itoa(i%100)},
			{Key: "user", Value: "u" + strconv.Itoa(i)},
			{Key: "route", Value: "GET /catalog"},
		}}
	}
	return rs
}

// keyOf spreads worker w's i-th call over n keys.
func keyOf(w int, i uint64, n int) int {
	return int((uint64(w)*7919 + i*104729) % uint64(n))
}

// RunSuite runs the admission suite against client, printing each figure to
// out as it is measured.
func RunSuite(ctx context.Context, client redis.UniversalClient, cfg SuiteConfig, out io.Writer) ([]Figure, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	store, err := admission.NewRedisStore(client, cfg.Redis)
	if err != nil {
		return nil, err
	}
	defer store.Close()
	if err := store.Load(ctx); err != nil {
		return nil, err
	}
	engines := map[string]*admission.Engine{}
	for name, src := range map[string]string{"1": onePolicy, "3": ThreeRulePolicy} {
		doc, err := policy.Parse([]byte(src))
		if err != nil {
			return nil, err
		}
		ecfg := admission.DefaultConfig()
		ecfg.Namespace = "bench" + name
		ecfg.StoreTimeout = time.Second // measure the store, not the fail modes
		ecfg.ExtraDescriptors = []string{"route"}
		e, err := admission.New(ecfg, store, doc, 1)
		if err != nil {
			return nil, err
		}
		defer e.Close()
		engines[name] = e
	}
	reqs := requests(cfg.Keys)
	// The raw modes' prepared calls (~8 MB of strings and argument lists
	// for 10,000 keys) exist only while those modes run: kept alive, they
	// would be marked by every GC cycle of the SDK modes, whose tail is what
	// the paced mode quotes.
	var calls []admission.ScriptCall
	sha := admission.ScriptSHA()
	base := Config{Workers: cfg.Workers, Requests: cfg.Requests, Duration: cfg.Duration, Warmup: cfg.Warmup}
	// Each worker decides into a Decision of its own, reused call after call
	// (Engine.DecideInto: how a gateway's hot path avoids a garbage
	// Decision per request).
	decide := func(e *admission.Engine) Target {
		ds := make([]admission.Decision, cfg.Workers)
		return func(ctx context.Context, w int, i uint64) error {
			d := &ds[w]
			err := e.DecideInto(ctx, reqs[keyOf(w, i, len(reqs))], d)
			switch {
			case err != nil:
				return err
			case !d.Allowed():
				return fmt.Errorf("%s by %s (source %s)", d.Outcome, d.Rule, d.Source)
			}
			return nil
		}
	}
	var figures []Figure
	var sdkRate float64
	pacedRate := func(fraction float64) (float64, error) {
		switch {
		case cfg.Rate > 0:
			return cfg.Rate, nil
		case sdkRate > 0:
			return sdkRate * fraction, nil
		}
		return 0, errors.New(`the paced modes need -rate or the "sdk" mode before them`)
	}
	for _, step := range sweepSteps(cfg.Modes, cfg.Sweep) {
		mode := step.mode
		switch raw := slices.Contains(rawModes, mode); {
		case raw && calls == nil:
			if calls, err = scriptCalls(engines["1"], reqs); err != nil {
				return figures, err
			}
		case !raw && calls != nil:
			calls = nil
			runtime.GC() // start the SDK modes without the raw modes' garbage
		}
		c := base
		c.Name = mode
		if strings.HasPrefix(mode, "paced") {
			c.SlowOver = PacedTarget
		}
		var target Target
		switch mode {
		case "stalls":
			st, err := MeasureStalls(ctx, c.Duration)
			if err != nil {
				return figures, fmt.Errorf("%s: %w", mode, err)
			}
			f := Figure{Result: Result{Name: stallsName, Elapsed: st.Elapsed}, Stalls: &st}
			figures = append(figures, f)
			fmt.Fprintln(out, f)
			continue
		case "raw":
			c.Name = "(a) raw, 1 call/decision"
			target = rawCall(client, sha, calls)
		case "paced-raw":
			if c.Rate, err = pacedRate(step.fraction); err != nil {
				return figures, err
			}
			c.Name = fmt.Sprintf("(a) raw paced at %.0f/s", c.Rate)
			target = rawCall(client, sha, calls)
		case "pipelined":
			c.Name = fmt.Sprintf("(a') pipelined x%d", cfg.Pipeline)
			c.OpsPerCall = cfg.Pipeline
			c.Requests = max(1, cfg.Requests/int64(cfg.Pipeline))
			target = func(ctx context.Context, w int, i uint64) error {
				pipe := client.Pipeline()
				for j := 0; j < cfg.Pipeline; j++ {
					k := calls[keyOf(w, i*uint64(cfg.Pipeline)+uint64(j), len(calls))]
					pipe.EvalSha(ctx, sha, k.Keys, k.Args...)
				}
				_, err := pipe.Exec(ctx)
				return err
			}
		case "sdk":
			c.Name = "(b) sdk, 1 rule"
			target = decide(engines["1"])
		case "sdk3":
			c.Name = "(b) sdk, 3 rules"
			target = decide(engines["3"])
		case "sdk13":
			r, err := Interleave(ctx, client, c, cfg.Interleave, [2]string{interleaved1, interleaved3},
				[2]Target{decide(engines["1"]), decide(engines["3"])})
			if err != nil {
				return figures, fmt.Errorf("%s: %w", mode, err)
			}
			fmt.Fprintln(out, r)
			for _, o := range r.Sides {
				figures = append(figures, Figure{Result: Result{Name: o.Name, Decisions: o.Decisions, Elapsed: o.Elapsed, PerSecond: o.PerSecond,
					Errors: r.Errors, FirstErr: r.FirstErr}, ScriptUsec: o.ScriptUsec, ServerUsec: o.ServerUsec, ProcessUsec: o.ProcessUsec})
			}
			continue
		case "paced", "paced3":
			if c.Rate, err = pacedRate(step.fraction); err != nil {
				return figures, err
			}
			c.Name = fmt.Sprintf("(b) sdk paced at %.0f/s", c.Rate)
			target = decide(engines["1"])
			if mode == "paced3" {
				c.Name = fmt.Sprintf("(b) sdk, 3 rules, paced at %.0f/s", c.Rate)
				target = decide(engines["3"])
			}
		}
		f, err := measure(ctx, client, c, target)
		if err != nil {
			return figures, fmt.Errorf("%s: %w", mode, err)
		}
		f.Rate = c.Rate
		if c.Rate > 0 && cfg.Rate == 0 {
			f.Fraction = step.fraction
		}
		if mode == "sdk" {
			sdkRate = f.PerSecond
		}
		figures = append(figures, f)
		fmt.Fprintln(out, f)
	}
	return figures, nil
}

// summarizeSweep prints the paced figures of a sweep by rate: the SDK's
// and the control's latency, from the scheduled start and from arrival.
func summarizeSweep(out io.Writer, paced, control []Figure) {
	fmt.Fprintln(out, "sweep (latency from the scheduled start; from arrival in brackets):")
	tw := tabwriter.NewWriter(out, 0, 4, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "rate/s\tsdk p50\tsdk p99\tcontrol p50\tcontrol p99\tcpu/decision sdk, control (this process + redis)\t")
	for i := range max(len(paced), len(control)) {
		var p, c *Figure
		if i < len(paced) {
			p = &paced[i]
		}
		if i < len(control) {
			c = &control[i]
		}
		lat := func(f *Figure) (string, string, string) {
			if f == nil {
				return "-", "-", "-"
			}
			return round(f.P50).String(), fmt.Sprintf("%s (%s)", round(f.P99), round(f.Arrival.P99)),
				fmt.Sprintf("%.1f us", f.ProcessUsec+f.ServerUsec)
		}
		rate := c
		if p != nil {
			rate = p
		}
		p50, p99, pcpu := lat(p)
		c50, c99, ccpu := lat(c)
		fmt.Fprintf(tw, "%.0f\t%s\t%s\t%s\t%s\t%s, %s\t\n", rate.Rate, p50, p99, c50, c99, pcpu, ccpu)
	}
	_ = tw.Flush()
}

// summarizePacedRuns prints how many of the paced runs at half of the sdk
// rate before them (as -repeat runs them) kept p99 under PacedTarget: the
// target's reliability on this machine, in one command.
func summarizePacedRuns(out io.Writer, paced []Figure) {
	var p99s []string
	var ms []float64
	under := 0
	for _, f := range paced {
		if f.Fraction != 0.5 || f.Calls == 0 {
			continue
		}
		if f.P99 < PacedTarget {
			under++
		}
		p99s = append(p99s, round(f.P99).String())
		ms = append(ms, float64(f.P99))
	}
	if len(ms) < 2 {
		return
	}
	fmt.Fprintf(out, "  paced p99 at half of the sdk rate before it: under %s in %d of %d runs (%s; median %s)\n",
		PacedTarget, under, len(ms), strings.Join(p99s, ", "), round(time.Duration(median(ms))))
}

// sweepStep is one mode to run; the paced modes run at fraction of the sdk
// mode's rate.
type sweepStep struct {
	mode     string
	fraction float64
}

// sweepSteps lists the modes in order, the paced ones at half of the sdk
// mode's rate, or, with fractions, once per fraction (the paced modes of
// modes together at each).
func sweepSteps(modes []string, fractions []float64) []sweepStep {
	var steps, paced []sweepStep
	for _, m := range modes {
		if len(fractions) > 0 && (m == "paced" || m == "paced-raw" || m == "paced3") {
			paced = append(paced, sweepStep{m, 0.5})
			continue
		}
		steps = append(steps, sweepStep{m, 0.5})
	}
	for _, f := range fractions {
		for _, p := range paced {
			steps = append(steps, sweepStep{p.mode, f})
		}
	}
	return steps
}

// rawCall sends a prepared script call straight through go-redis, one
// EVALSHA per decision.
func rawCall(client redis.UniversalClient, sha string, calls []admission.ScriptCall) Target {
	return func(ctx context.Context, w int, i uint64) error {
		k := calls[keyOf(w, i, len(calls))]
		return client.EvalSha(ctx, sha, k.Keys, k.Args...).Err()
	}
}

// measure runs one mode between two readings of the server's statistics.
func measure(ctx context.Context, client redis.UniversalClient, c Config, target Target) (Figure, error) {
	if c.Warmup > 0 { // warm up outside the statistics window
		w := c
		w.Duration, w.Warmup, w.Requests = c.Warmup, 0, max(1, c.Requests/10)
		if _, err := Run(ctx, w, target); err != nil {
			return Figure{}, err
		}
		c.Duration -= min(c.Warmup, c.Duration/2)
		c.Warmup = 0
	}
	if err := client.ConfigResetStat(ctx).Err(); err != nil {
		return Figure{}, fmt.Errorf("CONFIG RESETSTAT: %w", err)
	}
	cpu0, err := serverCPU(ctx, client)
	if err != nil {
		return Figure{}, err
	}
	self0 := processCPU()
	gc0, alloc0 := gcStats()
	r, err := Run(ctx, c, target)
	if err != nil {
		return Figure{}, err
	}
	self := processCPU() - self0
	gc1, alloc1 := gcStats()
	cpu1, err := serverCPU(ctx, client)
	if err != nil {
		return Figure{}, err
	}
	f := Figure{Result: r, GCs: gc1 - gc0}
	calls, usec, err := scriptStats(ctx, client)
	if err != nil {
		return Figure{}, err
	}
	if calls > 0 {
		f.ScriptUsec = usec / calls
	}
	if r.Decisions > 0 {
		f.ServerUsec = (cpu1 - cpu0) * 1e6 / float64(r.Decisions)
		f.ProcessUsec = self.Seconds() * 1e6 / float64(r.Decisions)
		f.AllocBytes = float64(alloc1-alloc0) / float64(r.Decisions)
	}
	return f, nil
}

// lastIndex returns the index of the last of modes that is one of names,
// or -1.
func lastIndex(modes []string, names ...string) int {
	last := -1
	for i, m := range modes {
		if slices.Contains(names, m) {
			last = i
		}
	}
	return last
}

// scriptCalls prepares the raw modes' script call for each request, as the
// engine e would send it.
func scriptCalls(e *admission.Engine, reqs []*admission.Request) ([]admission.ScriptCall, error) {
	calls := make([]admission.ScriptCall, len(reqs))
	for i, r := range reqs {
		c, err := e.ScriptCalls(r)
		if err != nil || len(c) != 1 {
			return nil, fmt.Errorf("script call for key %d: %v (%d calls)", i, err, len(c))
		}
		calls[i] = c[0]
	}
	return calls, nil
}

// gcStats returns the collector's cycles so far and the bytes this process
// has allocated on the heap so far.
func gcStats() (cycles, allocated uint64) {
	s := []metrics.Sample{{Name: "/gc/cycles/total:gc-cycles"}, {Name: "/gc/heap/allocs:bytes"}}
	metrics.Read(s)
	if s[0].Value.Kind() == metrics.KindUint64 {
		cycles = s[0].Value.Uint64()
	}
	if s[1].Value.Kind() == metrics.KindUint64 {
		allocated = s[1].Value.Uint64()
	}
	return cycles, allocated
}

// processCPU is the CPU time (user + sys) this process has used.
func processCPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// info returns the fields of an INFO section.
func info(ctx context.Context, client redis.UniversalClient, section string) (map[string]string, error) {
	s, err := client.Info(ctx, section).Result()
	if err != nil {
		return nil, fmt.Errorf("INFO %s: %w", section, err)
	}
	m := map[string]string{}
	sc := bufio.NewScanner(strings.NewReader(s))
	for sc.Scan() {
		if k, v, ok := strings.Cut(strings.TrimSpace(sc.Text()), ":"); ok {
			m[k] = v
		}
	}
	return m, nil
}

// serverCPU is the server's user + sys CPU seconds.
func serverCPU(ctx context.Context, client redis.UniversalClient) (float64, error) {
	m, err := info(ctx, client, "cpu")
	if err != nil {
		return 0, err
	}
	u, err1 := strconv.ParseFloat(m["used_cpu_user"], 64)
	s, err2 := strconv.ParseFloat(m["used_cpu_sys"], 64)
	if err1 != nil || err2 != nil {
		return 0, fmt.Errorf("INFO cpu: used_cpu_user %q used_cpu_sys %q", m["used_cpu_user"], m["used_cpu_sys"])
	}
	return u + s, nil
}

// scriptStats returns the EVALSHA and EVAL calls and their CPU microseconds
// since the last CONFIG RESETSTAT.
func scriptStats(ctx context.Context, client redis.UniversalClient) (calls, usec float64, err error) {
	m, err := info(ctx, client, "commandstats")
	if err != nil {
		return 0, 0, err
	}
	for _, cmd := range []string{"cmdstat_evalsha", "cmdstat_eval"} {
		for _, kv := range strings.Split(m[cmd], ",") {
			k, v, _ := strings.Cut(kv, "=")
			n, _ := strconv.ParseFloat(v, 64)
			switch k {
			case "calls":
				calls += n
			case "usec":
				usec += n
			}
		}
	}
	return calls, usec, nil
}

// The names of the sdk13 mode's sides.
const (
	interleaved1 = "(b) sdk, 1 rule, interleaved"
	interleaved3 = "(b) sdk, 3 rules, interleaved"
)

// ruleRatios is one comparison of a 3-rule run with a 1-rule run: time per
// decision, script CPU, server CPU, and this process's CPU plus the server's.
type ruleRatios [4]float64

// summarizeRules compares the 3-rule runs with the 1-rule runs, pair by
// pair in the order they ran (-mode sdk,sdk3,sdk,sdk3,...: each pair ran
// close together, so the machine's slow spells touch both more evenly; or
// the two sides of each sdk13 run, kind " (interleaved)"), and prints the
// median of each ratio when there is more than one pair.
func summarizeRules(out io.Writer, kind string, ones, threes []Figure) {
	var rs []ruleRatios
	for i := 0; i < min(len(ones), len(threes)); i++ {
		one, three := ones[i], threes[i]
		if three.PerSecond <= 0 || one.ScriptUsec <= 0 || one.ServerUsec <= 0 {
			continue
		}
		rs = append(rs, ruleRatios{
			one.PerSecond / three.PerSecond,
			three.ScriptUsec / one.ScriptUsec,
			three.ServerUsec / one.ServerUsec,
			(three.ProcessUsec + three.ServerUsec) / (one.ProcessUsec + one.ServerUsec),
		})
	}
	const line = "  3 rules vs 1%s: time per decision x%.2f, script cpu x%.2f, server cpu x%.2f, cpu of this process and the server x%.2f (target < 1.5)\n"
	for i, r := range rs {
		label := kind
		if len(rs) > 1 {
			label = fmt.Sprintf("%s, pair %d", kind, i+1)
		}
		fmt.Fprintf(out, line, label, r[0], r[1], r[2], r[3])
	}
	if len(rs) > 1 {
		var med ruleRatios
		for k := range med {
			v := make([]float64, len(rs))
			for i, r := range rs {
				v[i] = r[k]
			}
			med[k] = median(v)
		}
		fmt.Fprintf(out, line, fmt.Sprintf("%s, median of %d pairs", kind, len(rs)), med[0], med[1], med[2], med[3])
	}
}

// median returns the median of v (the mean of the middle two when even);
// it sorts v.
func median(v []float64) float64 {
	slices.Sort(v)
	n := len(v)
	if n%2 == 1 {
		return v[n/2]
	}
	return (v[n/2-1] + v[n/2]) / 2
}

// Summarize prints the comparisons issue 3 targets: (b) against (a), 3 rules
// against 1, and the paced p99; after a sweep, the paced figures by rate.
func Summarize(out io.Writer, figs []Figure) {
	by := map[string]Figure{}
	var paced, control, ones, threes, ones13, threes13 []Figure
	for _, f := range figs {
		switch {
		case strings.HasPrefix(f.Name, "(a) raw paced"):
			by["paced-raw"] = f
			control = append(control, f)
		case strings.HasPrefix(f.Name, "(a) "):
			by["raw"] = f
		case strings.HasPrefix(f.Name, "(a') "):
			by["pipelined"] = f
		case f.Name == "(b) sdk, 1 rule":
			by["sdk"] = f
			ones = append(ones, f)
		case f.Name == "(b) sdk, 3 rules":
			threes = append(threes, f)
		case f.Name == interleaved1:
			ones13 = append(ones13, f)
		case f.Name == interleaved3:
			threes13 = append(threes13, f)
		case strings.HasPrefix(f.Name, "(b) sdk, 3 rules, paced"):
			by["paced3"] = f
		case strings.HasPrefix(f.Name, "(b) sdk paced"):
			by["paced"] = f
			paced = append(paced, f)
		case f.Stalls != nil:
			by["stalls"] = f
		}
	}
	fmt.Fprintln(out, "summary:")
	if a, ok := by["raw"]; ok {
		if b, ok := by["sdk"]; ok && a.PerSecond > 0 {
			fmt.Fprintf(out, "  (b)/(a) throughput: %.2f (target >= 1)\n", b.PerSecond/a.PerSecond)
		}
	}
	if a, ok := by["pipelined"]; ok {
		if b, ok := by["sdk"]; ok && a.PerSecond > 0 {
			fmt.Fprintf(out, "  (b)/(a') throughput: %.2f\n", b.PerSecond/a.PerSecond)
		}
	}
	summarizeRules(out, "", ones, threes)
	summarizeRules(out, " (interleaved)", ones13, threes13)
	if len(paced) > 1 || len(control) > 1 {
		summarizeSweep(out, paced, control)
		summarizePacedRuns(out, paced)
		return
	}
	if p, ok := by["paced"]; ok {
		fmt.Fprintf(out, "  paced p99: %s from the scheduled start, %s from arrival (the generator's timer lag, p99 %s, left out) (target < %s)\n",
			round(p.P99), round(p.Arrival.P99), round(p.Lag.P99), PacedTarget)
		if p.Slow.Over > 0 && p.Calls > 0 {
			fmt.Fprintf(out, "  paced calls of %s and more: %.2f%% of the calls, in %d of %d %s windows\n",
				p.Slow.Over, 100*float64(p.Slow.Calls)/float64(p.Calls), p.Slow.Windows, p.Slow.Spanned, slowWindow)
		}
		if p3, ok := by["paced3"]; ok && p.P50 > 0 && p.P99 > 0 && p3.Rate == p.Rate {
			behind := ""
			if p3.PerSecond < 0.95*p3.Rate {
				behind = fmt.Sprintf(" (3 rules did not keep up: %.0f of %.0f/s)", p3.PerSecond, p3.Rate)
			}
			fmt.Fprintf(out, "  3 rules vs 1 at %.0f/s: p50 %s vs %s (x%.2f), p99 %s vs %s (x%.2f); cpu of this process and the server %.1f vs %.1f us (x%.2f)%s\n",
				p.Rate, round(p3.P50), round(p.P50), float64(p3.P50)/float64(p.P50), round(p3.P99), round(p.P99), float64(p3.P99)/float64(p.P99),
				p3.ProcessUsec+p3.ServerUsec, p.ProcessUsec+p.ServerUsec, (p3.ProcessUsec+p3.ServerUsec)/(p.ProcessUsec+p.ServerUsec), behind)
		}
	}
	if st, ok := by["stalls"]; ok {
		fmt.Fprintf(out, "  this machine with its %d CPUs busy: its stalls alone delay at least %.2f%% of evenly paced calls by %s or more (the paced p99 is under %s only if this is well under 1%%)\n",
			len(st.Stalls.CPUs), 100*st.Stalls.ShareBeyond(PacedTarget), PacedTarget, PacedTarget)
	}
	if r, ok := by["paced-raw"]; ok {
		fmt.Fprintf(out, "  the same load without the SDK (go-redis, 1 EVALSHA per decision): p50 %s, p99 %s from the scheduled start, %s from arrival; redis server %.2f us, this process %.1f us per decision\n",
			round(r.P50), round(r.P99), round(r.Arrival.P99), r.ServerUsec, r.ProcessUsec)
	}
}
