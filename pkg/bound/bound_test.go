package bound

import (
	"cmp"
	"errors"
	"strings"
	"testing"
	"time"

	"pgregory.net/rapid"

	"github.com/allot-dev/allot/examples"
	"github.com/allot-dev/allot/internal/satmath"
	"github.com/allot-dev/allot/pkg/policy"
)

// atlas is P-TENANT from reference chapter 15: G = 1,000/min over two
// regions, chunks of 100 with a 15 s TTL, no cap on what a region holds,
// under the strict environment assumptions (TestChapter15 has the cap).
func atlas() Config {
	c := DefaultConfig()
	c.Name = "p-tenant-atlas"
	c.Limit = 1000
	c.Window = time.Minute
	c.Chunk = 100
	c.TTL = 15 * time.Second
	c.Regions = 2
	return c
}

// termNames are the terms in the order Calculate reports them.
var termNames = []string{TermCarryOver, TermFallback, TermStoreFallback, TermLostGrants, TermTiming, TermStoreRollback}

func terms(b Bound) map[string]int64 {
	m := make(map[string]int64)
	for _, t := range b.Terms {
		m[t.Name] = t.Tokens
	}
	return m
}

func TestCalculate(t *testing.T) {
	tests := []struct {
		name       string
		give       func(c *Config)
		want       map[string]int64 // non-zero terms; the rest must be 0
		wantTotal  int64
		wantStrand int64 // per region
	}{
		{
			name:       "chapter 15: clamp on, fail closed, quorum commit: no overshoot",
			give:       func(c *Config) {},
			wantTotal:  0,
			wantStrand: 1000,
		},
		{
			// Chapter 15 states <= 100 per region, so <= 200, but without
			// lease.max_held_per_region nothing caps a region's holdings:
			// one region can carry the whole previous pool into the window.
			name:       "clamp off: carry-over is the previous window's whole pool",
			give:       func(c *Config) { c.Clamp = false },
			want:       map[string]int64{TermCarryOver: 1000},
			wantTotal:  1000,
			wantStrand: 1000,
		},
		{
			// The gateways' in-process fallback comes on top of the
			// agent's: a region cut off and then without its store admits
			// its allowance twice.
			name:       "chapter 15: bounded fallback of 100 per region: <= 200, and as much again in gateways",
			give:       func(c *Config) { c.FallbackPerRegion = 100 },
			want:       map[string]int64{TermFallback: 200, TermStoreFallback: 200},
			wantTotal:  400,
			wantStrand: 1000,
		},
		{
			name:       "clamp off and bounded fallback",
			give:       func(c *Config) { c.Clamp = false; c.FallbackPerRegion = 100 },
			want:       map[string]int64{TermCarryOver: 1000, TermFallback: 200, TermStoreFallback: 200},
			wantTotal:  1400,
			wantStrand: 1000,
		},
		{
			// An asynchronous failover forgets every unreplicated grant,
			// spent tokens included: the new leader can grant the whole
			// pool again, whatever the regions hold.
			name:       "asynchronous allocator failover can re-grant the whole pool",
			give:       func(c *Config) { c.QuorumCommit = false },
			want:       map[string]int64{TermLostGrants: 1000},
			wantTotal:  1000,
			wantStrand: 1000,
		},
		{
			name:       "asynchronous allocator failover, one region: still the whole pool",
			give:       func(c *Config) { c.QuorumCommit = false; c.Regions = 1 },
			want:       map[string]int64{TermLostGrants: 1000},
			wantTotal:  1000,
			wantStrand: 1000,
		},
		{
			// A lease exactly as long as the window, spent no later than
			// its expiry, reaches the next window only.
			name:       "one region, unclamped TTL equal to the window, margin covers: one window of carry-over",
			give:       func(c *Config) { c.Clamp = false; c.Regions = 1; c.TTL = time.Minute },
			want:       map[string]int64{TermCarryOver: 1000},
			wantTotal:  1000,
			wantStrand: 1000,
		},
		{
			name: "unclamped TTL spanning two boundaries, three regions",
			give: func(c *Config) {
				c.Clamp = false
				c.Regions = 3
				c.TTL = 90 * time.Second
			},
			want:       map[string]int64{TermCarryOver: 2000},
			wantTotal:  2000,
			wantStrand: 1000,
		},
		{
			// One region holds G of each of the two earlier windows its
			// leases reach, then spends G of its own window: 3,000.
			name:       "one region, unclamped TTL of two windows: two windows of carry-over",
			give:       func(c *Config) { c.Clamp = false; c.Regions = 1; c.TTL = 2 * time.Minute },
			want:       map[string]int64{TermCarryOver: 2000},
			wantTotal:  2000,
			wantStrand: 1000,
		},
		{
			// A lease as long as the window, granted at its end, is spent
			// 212 ms past its expiry: into a second window.
			name: "unclamped TTL equal to the window, margin short: two windows of carry-over",
			give: func(c *Config) {
				c.Clamp = false
				c.TTL = time.Minute
				c.ExpiryMargin = 0
			},
			want:       map[string]int64{TermCarryOver: 2000},
			wantTotal:  2000,
			wantStrand: 1000,
		},
		{
			name: "one region, unclamped TTL equal to the window, margin short: two windows of carry-over",
			give: func(c *Config) {
				c.Clamp = false
				c.Regions = 1
				c.TTL = time.Minute
				c.ExpiryMargin = 0
			},
			want:       map[string]int64{TermCarryOver: 2000},
			wantTotal:  2000,
			wantStrand: 1000,
		},
		{
			name:       "no margin, rate unknown: timing is bounded by one pool",
			give:       func(c *Config) { c.ExpiryMargin = 0 },
			want:       map[string]int64{TermTiming: 1000},
			wantTotal:  1000,
			wantStrand: 1000,
		},
		{
			// 200 ppm x 15 s = 3 ms, + 100 ms delay + 100 ms skew = 203 ms late;
			// at 100/s that is ceil(20.3) = 21 tokens.
			name:       "no margin, peak 100/s: timing is rate x lateness",
			give:       func(c *Config) { c.ExpiryMargin = 0; c.PeakAdmissionRate = 100 },
			want:       map[string]int64{TermTiming: 21},
			wantTotal:  21,
			wantStrand: 1000,
		},
		{
			name:       "margin exactly covers drift + delay + skew",
			give:       func(c *Config) { c.ExpiryMargin = 203 * time.Millisecond },
			wantTotal:  0,
			wantStrand: 1000,
		},
		{
			name:       "margin 1ms short",
			give:       func(c *Config) { c.ExpiryMargin = 202 * time.Millisecond; c.PeakAdmissionRate = 1000 },
			want:       map[string]int64{TermTiming: 1},
			wantTotal:  1,
			wantStrand: 1000,
		},
		{
			name:       "late spending without clamp is already carry-over",
			give:       func(c *Config) { c.ExpiryMargin = 0; c.Clamp = false },
			want:       map[string]int64{TermCarryOver: 1000},
			wantTotal:  1000,
			wantStrand: 1000,
		},
		{
			name: "asynchronous store failover: rate x lag, capped by held tokens",
			give: func(c *Config) {
				c.StoreAsyncFailover = true
				c.StoreReplicationLag = time.Second
				c.PeakAdmissionRate = 50
			},
			want:       map[string]int64{TermStoreRollback: 50},
			wantTotal:  50,
			wantStrand: 1000,
		},
		{
			name:       "asynchronous store failover, lag unknown: one pool",
			give:       func(c *Config) { c.StoreAsyncFailover = true },
			want:       map[string]int64{TermStoreRollback: 1000},
			wantTotal:  1000,
			wantStrand: 1000,
		},
		{
			// Unclamped, a region also holds the previous window's pool.
			name:       "asynchronous store failover, lag unknown, clamp off: two pools",
			give:       func(c *Config) { c.StoreAsyncFailover = true; c.Clamp = false },
			want:       map[string]int64{TermCarryOver: 1000, TermStoreRollback: 2000},
			wantTotal:  3000,
			wantStrand: 1000,
		},
		{
			name: "everything relaxed",
			give: func(c *Config) {
				c.Clamp = false
				c.FallbackPerRegion = 100
				c.QuorumCommit = false
				c.StoreAsyncFailover = true
			},
			want:       map[string]int64{TermCarryOver: 1000, TermFallback: 200, TermStoreFallback: 200, TermLostGrants: 1000, TermStoreRollback: 2000},
			wantTotal:  4400,
			wantStrand: 1000,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := atlas()
			tt.give(&c)
			if err := c.Validate(); err != nil {
				t.Fatal(err)
			}
			b := Calculate(c)
			got := terms(b)
			for _, name := range termNames {
				if got[name] != tt.want[name] {
					t.Errorf("%s = %d, want %d", name, got[name], tt.want[name])
				}
			}
			if b.Total != tt.wantTotal {
				t.Errorf("Total = %d, want %d", b.Total, tt.wantTotal)
			}
			if b.Ceiling() != c.Limit+tt.wantTotal {
				t.Errorf("Ceiling = %d, want %d", b.Ceiling(), c.Limit+tt.wantTotal)
			}
			if b.Stranded.PerRegion != tt.wantStrand {
				t.Errorf("Stranded.PerRegion = %d, want %d", b.Stranded.PerRegion, tt.wantStrand)
			}
			for _, term := range b.Terms {
				if term.Assumption == "" || term.HowToZero == "" {
					t.Errorf("%s lacks an assumption or a way to zero it", term.Name)
				}
			}
		})
	}
}

// chapter15 is Atlas as reference chapter 15 states it, as a policy: G =
// 1,000/min over two regions, chunks of 100 with a 15 s TTL, the lease
// block's other fields as given.
func chapter15(t *testing.T, lease, failMode string) policy.GlobalQuota {
	t.Helper()
	d, err := policy.Parse([]byte(`
name: chapter15
regions: [eu, us]
rules:
  - name: p-tenant-atlas
    scope: tenant
    match: [{key: tenant, value: atlas}]
    kind: global_quota
    limit: 1000
    window: 1m
    lease: {chunk: 100, ttl: 15s, ` + lease + `}
    fail_mode: ` + failMode + `
`))
	if err != nil {
		t.Fatal(err)
	}
	return d.GlobalQuotas()[0]
}

// TestChapter15: the table of reference chapter 15 (Atlas, G = 1,000/min,
// two regions), with each region's holdings capped by the policy's
// lease.max_held_per_region, which the allocator enforces: window
// carry-over <= 100 per region, so <= 200; a fallback of 100 per region,
// so <= 200; US cut off holding 200 strands up to 200 (20% of G).
func TestChapter15(t *testing.T) {
	tests := []struct {
		name       string
		lease      string
		failMode   string
		give       func(c *Config)
		want       map[string]int64 // non-zero terms; the rest must be 0
		wantStrand int64            // per region
		wantFleet  int64
	}{
		{
			name:  "clamp on, fail closed, quorum commit: no overshoot",
			lease: "max_held_per_region: 100", wantStrand: 100, wantFleet: 200,
		},
		{
			name:  "clamp off, at most 100 held per region: carry-over <= 200",
			lease: "clamp: false, max_held_per_region: 100", want: map[string]int64{TermCarryOver: 200}, wantStrand: 100, wantFleet: 200,
		},
		{
			name:  "bounded fallback of 100 per region: <= 200, and 200 more in gateways",
			lease: "max_held_per_region: 100, fallback_per_region: 100", failMode: "fallback",
			want: map[string]int64{TermFallback: 200, TermStoreFallback: 200}, wantStrand: 100, wantFleet: 200,
		},
		{
			name:  "carry-over and both fallbacks at their bound: +60%",
			lease: "clamp: false, max_held_per_region: 100, fallback_per_region: 100", failMode: "fallback",
			want: map[string]int64{TermCarryOver: 200, TermFallback: 200, TermStoreFallback: 200}, wantStrand: 100, wantFleet: 200,
		},
		{
			name:  "US cut off holding 200 strands up to 200 (20% of G)",
			lease: "max_held_per_region: 200", wantStrand: 200, wantFleet: 400,
		},
		{
			// A failover forgets spent grants too: the cap does not help.
			name:  "asynchronous allocator failover can still re-grant the whole pool",
			lease: "max_held_per_region: 100", give: func(c *Config) { c.QuorumCommit = false },
			want: map[string]int64{TermLostGrants: 1000}, wantStrand: 100, wantFleet: 200,
		},
		{
			// A region can only re-spend what it holds.
			name:  "asynchronous store failover, lag unknown: one region's cap",
			lease: "clamp: false, max_held_per_region: 100", give: func(c *Config) { c.StoreAsyncFailover = true },
			want: map[string]int64{TermCarryOver: 200, TermStoreRollback: 100}, wantStrand: 100, wantFleet: 200,
		},
		{
			// 203 ms late with a 15 s TTL: into the next window a region
			// spends what it held just before the turn (100) and grants
			// the allocator counted as expired up to 203 ms before (100):
			// 400 for two regions, under G. (H each, 200, would not do: a
			// region holding 100 that expire 100 ms before the turn is
			// granted 100 more and spends both after it.)
			name:  "no margin, rate unknown: timing is bounded by the regions' holdings",
			lease: "max_held_per_region: 100", give: func(c *Config) { c.ExpiryMargin = 0 },
			want: map[string]int64{TermTiming: 400}, wantStrand: 100, wantFleet: 200,
		},
		{
			name:  "no margin, clamp off: late spending of held tokens is carry-over",
			lease: "clamp: false, max_held_per_region: 100", give: func(c *Config) { c.ExpiryMargin = 0 },
			want: map[string]int64{TermCarryOver: 400}, wantStrand: 100, wantFleet: 200,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			failMode := cmp.Or(tt.failMode, "closed")
			c := DefaultConfig().WithQuota(chapter15(t, tt.lease, failMode))
			if tt.give != nil {
				tt.give(&c)
			}
			if err := c.Validate(); err != nil {
				t.Fatal(err)
			}
			b := Calculate(c)
			got := terms(b)
			var total int64
			for _, name := range termNames {
				if got[name] != tt.want[name] {
					t.Errorf("%s = %d, want %d", name, got[name], tt.want[name])
				}
				total += tt.want[name]
			}
			if b.Total != total || b.Ceiling() != 1000+total {
				t.Errorf("Total %d, ceiling %d, want %d, %d", b.Total, b.Ceiling(), total, 1000+total)
			}
			if b.Stranded.PerRegion != tt.wantStrand || b.Stranded.Fleet != tt.wantFleet {
				t.Errorf("Stranded %+v, want %d per region, %d fleet-wide", b.Stranded, tt.wantStrand, tt.wantFleet)
			}
			// Every term the cap lowered says so.
			for _, term := range b.Terms {
				uncapped := c
				uncapped.MaxHeldPerRegion = 0
				if u, _ := Calculate(uncapped).Term(term.Name); u.Tokens > term.Tokens && !strings.Contains(term.Assumption, "the allocator caps each region's holdings at H") {
					t.Errorf("%s = %d (%d without the cap) does not name the cap: %s", term.Name, term.Tokens, u.Tokens, term.Assumption)
				}
			}
			if !strings.Contains(b.Stranded.Assumption, "the allocator caps each region's holdings at H") {
				t.Errorf("stranded capacity does not name the cap: %s", b.Stranded.Assumption)
			}
		})
	}
}

func TestCalculateNorthstar(t *testing.T) {
	d, err := policy.Parse(examples.Northstar)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]struct {
		total, fallback, parked, perRegion int64
	}{
		// P-GLOBAL: 2 regions x 2,000 fallback, in the agents and again in
		// the gateways: +8,000, 20% of G; 2 regions x 50 gateways x 100
		// parked = 10,000, 0.25 s of capacity (reference chapter 12).
		"p-global":       {total: 8000, fallback: 4000, parked: 10000, perRegion: 40000},
		"p-tenant-atlas": {perRegion: 1000},
		"p-tenant-birch": {perRegion: 20000},
	}
	for _, q := range d.GlobalQuotas() {
		t.Run(q.Name, func(t *testing.T) {
			c := DefaultConfig().WithQuota(q)
			if q.GatewayChunk > 0 {
				c.Gateways = 50 // per region
			}
			if err := c.Validate(); err != nil {
				t.Fatal(err)
			}
			b := Calculate(c)
			w := want[q.Name]
			if b.Total != w.total || terms(b)[TermFallback] != w.fallback || terms(b)[TermStoreFallback] != w.fallback {
				t.Errorf("Total %d fallback %d store_fallback %d, want %d %d %d\n%s", b.Total, terms(b)[TermFallback], terms(b)[TermStoreFallback], w.total, w.fallback, w.fallback, b)
			}
			if b.Stranded.Parked != w.parked || b.Stranded.PerRegion != w.perRegion {
				t.Errorf("Stranded %+v, want parked %d per region %d", b.Stranded, w.parked, w.perRegion)
			}
			if b.Name != q.Name || b.Limit != q.Limit || b.Window != q.Window {
				t.Errorf("bound labelled %s %d/%s", b.Name, b.Limit, b.Window)
			}
		})
	}
}

func TestBoundString(t *testing.T) {
	c := atlas()
	c.Clamp = false
	s := Calculate(c).String()
	for _, want := range []string{
		"p-tenant-atlas: admitted per 1m window <= G 1000 + carry_over 1000 + fallback 0 + store_fallback 0 + lost_grants 0 + timing 0 + store_rollback 0 = 2000 (overshoot 1000, 100.0% of G)",
		"To make it 0: clamp every lease",
		"stranded: up to 1000 per region (100.0% of G), 1000 fleet-wide, 0 parked in gateways",
	} {
		if !strings.Contains(s, want) {
			t.Errorf("String() lacks %q:\n%s", want, s)
		}
	}
}

func TestConfigValidate(t *testing.T) {
	if err := atlas().Validate(); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name string
		give func(c *Config)
		want string
	}{
		{"default has no quota", func(c *Config) { *c = DefaultConfig() }, "Limit: must be positive"},
		{"zero window", func(c *Config) { c.Window = 0 }, "Window: must be positive"},
		{"chunk above limit", func(c *Config) { c.Chunk = 1001 }, "Chunk: must be in [1, Limit]"},
		{"zero ttl", func(c *Config) { c.TTL = 0 }, "TTL: must be positive"},
		{"no regions", func(c *Config) { c.Regions = 0 }, "Regions: must be positive"},
		{"negative fallback", func(c *Config) { c.FallbackPerRegion = -1 }, "FallbackPerRegion: must not be negative"},
		{"negative held cap", func(c *Config) { c.MaxHeldPerRegion = -1 }, "MaxHeldPerRegion: must be in [0, Limit]"},
		{"held cap above limit", func(c *Config) { c.MaxHeldPerRegion = 1001 }, "MaxHeldPerRegion: must be in [0, Limit]"},
		{"held cap with a TTL beyond the window", func(c *Config) { c.MaxHeldPerRegion = 100; c.Clamp = false; c.TTL = 2 * time.Minute }, "MaxHeldPerRegion: the allocator enforces a cap only for a TTL within the window"},
		{"negative margin", func(c *Config) { c.ExpiryMargin = -time.Second }, "ExpiryMargin: must not be negative"},
		{"absurd drift", func(c *Config) { c.MaxDriftPPM = 2_000_000 }, "MaxDriftPPM"},
		{"negative rate", func(c *Config) { c.PeakAdmissionRate = -1 }, "PeakAdmissionRate: must not be negative"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := atlas()
			tt.give(&c)
			err := c.Validate()
			if !errors.Is(err, ErrInvalidConfig) || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Validate = %v, want %q", err, tt.want)
			}
		})
	}
}

func genConfig(t *rapid.T) Config {
	g := rapid.Int64Range(1, policy.MaxAmount).Draw(t, "limit")
	window := time.Duration(rapid.Int64Range(1, int64(policy.MaxWindow/time.Millisecond)).Draw(t, "window")) * time.Millisecond
	regions := rapid.IntRange(1, policy.MaxRegions).Draw(t, "regions")
	dur := func(label string, hi time.Duration) time.Duration {
		return time.Duration(rapid.Int64Range(0, int64(hi)).Draw(t, label))
	}
	c := Config{
		Limit:               g,
		Window:              window,
		Chunk:               rapid.Int64Range(1, g).Draw(t, "chunk"),
		TTL:                 max(1, dur("ttl", 2*window)),
		Clamp:               rapid.Bool().Draw(t, "clamp"),
		Regions:             regions,
		FallbackPerRegion:   rapid.Int64Range(0, g).Draw(t, "fallback"),
		MaxHeldPerRegion:    rapid.Int64Range(0, g).Draw(t, "held"),
		QuorumCommit:        rapid.Bool().Draw(t, "quorum"),
		ExpiryMargin:        dur("margin", time.Minute),
		MaxDriftPPM:         rapid.Int64Range(0, 999_999).Draw(t, "drift"),
		MaxOneWayDelay:      dur("delay", time.Minute),
		MaxLeaderSkew:       dur("skew", time.Minute),
		StoreAsyncFailover:  rapid.Bool().Draw(t, "async"),
		StoreReplicationLag: dur("lag", time.Hour),
		PeakAdmissionRate:   rapid.Int64Range(0, policy.MaxAmount).Draw(t, "rate"),
		Gateways:            rapid.IntRange(0, 10_000).Draw(t, "gateways"),
		GatewayChunk:        rapid.Int64Range(0, g).Draw(t, "gwchunk"),
	}
	if c.TTL > c.Window || rapid.Bool().Draw(t, "uncapped") {
		c.MaxHeldPerRegion = 0 // a cap needs a TTL within the window
	}
	return c
}

// TestBoundProperties: the total is the sum of the terms, every term is
// non-negative and bounded by the pools it can come from, and the strict
// choices zero every term.
func TestBoundProperties(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		c := genConfig(t)
		if err := c.Validate(); err != nil {
			t.Fatal(err)
		}
		b := Calculate(c)
		var sum int64
		var names []string
		for _, term := range b.Terms {
			if term.Tokens < 0 {
				t.Fatalf("%s = %d", term.Name, term.Tokens)
			}
			sum += term.Tokens
			names = append(names, term.Name)
		}
		if sum != b.Total {
			t.Fatalf("Total %d != sum of terms %d", b.Total, sum)
		}
		if got := strings.Join(names, ","); got != "carry_over,fallback,store_fallback,lost_grants,timing,store_rollback" {
			t.Fatalf("terms %s", got)
		}
		tm := terms(b)
		spans := int64((c.TTL + lateBy(c) + c.Window - 1) / c.Window)
		if c.Clamp {
			spans = 0
		}
		if tm[TermCarryOver] > satMul(c.Limit, spans) || tm[TermLostGrants] > c.Limit || tm[TermTiming] > c.Limit || tm[TermStoreRollback] > satMul(c.Limit, 1+spans) {
			t.Fatalf("a term exceeds its pool: %v (G %d)", tm, c.Limit)
		}
		if tm[TermFallback] != int64(c.Regions)*c.FallbackPerRegion || tm[TermStoreFallback] != tm[TermFallback] {
			t.Fatalf("fallback %d, store_fallback %d, want regions x allowance", tm[TermFallback], tm[TermStoreFallback])
		}
		if b.Stranded.Parked != satMul(int64(c.Regions)*int64(c.Gateways), c.GatewayChunk) {
			t.Fatalf("parked %d, want regions x gateways x gateway chunk", b.Stranded.Parked)
		}
		if b.Stranded.Fleet > c.Limit || b.Stranded.PerRegion > c.Limit {
			t.Fatalf("stranded %+v exceeds G %d", b.Stranded, c.Limit)
		}
		// A cap lowers terms, never raises one; what it bounds is the
		// regions' holdings: H each, and with no lateness exactly that.
		if h := c.MaxHeldPerRegion; h > 0 {
			u := c
			u.MaxHeldPerRegion = 0
			ub := Calculate(u)
			for i, term := range b.Terms {
				if term.Tokens > ub.Terms[i].Tokens {
					t.Fatalf("the cap raised %s from %d to %d", term.Name, ub.Terms[i].Tokens, term.Tokens)
				}
			}
			per, _ := spendable(c, h, false)
			regions := int64(c.Regions)
			if tm[TermCarryOver] > satMul(regions, per) || tm[TermTiming] > satMul(regions, per) || tm[TermStoreRollback] > per {
				t.Fatalf("a term exceeds what %d regions holding at most %d (%d at once) can spend: %v", regions, h, per, tm)
			}
			if lateBy(c) == 0 && per != h {
				t.Fatalf("no lateness, but a region spends %d at once with a cap of %d", per, h)
			}
			if b.Stranded.PerRegion != h || b.Stranded.Fleet != min(satMul(regions, h), c.Limit) {
				t.Fatalf("stranded %+v with a cap of %d x %d regions", b.Stranded, h, regions)
			}
		}

		// The strict configuration states a bound of exactly G.
		s := c
		s.Clamp = true
		s.FallbackPerRegion = 0
		s.QuorumCommit = true
		s.StoreAsyncFailover = false
		s.ExpiryMargin = time.Duration(satmath.MulDivCeil(int64(s.TTL), s.MaxDriftPPM, 1_000_000)) + s.MaxOneWayDelay + s.MaxLeaderSkew
		sb := Calculate(s)
		if sb.Total != 0 {
			t.Fatalf("strict config has overshoot %d:\n%s", sb.Total, sb)
		}
		for _, term := range sb.Terms {
			if term.Tokens != 0 {
				t.Fatalf("strict %s = %d", term.Name, term.Tokens)
			}
		}
		// Relaxing any one choice never lowers the bound.
		relax := map[string]func(c *Config){
			"clamp off":     func(c *Config) { c.Clamp = false },
			"no quorum":     func(c *Config) { c.QuorumCommit = false },
			"async store":   func(c *Config) { c.StoreAsyncFailover = true },
			"no margin":     func(c *Config) { c.ExpiryMargin = 0 },
			"more fallback": func(c *Config) { c.FallbackPerRegion++ },
			"longer ttl":    func(c *Config) { c.TTL += c.Window; c.MaxHeldPerRegion = 0 }, // a cap needs a TTL within the window
			"no held cap":   func(c *Config) { c.MaxHeldPerRegion = 0 },
		}
		for name, f := range relax {
			if name == "clamp off" && c.MaxHeldPerRegion > 0 && lateBy(c) > 0 {
				// Under a cap, with a margin that falls short, clamping is
				// not free: a grant cut at a window end lets a region take
				// another H sooner, one more lot of held tokens that late
				// spending and a store rollback can reach.
				continue
			}
			r := c
			f(&r)
			if Calculate(r).Total < b.Total {
				t.Fatalf("%s lowered the bound from %d to %d", name, b.Total, Calculate(r).Total)
			}
		}
	})
}

func TestArithmetic(t *testing.T) {
	if got := satmath.MulDivCeil(1<<62, 1<<62, 1); got != 1<<63-1 {
		t.Errorf("mulDivCeil saturates: got %d", got)
	}
	if got := satmath.MulDivCeil(7, 1, 2); got != 4 {
		t.Errorf("satmath.MulDivCeil(7,1,2) = %d", got)
	}
	if got := satMul(1<<40, 1<<40); got != 1<<63-1 {
		t.Errorf("satMul saturates: got %d", got)
	}
	if got := satAdd(1<<62, 1<<62); got != 1<<63-1 {
		t.Errorf("satAdd saturates: got %d", got)
	}
}

// TestSpendableProperty checks spendable against a region that takes all
// it may under its cap: at every instant the allocator counts at most H of
// its grants unexpired (a grant of n is made only when what it holds plus n
// is at most H), each grant lives its TTL (with clamp on, at most to its
// window's end), and the region spends a grant from when it is made until
// late past its expiry. Whatever it can spend at one instant, and what of
// earlier windows it can spend at a window turn, stays within spendable.
func TestSpendableProperty(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		h := rapid.Int64Range(1, 20).Draw(t, "held")
		window := rapid.Int64Range(1, 200).Draw(t, "window")
		ttl := rapid.Int64Range(1, window).Draw(t, "ttl")
		late := rapid.Int64Range(0, 300).Draw(t, "late")
		c := Config{
			Limit: 1 << 40, Window: time.Duration(window), TTL: time.Duration(ttl), Clamp: rapid.Bool().Draw(t, "clamp"),
			Regions: 1, MaxHeldPerRegion: h, MaxOneWayDelay: time.Duration(late),
		}
		if lateBy(c) != time.Duration(late) {
			t.Fatalf("lateBy %d, want %d", lateBy(c), late)
		}
		type grant struct{ at, expires, tokens int64 }
		var grants []grant
		held := func(now int64) int64 {
			var n int64
			for _, g := range grants {
				if g.expires > now {
					n += g.tokens
				}
			}
			return n
		}
		now := int64(0)
		for range rapid.IntRange(1, 60).Draw(t, "grants") {
			// Mostly ask again the moment the allocator counts a grant
			// expired, or just before a window's end: the worst cases.
			switch rapid.IntRange(0, 2).Draw(t, "when") {
			case 0:
				next := int64(-1)
				for _, g := range grants {
					if g.expires > now && (next < 0 || g.expires < next) {
						next = g.expires
					}
				}
				if next >= 0 {
					now = next
				}
			case 1:
				end := (now/window + 1) * window
				now = max(now, end-rapid.Int64Range(1, window).Draw(t, "before end"))
			default:
				now += rapid.Int64Range(0, 2*ttl).Draw(t, "advance")
			}
			n := h - held(now)
			if rapid.IntRange(0, 3).Draw(t, "all?") == 0 {
				n = min(n, rapid.Int64Range(1, h).Draw(t, "ask"))
			}
			if n <= 0 {
				continue
			}
			expires := now + ttl
			if c.Clamp {
				expires = min(expires, (now/window+1)*window)
			}
			grants = append(grants, grant{now, expires, n})
		}
		anyTime, _ := spendable(c, h, false)
		atTurn, _ := spendable(c, h, true)
		for s := int64(0); s <= now+ttl+late; s++ {
			var spend, carried int64
			for _, g := range grants {
				if g.at <= s && s < g.expires+late {
					spend += g.tokens
					if s%window == 0 && g.at < s {
						carried += g.tokens // made in an earlier window
					}
				}
			}
			if spend > anyTime {
				t.Fatalf("at %d the region can spend %d, spendable says %d", s, spend, anyTime)
			}
			if c.Clamp && carried > atTurn {
				t.Fatalf("at the turn %d the region can spend %d of earlier windows, spendable says %d", s, carried, atTurn)
			}
		}
	})
}

// TestStoreFallbackCounted: a region cut off from the allocator admits its
// fallback allowance through the store (the agent deposits it), and when
// its store then fails, its gateways admit their shares of the allowance in
// process, which the store never sees. One region, G = 1,000/min, a
// fallback of 100, two gateways each configured with Gateways 2 (a share of
// 50): 1,000 granted + 100 deposited + 2 x 50 = 1,200 admitted in one
// window, which the bound must state.
func TestStoreFallbackCounted(t *testing.T) {
	c := DefaultConfig().WithQuota(policy.GlobalQuota{
		Name: "p-one", Limit: 1000, Window: time.Minute, Chunk: 100, TTL: 15 * time.Second, Clamp: true,
		FallbackPerRegion: 100, FailMode: policy.FailFallback, Regions: []string{"eu"},
	})
	c.Gateways = 2
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	b := Calculate(c)
	const gateways, share = 2, 100 / 2
	if admitted := int64(1000 + 100 + gateways*share); admitted > b.Ceiling() {
		t.Errorf("one window can admit %d, over the stated ceiling %d:\n%s", admitted, b.Ceiling(), b)
	}
	sf, ok := b.Term("store_fallback")
	if !ok || sf.Tokens != 100 {
		t.Fatalf("store_fallback = %+v (found %t), want 100 tokens:\n%s", sf, ok, b)
	}
	for _, want := range []string{"Config.Gateways is at least its region's gateway count", "states 2 per region", "expiry margin, 250ms"} {
		if !strings.Contains(sf.Assumption, want) {
			t.Errorf("store_fallback assumption lacks %q: %s", want, sf.Assumption)
		}
	}
	if !strings.Contains(sf.HowToZero, "fail_mode: closed") {
		t.Errorf("store_fallback how to zero: %s", sf.HowToZero)
	}
	// Its place: right after the agent's fallback.
	if i := termIndex(b, "store_fallback"); i < 1 || b.Terms[i-1].Name != "fallback" {
		t.Errorf("store_fallback at %d, want right after fallback", i)
	}
	// Fail closed: the gateways deny instead.
	c.FallbackPerRegion = 0
	if sf, _ := Calculate(c).Term("store_fallback"); sf.Tokens != 0 || !strings.Contains(sf.Assumption, "Fail closed") {
		t.Errorf("fail closed: store_fallback %+v", sf)
	}
}

func termIndex(b Bound, name string) int {
	for i, t := range b.Terms {
		if t.Name == name {
			return i
		}
	}
	return -1
}

// TestStoreRollbackNamesPersistence: a regional store restarted from an RDB
// or AOF file rolls debits back like an asynchronous failover, so the
// assumption of a store that does neither says it runs without persistence.
func TestStoreRollbackNamesPersistence(t *testing.T) {
	c := atlas()
	for _, async := range []bool{false, true} {
		c.StoreAsyncFailover = async
		sr, _ := Calculate(c).Term(TermStoreRollback)
		if !strings.Contains(sr.Assumption, "RDB or AOF") || !strings.Contains(sr.HowToZero, "without persistence") {
			t.Errorf("async %t: store_rollback does not name persistence: %s / %s", async, sr.Assumption, sr.HowToZero)
		}
	}
	tm, _ := Calculate(c).Term(TermTiming)
	if !strings.Contains(tm.Assumption, "withdrawal failed too is covered only by the one-way delay 100ms") {
		t.Errorf("timing does not name unsure deposits: %s", tm.Assumption)
	}
}
