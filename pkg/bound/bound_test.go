package bound

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/allot-dev/allot/examples"
	"github.com/allot-dev/allot/pkg/policy"
	"pgregory.net/rapid"
)

// atlas is P-TENANT from reference chapter 15: G = 1,000/min over two
// regions, chunks of 100 with a 15 s TTL, a region holding at most one chunk,
// under the strict environment assumptions.
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
			// Chapter 15 states <= 100 per region, so <= 200, but nothing
			// caps a region's holdings: one region can carry the whole
			// previous pool into the window.
			name:       "clamp off: carry-over is the previous window's whole pool",
			give:       func(c *Config) { c.Clamp = false },
			want:       map[string]int64{TermCarryOver: 1000},
			wantTotal:  1000,
			wantStrand: 1000,
		},
		{
			name:       "chapter 15: bounded fallback of 100 per region: <= 200",
			give:       func(c *Config) { c.FallbackPerRegion = 100 },
			want:       map[string]int64{TermFallback: 200},
			wantTotal:  200,
			wantStrand: 1000,
		},
		{
			name:       "clamp off and bounded fallback",
			give:       func(c *Config) { c.Clamp = false; c.FallbackPerRegion = 100 },
			want:       map[string]int64{TermCarryOver: 1000, TermFallback: 200},
			wantTotal:  1200,
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
			want:       map[string]int64{TermCarryOver: 1000, TermFallback: 200, TermLostGrants: 1000, TermStoreRollback: 2000},
			wantTotal:  4200,
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
			for _, name := range []string{TermCarryOver, TermFallback, TermLostGrants, TermTiming, TermStoreRollback} {
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

func TestCalculateNorthstar(t *testing.T) {
	d, err := policy.Parse(examples.Northstar)
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]struct {
		total, fallback, parked, perRegion int64
	}{
		// P-GLOBAL: 2 regions x 2,000 fallback; 100 gateways x 100 parked
		// = 10,000, 0.25 s of capacity (reference chapter 12).
		"p-global":       {total: 4000, fallback: 4000, parked: 10000, perRegion: 40000},
		"p-tenant-atlas": {perRegion: 1000},
		"p-tenant-birch": {perRegion: 20000},
	}
	for _, q := range d.GlobalQuotas() {
		t.Run(q.Name, func(t *testing.T) {
			c := DefaultConfig().WithQuota(q)
			if q.GatewayChunk > 0 {
				c.Gateways = 100
			}
			if err := c.Validate(); err != nil {
				t.Fatal(err)
			}
			b := Calculate(c)
			w := want[q.Name]
			if b.Total != w.total || terms(b)[TermFallback] != w.fallback {
				t.Errorf("Total %d fallback %d, want %d %d\n%s", b.Total, terms(b)[TermFallback], w.total, w.fallback, b)
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
		"p-tenant-atlas: admitted per 1m window <= G 1000 + carry_over 1000 + fallback 0 + lost_grants 0 + timing 0 + store_rollback 0 = 2000 (overshoot 1000, 100.0% of G)",
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
	return Config{
		Limit:               g,
		Window:              window,
		Chunk:               rapid.Int64Range(1, g).Draw(t, "chunk"),
		TTL:                 max(1, dur("ttl", 2*window)),
		Clamp:               rapid.Bool().Draw(t, "clamp"),
		Regions:             regions,
		FallbackPerRegion:   rapid.Int64Range(0, g).Draw(t, "fallback"),
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
		if got := strings.Join(names, ","); got != "carry_over,fallback,lost_grants,timing,store_rollback" {
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
		if tm[TermFallback] != int64(c.Regions)*c.FallbackPerRegion {
			t.Fatalf("fallback %d != regions x allowance", tm[TermFallback])
		}
		if b.Stranded.Fleet > c.Limit || b.Stranded.PerRegion > c.Limit {
			t.Fatalf("stranded %+v exceeds G %d", b.Stranded, c.Limit)
		}

		// The strict configuration states a bound of exactly G.
		s := c
		s.Clamp = true
		s.FallbackPerRegion = 0
		s.QuorumCommit = true
		s.StoreAsyncFailover = false
		s.ExpiryMargin = time.Duration(mulDivCeil(int64(s.TTL), s.MaxDriftPPM, 1_000_000)) + s.MaxOneWayDelay + s.MaxLeaderSkew
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
			"longer ttl":    func(c *Config) { c.TTL += c.Window },
		}
		for name, f := range relax {
			r := c
			f(&r)
			if Calculate(r).Total < b.Total {
				t.Fatalf("%s lowered the bound from %d to %d", name, b.Total, Calculate(r).Total)
			}
		}
	})
}

func TestArithmetic(t *testing.T) {
	if got := mulDivCeil(1<<62, 1<<62, 1); got != 1<<63-1 {
		t.Errorf("mulDivCeil saturates: got %d", got)
	}
	if got := mulDivCeil(7, 1, 2); got != 4 {
		t.Errorf("mulDivCeil(7,1,2) = %d", got)
	}
	if got := satMul(1<<40, 1<<40); got != 1<<63-1 {
		t.Errorf("satMul saturates: got %d", got)
	}
	if got := satAdd(1<<62, 1<<62); got != 1<<63-1 {
		t.Errorf("satAdd saturates: got %d", got)
	}
}
