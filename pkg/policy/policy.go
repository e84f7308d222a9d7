package policy

import (
	"slices"
	"strconv"
	"strings"
	"time"
)

// Limits on the size of a policy. They bound the memory and the time that
// parsing, validating and matching a hostile or mistaken document can take.
const (
	// MaxDocumentBytes is the largest policy document Parse accepts, and the
	// largest canonical encoding Validate accepts (1 MiB): the size of what
	// the allocator stores in one Raft entry and sends to every agent.
	MaxDocumentBytes = 1 << 20
	// MaxRules is the largest number of rules in one document.
	MaxRules = 10_000
	// MaxMatchEntries is the largest number of match entries in one rule.
	MaxMatchEntries = 16
	// MaxRegions is the largest number of regions in one document.
	MaxRegions = 64
	// MaxNameLen is the longest document, rule or match key name, in bytes.
	MaxNameLen = 64
	// MaxRegionLen is the longest region name, in bytes.
	MaxRegionLen = 32
	// MaxValueLen is the longest match value, in bytes.
	MaxValueLen = 256
	// MaxDescriptionLen is the longest description or zero_refill_reason, in bytes.
	MaxDescriptionLen = 1024
	// MaxAmount is the largest limit, capacity, cost, chunk, allowance or
	// in-flight count. It keeps millitoken arithmetic (x1000) and sums over
	// regions far inside int64.
	MaxAmount = 1_000_000_000_000
	// MaxWindow is the longest window, lease TTL or slot TTL. Longer horizons
	// (monthly plans) are quota allocation, not admission control.
	MaxWindow = 24 * time.Hour
	// DurationUnit is the granularity of every duration: windows are aligned
	// to epoch multiples in milliseconds, the unit Redis works in.
	DurationUnit = time.Millisecond
)

// Document is one policy: the regions that lease global quotas and the rules.
// Parse returns it normalized (defaults filled in, regions and rules sorted by
// name); treat it as immutable once shared.
type Document struct {
	// Name identifies the policy, e.g. "northstar".
	Name string
	// Description is free text for operators.
	Description string
	// Regions are the regions that lease global quotas, e.g. ["eu", "us"].
	Regions []string
	// Rules are the limits. Their order carries no meaning: evaluation order
	// is fixed by scope and name (see Matcher).
	Rules []Rule
}

// Rule is one limit. Which numeric fields apply depends on Kind; fields that
// do not apply must be zero.
type Rule struct {
	// Name is unique in the document: [a-z0-9._-], at most 64 bytes.
	Name string
	// Description is free text for operators.
	Description string
	// Scope is whose counter a request is charged to; it fixes the
	// evaluation order and which match keys the rule needs.
	Scope Scope
	// Match lists the descriptor entries the rule applies to, in the order
	// their wildcard values form the counter key.
	Match []Match
	// Kind is the counting algorithm.
	Kind Kind
	// Limit is the requests (cost units) per Window, for the window kinds and
	// global_quota.
	Limit int64
	// Window is the counting interval, aligned to epoch multiples, for the
	// window kinds and global_quota.
	Window time.Duration
	// Cost is the tokens one request takes from this rule; every kind but
	// concurrency. Parse defaults it to 1.
	Cost int64
	// Capacity is a token bucket's burst size.
	Capacity int64
	// RefillMilliPerSecond is a token bucket's refill rate in millitokens per
	// second: 2 tokens/s is 2000. It is 0 only with a ZeroRefillReason.
	RefillMilliPerSecond int64
	// ZeroRefillReason documents why a token bucket never refills; it is
	// required when, and only allowed when, the refill rate is 0.
	ZeroRefillReason string
	// MaxInFlight is a concurrency rule's number of slots.
	MaxInFlight int64
	// SlotTTL is how long a concurrency slot is held if never released; it
	// must exceed the longest legitimate request.
	SlotTTL time.Duration
	// Lease is how a global_quota's pool is leased to regions; nil otherwise.
	Lease *Lease
	// FailMode is what gateways do when they cannot decide this rule. Parse
	// defaults it to closed.
	FailMode FailMode
	// Shadow rules are evaluated beside live ones under their own keys and
	// only report would_deny; they never deny.
	Shadow bool
}

// Match is one entry of a rule's match list. With HasValue the request's
// entry for Key must equal Value; without it any non-empty value matches and
// each distinct value gets its own counter.
type Match struct {
	// Key is the descriptor key, e.g. "tenant" or "route".
	Key string
	// Value is the required value when HasValue is set; empty otherwise.
	Value string
	// HasValue says whether Value must match.
	HasValue bool
}

// String formats the entry as key=value, or key=* for a wildcard. A value
// that could be misread (the value "*", or one holding a comma, a bracket or
// a double quote) is written as a Go string literal, key="*", so that a list
// of entries written "[a=x, b=*]" reads back one way only.
func (m Match) String() string {
	if !m.HasValue {
		return m.Key + "=*"
	}
	if m.Value == "*" || strings.ContainsAny(m.Value, `,[]"`) {
		return m.Key + "=" + strconv.Quote(m.Value)
	}
	return m.Key + "=" + m.Value
}

// Lease says how a global_quota's pool is leased to regions.
type Lease struct {
	// Chunk is the tokens one grant normally carries (demand may size grants
	// up to it); at most the rule's Limit.
	Chunk int64
	// TTL is a grant's lifetime; at most the window.
	TTL time.Duration
	// Clamp ends every grant at its window's end, so no token is spent in the
	// next window's budget. Parse defaults it to true.
	Clamp bool
	// Strategy is how the allocator divides the pool between regions. Parse
	// defaults it to demand.
	Strategy Strategy
	// FallbackPerRegion is the tokens per window a region may admit on its
	// own when it cannot reach the allocator; non-zero only with fail_mode
	// fallback. It is the bound's fallback term.
	FallbackPerRegion int64
	// MaxHeldPerRegion is the most unexpired, unreleased tokens of the pool
	// the allocator lets one region hold at once (0: no cap); when set, at
	// least Chunk and at most the rule's Limit.
	MaxHeldPerRegion int64
	// GatewayChunk is the tokens a gateway takes at once from its region's
	// store to spend in-process (reference chapter 12); 0 means every request
	// goes to the store.
	GatewayChunk int64
}

// Kind is a rule's counting algorithm.
type Kind string

// The rule kinds.
const (
	// KindFixedWindow counts requests in epoch-aligned windows; it allows up
	// to twice the limit across a boundary (reference chapter 4).
	KindFixedWindow Kind = "fixed_window"
	// KindSlidingWindow is the sliding-window counter estimate
	// prev*(1-elapsed/W)+curr.
	KindSlidingWindow Kind = "sliding_window"
	// KindTokenBucket is a bucket of Capacity tokens refilled continuously.
	KindTokenBucket Kind = "token_bucket"
	// KindConcurrency caps requests in flight; slots are leases released on
	// completion or after SlotTTL.
	KindConcurrency Kind = "concurrency"
	// KindGlobalQuota is a pool of Limit tokens per Window shared by all
	// regions and leased to them by the allocator.
	KindGlobalQuota Kind = "global_quota"
)

// Kinds lists every rule kind.
func Kinds() []Kind {
	return []Kind{KindFixedWindow, KindSlidingWindow, KindTokenBucket, KindConcurrency, KindGlobalQuota}
}

// Valid reports whether k is a known kind.
func (k Kind) Valid() bool { return slices.Contains(Kinds(), k) }

// Scope is whose counter a request is charged to.
type Scope string

// The scopes, in evaluation order.
const (
	// ScopeIP rules are keyed by client address: the pre-authentication stage.
	ScopeIP Scope = "ip"
	// ScopeGlobal rules protect a resource fleet-wide; they must be global
	// quotas.
	ScopeGlobal Scope = "global"
	// ScopeTenant rules are keyed by tenant.
	ScopeTenant Scope = "tenant"
	// ScopeUser rules are keyed by a tenant's user.
	ScopeUser Scope = "user"
	// ScopeRoute rules are keyed by a tenant's route class.
	ScopeRoute Scope = "route"
)

// Scopes lists every scope in evaluation order.
func Scopes() []Scope {
	return []Scope{ScopeIP, ScopeGlobal, ScopeTenant, ScopeUser, ScopeRoute}
}

// Valid reports whether s is a known scope.
func (s Scope) Valid() bool { return s.Rank() >= 0 }

// Rank is s's position in the evaluation order (ip 0 ... route 4), or -1 for
// an unknown scope.
func (s Scope) Rank() int { return slices.Index(Scopes(), s) }

// requiredKeys are the match keys a scope needs. Tenant-keyed scopes need the
// tenant so that every key of a tenant shares one Redis hash tag and all of
// its rules are decided in one atomic script (reference chapter 9).
func (s Scope) requiredKeys() []string {
	switch s {
	case ScopeIP:
		return []string{"ip"}
	case ScopeTenant:
		return []string{"tenant"}
	case ScopeUser:
		return []string{"tenant", "user"}
	case ScopeRoute:
		return []string{"tenant", "route"}
	}
	return nil
}

// FailMode is what gateways do when the rule cannot be decided (the regional
// store is unreachable, or for a global quota, the allocator too).
type FailMode string

// The fail modes.
const (
	// FailClosed answers 503: the limiter cannot decide, so nothing is
	// admitted unmetered.
	FailClosed FailMode = "closed"
	// FailOpen admits (counted in telemetry); it preserves nothing of the
	// limit, so global quotas may not use it.
	FailOpen FailMode = "open"
	// FailFallback enforces a conservative local allowance: for a global
	// quota Lease.FallbackPerRegion, otherwise a local bucket per gateway
	// sized so the fleet cannot exceed the rule.
	FailFallback FailMode = "fallback"
)

// FailModes lists every fail mode.
func FailModes() []FailMode { return []FailMode{FailClosed, FailOpen, FailFallback} }

// Valid reports whether f is a known fail mode.
func (f FailMode) Valid() bool { return slices.Contains(FailModes(), f) }

// Strategy is how the allocator divides a global pool between regions.
type Strategy string

// The allocation strategies.
const (
	// StrategyDemand grants chunks in proportion to each region's reported
	// demand while the pool lasts.
	StrategyDemand Strategy = "demand"
	// StrategyFairShare caps each region at an equal share of the pool until
	// the other regions stop asking.
	StrategyFairShare Strategy = "fair_share"
)

// Strategies lists every allocation strategy.
func Strategies() []Strategy { return []Strategy{StrategyDemand, StrategyFairShare} }

// Valid reports whether s is a known strategy.
func (s Strategy) Valid() bool { return slices.Contains(Strategies(), s) }

// GlobalQuota is one leased pool derived from a global_quota rule, or a
// template of pools: what the allocator needs to run it and pkg/bound needs
// to state its overshoot (per pool: every instance of a template has the
// template's bound).
type GlobalQuota struct {
	// Name is the rule's name; it names the pool, or for a template the
	// template (its instances are named by InstanceName).
	Name string
	// Scope is the rule's scope (global or tenant).
	Scope Scope
	// Match is the rule's match entries: the fixed ones identify the pool,
	// the value-less ones (a template's) name an instance per request.
	Match []Match
	// TemplateKeys are a template's value-less match keys, in match order;
	// empty for a single pool (and for an instance, see Document.Quota).
	TemplateKeys []string
	// Limit is G, the tokens per window.
	Limit int64
	// Window is the window length; windows are epoch-aligned.
	Window time.Duration
	// Chunk is the normal grant size.
	Chunk int64
	// TTL is a grant's lifetime.
	TTL time.Duration
	// Clamp ends grants at the window end.
	Clamp bool
	// Strategy is the allocation strategy.
	Strategy Strategy
	// FallbackPerRegion is the tokens per window a cut-off region may admit.
	FallbackPerRegion int64
	// MaxHeldPerRegion is the most unexpired, unreleased tokens one region
	// may hold of the pool (of each instance, for a template); 0 for no cap.
	MaxHeldPerRegion int64
	// GatewayChunk is the tokens a gateway holds in-process; 0 for none.
	GatewayChunk int64
	// FailMode is the rule's fail mode (closed or fallback).
	FailMode FailMode
	// Regions are the regions that lease the pool, sorted.
	Regions []string
}

// GlobalQuotas returns the leased global quotas of d, single pools and
// templates, sorted by name. The slices in the result are copies.
func (d *Document) GlobalQuotas() []GlobalQuota {
	var qs []GlobalQuota
	for i := range d.Rules {
		r := &d.Rules[i]
		if r.Kind != KindGlobalQuota || r.Lease == nil {
			continue
		}
		regions := slices.Clone(d.Regions)
		slices.Sort(regions)
		qs = append(qs, GlobalQuota{
			Name:              r.Name,
			Scope:             r.Scope,
			Match:             slices.Clone(r.Match),
			TemplateKeys:      r.TemplateKeys(),
			Limit:             r.Limit,
			Window:            r.Window,
			Chunk:             r.Lease.Chunk,
			TTL:               r.Lease.TTL,
			Clamp:             r.Lease.Clamp,
			Strategy:          r.Lease.Strategy,
			FallbackPerRegion: r.Lease.FallbackPerRegion,
			MaxHeldPerRegion:  r.Lease.MaxHeldPerRegion,
			GatewayChunk:      r.Lease.GatewayChunk,
			FailMode:          r.FailMode,
			Regions:           regions,
		})
	}
	slices.SortFunc(qs, func(a, b GlobalQuota) int { return strings.Compare(a.Name, b.Name) })
	return qs
}

// Rule returns the rule named name, or nil.
func (d *Document) Rule(name string) *Rule {
	for i := range d.Rules {
		if d.Rules[i].Name == name {
			return &d.Rules[i]
		}
	}
	return nil
}

// Clone returns a deep copy of d.
func (d *Document) Clone() *Document {
	c := *d
	c.Regions = slices.Clone(d.Regions)
	c.Rules = slices.Clone(d.Rules)
	for i := range c.Rules {
		c.Rules[i].Match = slices.Clone(c.Rules[i].Match)
		if l := c.Rules[i].Lease; l != nil {
			lc := *l
			c.Rules[i].Lease = &lc
		}
	}
	return &c
}

// normalize sorts regions and rules by name, the order of the canonical form.
func (d *Document) normalize() {
	slices.Sort(d.Regions)
	slices.SortStableFunc(d.Rules, func(a, b Rule) int { return strings.Compare(a.Name, b.Name) })
}
