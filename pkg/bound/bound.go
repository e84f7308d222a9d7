package bound

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
	"strings"
	"time"

	"github.com/allot-dev/allot/internal/satmath"
	"github.com/allot-dev/allot/pkg/lease"
	"github.com/allot-dev/allot/pkg/policy"
)

// ErrInvalidConfig is wrapped by Config.Validate for a config whose bound
// would be meaningless (non-positive limit, negative assumptions, ...).
var ErrInvalidConfig = errors.New("invalid bound config")

// The names of the terms, in the order Calculate reports them.
const (
	// TermCarryOver counts tokens granted in one window and spent in the next.
	TermCarryOver = "carry_over"
	// TermFallback counts local admissions of regions cut off from the allocator.
	TermFallback = "fallback"
	// TermStoreFallback counts the admissions gateways make in process while
	// their regional store fails or is slow.
	TermStoreFallback = "store_fallback"
	// TermLostGrants counts grants an allocator failover forgets and re-grants.
	TermLostGrants = "lost_grants"
	// TermTiming counts tokens spent past the allocator's expiry because of
	// clock drift, delays and skew between successive leaders.
	TermTiming = "timing"
	// TermStoreRollback counts debits a regional store failover forgets.
	TermStoreRollback = "store_rollback"
)

// Config is one leased quota plus the assumptions its bound rests on. The
// zero value of an assumption is the pessimistic choice where that is safe
// (no quorum commit, no margin); DefaultConfig gives the strict ones.
type Config struct {
	// Name labels the quota in reports; it does not affect the bound.
	Name string
	// Limit is G, the tokens the allocator's pool holds per window.
	Limit int64
	// Window is the window length; windows are aligned to epoch multiples.
	Window time.Duration
	// Chunk is the normal grant size a region receives.
	Chunk int64
	// TTL is a grant's lifetime before clamping.
	TTL time.Duration
	// Clamp says grants expire at the end of the window they were made in.
	Clamp bool
	// Regions is how many regions lease the quota.
	Regions int
	// FallbackPerRegion is the tokens per window a region admits on its own
	// while cut off from the allocator, and again in its gateways' processes
	// while its regional store fails or is slow (policy
	// lease.fallback_per_region, which fail_mode fallback requires); 0 means
	// fail closed.
	FallbackPerRegion int64
	// MaxHeldPerRegion is the most unexpired, unreleased tokens of the pool
	// the allocator lets one region hold at once (policy
	// lease.max_held_per_region, which the allocator enforces); 0 means no
	// cap, and the terms assume one region may hold a whole pool. A cap
	// needs a TTL no longer than the window (the allocator counts only the
	// windows it keeps).
	MaxHeldPerRegion int64
	// QuorumCommit says the allocator acknowledges a grant only after a Raft
	// quorum has committed it, so no failover forgets an acknowledged grant.
	QuorumCommit bool
	// ExpiryMargin is how long before the allocator's expiry a region stops
	// spending a lease (subtracted from its monotonic deadline).
	ExpiryMargin time.Duration
	// MaxDriftPPM is the assumed maximum rate error of any clock that times a
	// lease, in parts per million (200 means 200 microseconds per second).
	MaxDriftPPM int64
	// MaxOneWayDelay is the assumed maximum one-way delay between a deadline
	// check and the spend it allows (agent to store, gateway to store) that
	// the deposit TTLs do not already subtract.
	MaxOneWayDelay time.Duration
	// MaxLeaderSkew is the assumed maximum clock offset between allocator
	// nodes: a new leader whose clock is ahead opens the next window early.
	MaxLeaderSkew time.Duration
	// StoreAsyncFailover says a regional store can fail over to an
	// asynchronous replica, or restart from an RDB or AOF file, and lose
	// acknowledged debits. False assumes a store that does neither: a
	// restart without persistence comes back empty and rolls nothing back.
	StoreAsyncFailover bool
	// StoreReplicationLag is the assumed maximum replication lag of the
	// regional store; debits within it can be lost by a failover.
	StoreReplicationLag time.Duration
	// PeakAdmissionRate is the assumed peak admissions per second of this
	// quota across the fleet; 0 means unknown, and held tokens bound the
	// timing and store_rollback terms instead.
	PeakAdmissionRate int64
	// Gateways is how many gateways each region runs (the allocator's
	// -gateways-per-region): it sizes the tokens parked in gateways'
	// in-process chunks (Stranded.Parked) and is named in the store_fallback
	// assumption; 0 when not stated.
	Gateways int
	// GatewayChunk is the tokens a gateway takes at once from its region's
	// store (policy lease.gateway_chunk); 0 for none.
	GatewayChunk int64
}

// DefaultConfig returns the strict environment assumptions: clamp on, fail
// closed, quorum-commit allocator, an expiry margin of 250ms covering 200 ppm
// of drift, 100ms of one-way delay and 100ms of leader skew, and no
// asynchronous store failover. The quota fields are zero: set them with
// WithQuota.
func DefaultConfig() Config {
	return Config{
		Clamp:          true,
		QuorumCommit:   true,
		ExpiryMargin:   250 * time.Millisecond,
		MaxDriftPPM:    lease.DefaultMaxDriftPPM,
		MaxOneWayDelay: 100 * time.Millisecond,
		MaxLeaderSkew:  100 * time.Millisecond,
	}
}

// WithQuota returns c with the quota fields taken from q (name, limit,
// window, chunk, TTL, clamp, regions, fallback allowance, per-region cap,
// gateway chunk).
func (c Config) WithQuota(q policy.GlobalQuota) Config {
	c.Name = q.Name
	c.Limit = q.Limit
	c.Window = q.Window
	c.Chunk = q.Chunk
	c.TTL = q.TTL
	c.Clamp = q.Clamp
	c.Regions = len(q.Regions)
	c.FallbackPerRegion = q.FallbackPerRegion
	c.MaxHeldPerRegion = q.MaxHeldPerRegion
	c.GatewayChunk = q.GatewayChunk
	return c
}

// Validate reports what is wrong with c, wrapping ErrInvalidConfig.
func (c Config) Validate() error {
	var errs []error
	bad := func(field, format string, args ...any) {
		errs = append(errs, fmt.Errorf("%w: %s: %s", ErrInvalidConfig, field, fmt.Sprintf(format, args...)))
	}
	if c.Limit <= 0 {
		bad("Limit", "must be positive, got %d", c.Limit)
	}
	if c.Window <= 0 {
		bad("Window", "must be positive, got %s", c.Window)
	}
	if c.Chunk <= 0 || c.Limit > 0 && c.Chunk > c.Limit {
		bad("Chunk", "must be in [1, Limit], got %d", c.Chunk)
	}
	if c.TTL <= 0 {
		bad("TTL", "must be positive, got %s", c.TTL)
	}
	if c.Regions <= 0 {
		bad("Regions", "must be positive, got %d", c.Regions)
	}
	switch {
	case c.MaxHeldPerRegion < 0 || c.Limit > 0 && c.MaxHeldPerRegion > c.Limit:
		bad("MaxHeldPerRegion", "must be in [0, Limit], got %d", c.MaxHeldPerRegion)
	case c.MaxHeldPerRegion > 0 && c.TTL > c.Window:
		bad("MaxHeldPerRegion", "the allocator enforces a cap only for a TTL within the window (TTL %s, window %s)", fmtDur(c.TTL), fmtDur(c.Window))
	}
	nonNeg := []struct {
		field string
		v     int64
	}{
		{"FallbackPerRegion", c.FallbackPerRegion},
		{"ExpiryMargin", int64(c.ExpiryMargin)},
		{"MaxDriftPPM", c.MaxDriftPPM},
		{"MaxOneWayDelay", int64(c.MaxOneWayDelay)},
		{"MaxLeaderSkew", int64(c.MaxLeaderSkew)},
		{"StoreReplicationLag", int64(c.StoreReplicationLag)},
		{"PeakAdmissionRate", c.PeakAdmissionRate},
		{"Gateways", int64(c.Gateways)},
		{"GatewayChunk", c.GatewayChunk},
	}
	for _, f := range nonNeg {
		if f.v < 0 {
			bad(f.field, "must not be negative, got %d", f.v)
		}
	}
	if c.MaxDriftPPM >= 1_000_000 {
		bad("MaxDriftPPM", "%d ppm is not a clock", c.MaxDriftPPM)
	}
	return errors.Join(errs...)
}

// Term is one addend of the bound.
type Term struct {
	// Name is one of the Term* constants.
	Name string
	// Tokens is the term's upper bound per window, in tokens.
	Tokens int64
	// Assumption states what the value rests on, with its numbers.
	Assumption string
	// HowToZero says which choice makes the term zero, and its cost.
	HowToZero string
}

// Stranded is capacity granted and never spent: the price of safety,
// reported beside the bound (it can only cause denials, never overshoot).
type Stranded struct {
	// PerRegion is the most tokens of one window one region cut off from
	// the allocator can hold and leave unspent until they expire: its cap
	// (Config.MaxHeldPerRegion), or without one the whole pool.
	PerRegion int64
	// Fleet is the most tokens all regions together can hold unspent:
	// regions x the cap, at most G.
	Fleet int64
	// Parked is the most tokens sitting in gateways' in-process chunks:
	// regions x gateways per region x the gateway chunk.
	Parked int64
	// Assumption states what the values rest on.
	Assumption string
}

// Bound is the stated overshoot of one quota per window.
type Bound struct {
	// Name is the quota's name from the Config.
	Name string
	// Limit is G.
	Limit int64
	// Window is the window length.
	Window time.Duration
	// Terms are the addends, in a fixed order, zero terms included.
	Terms []Term
	// Total is the sum of the terms: the most admissions beyond G per window.
	Total int64
	// Stranded is reported beside the bound.
	Stranded Stranded
}

// Ceiling is the most admissions the bound allows in one window: G + Total.
func (b Bound) Ceiling() int64 { return satAdd(b.Limit, b.Total) }

// Term returns the term called name.
func (b Bound) Term(name string) (Term, bool) {
	for _, t := range b.Terms {
		if t.Name == name {
			return t, true
		}
	}
	return Term{}, false
}

// String renders the bound as a small report for operators.
func (b Bound) String() string {
	var s strings.Builder
	if b.Name != "" {
		fmt.Fprintf(&s, "%s: ", b.Name)
	}
	fmt.Fprintf(&s, "admitted per %s window <= G %d", fmtDur(b.Window), b.Limit)
	for _, t := range b.Terms {
		fmt.Fprintf(&s, " + %s %d", t.Name, t.Tokens)
	}
	fmt.Fprintf(&s, " = %d (overshoot %d, %s of G)\n", b.Ceiling(), b.Total, percent(b.Total, b.Limit))
	for _, t := range b.Terms {
		fmt.Fprintf(&s, "  %-14s %8d  %s", t.Name, t.Tokens, t.Assumption)
		if t.Tokens > 0 {
			fmt.Fprintf(&s, " To make it 0: %s", t.HowToZero)
		}
		s.WriteByte('\n')
	}
	fmt.Fprintf(&s, "  stranded: up to %d per region (%s of G), %d fleet-wide, %d parked in gateways. %s\n",
		b.Stranded.PerRegion, percent(b.Stranded.PerRegion, b.Limit), b.Stranded.Fleet, b.Stranded.Parked, b.Stranded.Assumption)
	return s.String()
}

// Calculate states the bound for c. It assumes c is valid (see Validate);
// negative values are treated as zero.
//
// Without a cap (Config.MaxHeldPerRegion 0) a region may hold a window's
// whole pool, G, and with clamp off the pools of every earlier window its
// leases reach as well; the terms assume nothing tighter. With a cap H the
// allocator never lets a region hold more than H at once, which bounds
// carry_over, timing and store_rollback by what the regions can spend at
// once, whichever is lower: H each when the expiry margin covers drift,
// delay and skew, a few times H when it falls short (see spendable).
func Calculate(c Config) Bound {
	g := max(c.Limit, 0)
	regions := int64(max(c.Regions, 0))

	b := Bound{Name: c.Name, Limit: g, Window: c.Window}
	b.Terms = []Term{
		carryOver(c, g, regions),
		fallback(c, regions),
		storeFallback(c, regions),
		lostGrants(c, g),
		timing(c, g, regions),
		storeRollback(c, g),
	}
	for _, t := range b.Terms {
		b.Total = satAdd(b.Total, t.Tokens)
	}
	b.Stranded = Stranded{
		PerRegion: g,
		Fleet:     g,
		Parked:    satMul(satMul(regions, int64(max(c.Gateways, 0))), max(c.GatewayChunk, 0)),
		Assumption: fmt.Sprintf("A region cut off from the allocator spends only what it holds; the allocator caps no region's holdings, "+
			"so up to a window's whole pool, %d tokens, can expire unspent in %d regions together while callers elsewhere are denied. "+
			"Smaller chunks and shorter TTLs strand less, at the cost of more Acquire calls.",
			g, regions),
	}
	if h := heldCap(c); h > 0 {
		b.Stranded.PerRegion = h
		b.Stranded.Fleet = min(satMul(regions, h), g)
		b.Stranded.Assumption = fmt.Sprintf("A region cut off from the allocator spends only what it holds, and the allocator caps each region's holdings at H %d "+
			"(lease.max_held_per_region): up to %d tokens per region, %d for %d regions together (at most G), can expire unspent while callers elsewhere are denied. "+
			"A lower cap, smaller chunks and shorter TTLs strand less, at the cost of more Acquire calls.",
			h, h, b.Stranded.Fleet, regions)
	}
	return b
}

// heldCap is the per-region cap H, or 0 for none.
func heldCap(c Config) int64 { return max(c.MaxHeldPerRegion, 0) }

// spendable returns the most tokens one region may spend at one instant s
// out of grants the allocator made under a cap H (h > 0), and how many
// times H that is. The allocator counts a grant as held until its expiry,
// so by its count the region holds at most H at any instant; with no
// lateness (lateBy 0) that is all it can spend at s. When the margin leaves
// it spending up to late past an expiry, it also spends grants the
// allocator counts as expired at s, those that expired within (s-late, s]:
//   - grants that lived their full TTL: granted within (s-late-TTL, s-TTL],
//     a stretch that ceil(late / TTL) spans of one TTL cover, and the grants
//     of one span were all held at its end: at most H per span;
//   - with clamp on, grants cut short at a window end E within it: all
//     held just before E, at most H per end, ceil(late / window) ends.
//
// At a window turn (atTurn: s is a window end, with clamp on) the grants
// held just before s are those cut at s, so that end is not counted twice.
func spendable(c Config, h int64, atTurn bool) (tokens, times int64) {
	times = 1
	if late := int64(lateBy(c)); late > 0 {
		times = satAdd(times, satmath.MulDivCeil(late, 1, max(int64(c.TTL), 1)))
		if c.Clamp {
			ends := satmath.MulDivCeil(late, 1, max(int64(c.Window), 1))
			if atTurn {
				ends--
			}
			times = satAdd(times, ends)
		}
	}
	return satMul(h, times), times
}

// heldText names the cap in a term's assumption ("the allocator caps each
// region's holdings at H"), with what one region may spend at once.
func heldText(c Config, h int64, atTurn bool) string {
	tokens, times := spendable(c, h, atTurn)
	if times == 1 {
		return fmt.Sprintf("the allocator caps each region's holdings at H %d (lease.max_held_per_region), so a region spends at most %d at once", h, tokens)
	}
	return fmt.Sprintf("the allocator caps each region's holdings at H %d (lease.max_held_per_region), but a region spending %s late also spends "+
		"grants the allocator counts as expired, at most H of each TTL (and, clamped, of each window end) within that time: %d x H = %d at once",
		h, fmtDur(lateBy(c)), times, tokens)
}

// carrySpans is the number of earlier windows whose leases can still be
// spent in a window: 0 with clamp on, else ceil(life / window) (at least 1)
// where life is the TTL plus what the margin leaves of drift, delay and
// skew (the timing term leaves such late spending to carry_over). A lease
// granted at the last instant of window k is spent until life later: into
// window k+1 when life is at most one window, k+2 when it is at most two.
func carrySpans(c Config) int64 {
	if c.Clamp {
		return 0
	}
	spans := int64(1)
	if life := c.TTL + lateBy(c); c.Window > 0 && life > c.Window {
		spans = int64((life + c.Window - 1) / c.Window)
	}
	return spans
}

func carryOver(c Config, g, regions int64) Term {
	t := Term{Name: TermCarryOver, HowToZero: "clamp every lease to the window end (lease.clamp: true); grants near a boundary are shorter."}
	spans := carrySpans(c)
	if spans == 0 {
		t.Assumption = "Leases are clamped: every grant expires at min(now+TTL, window end), so no token is spent in a later window."
		return t
	}
	// Each earlier window a lease reaches granted at most its pool, G.
	// Without a cap one region alone can carry all of it, so the number of
	// regions does not lower the term; with one, a token spent across the
	// boundary was held across it (or, spent late, just before), so each
	// region carries at most what it can spend at once.
	t.Tokens = satMul(g, spans)
	h := heldCap(c)
	if h == 0 {
		t.Assumption = fmt.Sprintf("Leases are not clamped: a lease lives its TTL %s (plus %s spent late), so tokens of the %d window(s) before "+
			"can still be spent in this one; the allocator caps no region's holdings, so each such window's whole pool counts: %d x G.",
			fmtDur(c.TTL), fmtDur(lateBy(c)), spans, spans)
		return t
	}
	per, _ := spendable(c, h, false)
	t.Tokens = min(t.Tokens, satMul(regions, per))
	t.Assumption = fmt.Sprintf("Leases are not clamped: a lease lives its TTL %s (plus %s spent late), so tokens of the %d window(s) before "+
		"can still be spent in this one; %s: at most min(%d regions x %d, %d x G) = %d.",
		fmtDur(c.TTL), fmtDur(lateBy(c)), spans, heldText(c, h, false), regions, per, spans, t.Tokens)
	return t
}

// timingNeed is what the expiry margin must cover: the drift over a TTL,
// the one-way delay and the leaders' skew, and that sum spelled out.
func timingNeed(c Config) (time.Duration, string) {
	drift := satmath.MulDivCeil(int64(max(c.TTL, 0)), max(c.MaxDriftPPM, 0), 1_000_000)
	need := time.Duration(satAdd(satAdd(drift, int64(max(c.MaxOneWayDelay, 0))), int64(max(c.MaxLeaderSkew, 0))))
	return need, fmt.Sprintf("drift %d ppm x TTL %s (%s) + one-way delay %s + leader skew %s = %s",
		c.MaxDriftPPM, fmtDur(c.TTL), fmtDur(time.Duration(drift)), fmtDur(c.MaxOneWayDelay), fmtDur(c.MaxLeaderSkew), fmtDur(need))
}

// lateBy is how long past the allocator's expiry a region may spend: what
// the margin does not cover of timingNeed.
func lateBy(c Config) time.Duration {
	need, _ := timingNeed(c)
	return max(0, need-max(c.ExpiryMargin, 0))
}

func fallback(c Config, regions int64) Term {
	t := Term{Name: TermFallback, HowToZero: "fail closed (fail_mode: closed, fallback_per_region: 0); cut-off regions answer 503 once their held tokens are spent."}
	if c.FallbackPerRegion <= 0 {
		t.Assumption = "Fail closed: a region cut off from the allocator admits only tokens it already holds."
		return t
	}
	t.Tokens = satMul(regions, c.FallbackPerRegion)
	t.Assumption = fmt.Sprintf("A region cut off from the allocator admits up to %d per window on its own (lease.fallback_per_region) x %d regions.",
		c.FallbackPerRegion, regions)
	return t
}

// storeFallback is the term of the SDK's own fallback for a leased pool: a
// gateway whose store call fails (or outlasts StoreTimeout) admits the
// quota from an in-process share of FallbackPerRegion, divided by its
// admission Config.Gateways, once per window. The store never sees those
// admissions, so they come on top of everything the pool and the agent's
// fallback admit.
func storeFallback(c Config, regions int64) Term {
	t := Term{Name: TermStoreFallback, HowToZero: "fail closed (fail_mode: closed, fallback_per_region: 0); " +
		"gateways then answer 503 for the quota while their regional store fails or is slow, and cut-off regions too once their held tokens are spent."}
	if c.FallbackPerRegion <= 0 {
		t.Assumption = "Fail closed: a gateway whose regional store fails or is slow answers 503 for the quota instead of admitting in process."
		return t
	}
	t.Tokens = satMul(regions, c.FallbackPerRegion)
	gateways := "the allocator states no gateway count (-gateways-per-region)"
	if c.Gateways > 0 {
		gateways = fmt.Sprintf("the allocator states %d per region (-gateways-per-region)", c.Gateways)
	}
	t.Assumption = fmt.Sprintf("While its regional store fails or answers later than StoreTimeout, each gateway admits the quota in process "+
		"from its share of the fallback allowance, %d / its admission Config.Gateways per window, which the store never sees: "+
		"at most %d per region x %d regions, on top of the agent's fallback. "+
		"Assumes each gateway's admission Config.Gateways is at least its region's gateway count (%s) and leaves a share of at least one request "+
		"(the SDK raises a smaller share to one request and logs the rule); that gateway clocks are within the expiry margin, %s, of true time "+
		"and no gateway's admission Config.PoolFallbackMargin is less (the SDK spends a window's share only from its start + that margin to its end - that margin, "+
		"so each share falls in its own window); and that no gateway restarts while its store fails (a new process starts with a full share).",
		c.FallbackPerRegion, c.FallbackPerRegion, regions, gateways, fmtDur(max(c.ExpiryMargin, 0)))
	return t
}

func lostGrants(c Config, g int64) Term {
	t := Term{Name: TermLostGrants, HowToZero: "acknowledge grants only after a Raft quorum commit (synchronous allocator replication), at availability cost."}
	if c.QuorumCommit {
		t.Assumption = "Grants are acknowledged only after a Raft quorum commit, so a new leader knows every grant regions hold."
		return t
	}
	// A failover forgets every grant not yet replicated, spent or not: the
	// new leader sees the window's pool full and can grant it again.
	t.Tokens = g
	t.Assumption = fmt.Sprintf("Allocator replication is asynchronous: a failover can forget every unreplicated grant of the window, "+
		"tokens already spent included, and the new leader can grant the whole pool again, up to G %d; "+
		"assumes at most one allocator failover per window.", g)
	return t
}

// unsureDeposits is the timing assumption's note on deposits of unknown
// outcome (see pkg/agent, unsureDeposit).
func unsureDeposits(c Config) string {
	return fmt.Sprintf(" A deposit whose outcome is unknown and whose withdrawal failed too is covered only by the one-way delay %s: "+
		"a copy of it reaching the store later than that lives its TTL from its arrival, past the lease's deadline.", fmtDur(max(c.MaxOneWayDelay, 0)))
}

func timing(c Config, g, regions int64) Term {
	t := timingTerm(c, g, regions)
	t.Assumption += unsureDeposits(c)
	if c.MaxDriftPPM > lease.DefaultMaxDriftPPM {
		t.Assumption += fmt.Sprintf(" Region agents open a pre-grant allowing their -max-drift-ppm of drift over its lead (lease.NotBeforeDrift), "+
			"and place cut-off fallback allowances by the leader's clock widened by it: it defaults to %d ppm, so every agent must be run with "+
			"-max-drift-ppm %d; one left at the default can open a window early by up to (%d - %d) ppm of a lead of up to a minute, which this term does not count.",
			lease.DefaultMaxDriftPPM, c.MaxDriftPPM, c.MaxDriftPPM, lease.DefaultMaxDriftPPM)
	}
	return t
}

func timingTerm(c Config, g, regions int64) Term {
	need, sum := timingNeed(c)
	margin := max(c.ExpiryMargin, 0)
	t := Term{Name: TermTiming, HowToZero: fmt.Sprintf("raise the expiry margin to at least %s (%s), or shorten the TTL; "+
		"a larger margin leaves each lease's last moments unspent.", fmtDur(need), sum)}
	if margin >= need {
		t.Assumption = fmt.Sprintf("Regions stop spending %s before the allocator's expiry, which covers %s.", fmtDur(margin), sum)
		return t
	}
	if !c.Clamp {
		t.Assumption = fmt.Sprintf("Margin %s is short of %s, but leases are not clamped: tokens spent late are the held tokens carry_over already counts.",
			fmtDur(margin), sum)
		return t
	}
	// Clamped leases of one window hold at most its pool at its end, and
	// with a cap each region at most what it can spend at once.
	late := need - margin
	t.Tokens = g
	held := fmt.Sprintf(", at most the %d tokens of one window's pool", g)
	if h := heldCap(c); h > 0 {
		per, _ := spendable(c, h, true)
		t.Tokens = min(g, satMul(regions, per))
		held = fmt.Sprintf("; %s: at most min(%d regions x %d, G %d) = %d", heldText(c, h, true), regions, per, g, t.Tokens)
	}
	capped := ""
	if c.PeakAdmissionRate > 0 {
		t.Tokens = min(t.Tokens, satmath.MulDivCeil(c.PeakAdmissionRate, int64(late), int64(time.Second)))
		capped = fmt.Sprintf(", at a peak of %d/s", c.PeakAdmissionRate)
	}
	t.Assumption = fmt.Sprintf("Margin %s is %s short of %s: regions may spend for up to %s past the allocator's expiry, "+
		"into the next window%s%s.", fmtDur(margin), fmtDur(late), sum, fmtDur(late), capped, held)
	return t
}

func storeRollback(c Config, g int64) Term {
	t := Term{Name: TermStoreRollback, HowToZero: "run the regional store without asynchronous failover (or wait for a replica before acknowledging debits) " +
		"and without persistence (--save \"\" --appendonly no), at availability cost."}
	if !c.StoreAsyncFailover {
		t.Assumption = "The regional store does not fail over asynchronously and runs without persistence (--save \"\" --appendonly no: a restart " +
			"comes back empty, its pools and counters gone, as pkg/topology runs it), so acknowledged debits are never lost. " +
			"A restart that reloads an RDB or AOF file rolls back the debits made since it was written, like an asynchronous failover: " +
			"state -store-async-failover for such a store."
		return t
	}
	// Forgotten debits can be spent again while their leases live: one
	// region may hold the window's whole pool and, with clamp off, the
	// pools of the earlier windows its leases reach.
	spans := carrySpans(c)
	held := satMul(g, 1+spans)
	holds := fmt.Sprintf("the allocator caps no region: G x %d window(s)", 1+spans)
	if h := heldCap(c); h > 0 {
		// A region re-spends only tokens of grants it still holds.
		per, _ := spendable(c, h, false)
		held = min(held, per)
		holds = heldText(c, h, false)
	}
	t.Tokens = held
	how := "replication lag unknown"
	if c.PeakAdmissionRate > 0 && c.StoreReplicationLag > 0 {
		t.Tokens = min(held, satmath.MulDivCeil(c.PeakAdmissionRate, int64(c.StoreReplicationLag), int64(time.Second)))
		how = fmt.Sprintf("%s of lag at a peak of %d/s", fmtDur(c.StoreReplicationLag), c.PeakAdmissionRate)
	}
	t.Assumption = fmt.Sprintf("A regional store failover to an asynchronous replica, or a restart that reloads an RDB or AOF file, forgets recent debits (%s), "+
		"re-spendable up to the %d tokens one region can hold (%s); "+
		"assumes at most one store failover or restart per window.", how, held, holds)
	return t
}

// satAdd adds non-negative values, saturating at MaxInt64.
func satAdd(a, b int64) int64 {
	if a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
}

// satMul multiplies non-negative values, saturating at MaxInt64.
func satMul(a, b int64) int64 {
	if a <= 0 || b <= 0 {
		return 0
	}
	hi, lo := bits.Mul64(uint64(a), uint64(b))
	if hi != 0 || lo > math.MaxInt64 {
		return math.MaxInt64
	}
	return int64(lo)
}

// fmtDur formats a duration without zero trailing units ("1m", not "1m0s").
func fmtDur(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = s[:len(s)-2]
	}
	if strings.HasSuffix(s, "h0m") {
		s = s[:len(s)-2]
	}
	return s
}

func percent(v, of int64) string {
	if of <= 0 {
		return "n/a"
	}
	return fmt.Sprintf("%.1f%%", float64(v)*100/float64(of))
}
