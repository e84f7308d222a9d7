package fsm

import (
	"fmt"
	"testing"
)

// t5 is the start of a 5-minute-aligned window (and so of aligned 1- and
// 2-minute windows), in Unix milliseconds. t0 is 2-minute aligned too.
const t5 = 1_700_000_100_000

// oldGrant is a grant made before a reset: at, by region, of pool; release
// is returned right after it (1 ms later).
type oldGrant struct {
	at      int64
	region  string
	pool    string
	tokens  int64
	release int64
}

// transitionCase is a publish that resets a pool while its windows hold
// grants, live or expired, and the window of the new length that the change
// lands in.
type transitionCase struct {
	name   string
	before []QuotaSpec // published at pubAt
	pubAt  int64
	grants []oldGrant
	change func(h *harness) // the publish(es) that reset the pool
	pool   string
	// drainAt are the times at which regions take all they can of the pool
	// after the change, all in the window [spanStart, spanEnd).
	drainAt            []int64
	spanStart, spanEnd int64
	limit              int64 // G of that window
	// want is what the drains must get in all: G less exactly the old
	// grants' tokens that could have been spent in the span (-1: only check
	// that the span admits at most G).
	want int64
}

// runTransition applies c and returns the old grants' tokens (net of
// releases) whose [granted at, expires at) overlaps the span, and what the
// drains got.
func runTransition(t *testing.T, c transitionCase) (overlap, drained int64) {
	t.Helper()
	h := newHarness(t)
	h.strict = true
	h.publish(c.pubAt, c.before...)
	for i, g := range c.grants {
		if g.at < h.f.Now() {
			t.Fatalf("old grant %d at %d: before the state machine's time %d", i, g.at, h.f.Now())
		}
		r := h.acquire(g.at, g.region, fmt.Sprint("old-", i), Want{Quota: g.pool, Tokens: g.tokens}).Grants[0]
		if r.Tokens != g.tokens {
			t.Fatalf("old grant %d got %d, want %d", i, r.Tokens, g.tokens)
		}
		net := r.Tokens
		if g.release > 0 {
			net -= h.release(g.at+1, g.region, r.GrantID, g.release).Returned
		}
		if g.pool == c.pool && r.ExpiresUnixMs > c.spanStart && g.at < c.spanEnd {
			overlap += net
		}
	}
	c.change(h)
	for _, at := range c.drainAt {
		w := h.f.CurrentWindow(c.pool, at)
		if w.StartUnixMs != c.spanStart || w.EndUnixMs != c.spanEnd {
			t.Fatalf("drain at +%d ms: window [%d, %d), want [%d, %d)", at-c.pubAt, w.StartUnixMs, w.EndUnixMs, c.spanStart, c.spanEnd)
		}
		if w.Carried < overlap {
			t.Errorf("drain at %d: window carries %d, but old grants of %d tokens could be spent in it", at, w.Carried, overlap)
		}
		for _, region := range []string{"eu", "us", "apac"} {
			for {
				n := h.acquireAt(at, region, c.pool, c.limit)
				drained += n
				if n == 0 {
					break
				}
			}
		}
	}
	// Replaying the log and restoring the snapshot reach the same state.
	checkReplay(t, h)
	return overlap, drained
}

func checkTransition(t *testing.T, c transitionCase) {
	t.Helper()
	overlap, drained := runTransition(t, c)
	if overlap+drained > c.limit {
		t.Errorf("window [%d, %d): old grants of %d tokens could be spent in it and %d more were granted: %d, over G %d",
			c.spanStart, c.spanEnd, overlap, drained, overlap+drained, c.limit)
	}
	if c.want >= 0 && drained != c.want {
		t.Errorf("window [%d, %d): granted %d after the change, want %d (G %d less the %d tokens of old grants that could be spent in it)",
			c.spanStart, c.spanEnd, drained, c.want, c.limit, overlap)
	}
}

// TestWindowChangeCountsSpentGrants is the operator's case: p-tenant-atlas
// (1000 per 1m) holds 19 granted tokens in its window [05:29, 05:30), 13
// of them in grants that already expired, when a publish changes it to
// 2m. The 2m window [05:28, 05:30) must count all 19, since the expired
// grants' tokens may have been spent in it, and not only the 6 still live:
// otherwise 19 + 994 = 1013 tokens are granted for one window of G 1000.
func TestWindowChangeCountsSpentGrants(t *testing.T) {
	atlas := atlas(StrategyDemand) // 1000/1m, chunks of 100, 15 s leases, clamped
	twoMin := atlas
	twoMin.WindowMs = 2 * minute
	// Windows: 1m [t0, t0+60s) ("05:28") and [t0+60s, t0+120s) ("05:29");
	// 2m [t0, t0+120s).
	operator := []oldGrant{
		{at: t0 + 61_000, region: "eu", pool: "atlas", tokens: 5}, // expires t0+76s
		{at: t0 + 62_000, region: "eu", pool: "atlas", tokens: 4}, // t0+77s
		{at: t0 + 80_000, region: "eu", pool: "atlas", tokens: 4}, // t0+95s
		{at: t0 + 95_000, region: "eu", pool: "atlas", tokens: 6}, // t0+110s: live at the change
	}
	grow := func(h *harness) {
		if r := h.publish(t0+100_000, twoMin); fmt.Sprint(r.WindowsReset) != "[atlas]" {
			t.Fatalf("WindowsReset %v", r.WindowsReset)
		}
	}
	for _, c := range []transitionCase{
		{
			name: "the operator's case", before: []QuotaSpec{atlas}, pubAt: t0 - 30_000, grants: operator, change: grow,
			pool: "atlas", drainAt: []int64{t0 + 101_000}, spanStart: t0, spanEnd: t0 + 2*minute, limit: 1000, want: 1000 - 19,
		},
		{
			// The window is opened only after the live grants expired too.
			name: "first acquire after every old lease ended", before: []QuotaSpec{atlas}, pubAt: t0 - 30_000, grants: operator, change: grow,
			pool: "atlas", drainAt: []int64{t0 + 111_000}, spanStart: t0, spanEnd: t0 + 2*minute, limit: 1000, want: 1000 - 19,
		},
		{
			// The 1m window before the current one lies in the new 2m window
			// too: its grants count, net of what was released.
			name: "the previous 1m window's grants count too", before: []QuotaSpec{atlas}, pubAt: t0 - 30_000,
			grants: append([]oldGrant{
				{at: t0 + 10_000, region: "us", pool: "atlas", tokens: 300, release: 100},
				{at: t0 + 30_000, region: "apac", pool: "atlas", tokens: 500},
			}, operator...),
			change: grow, pool: "atlas", drainAt: []int64{t0 + 101_000, t0 + 115_000}, spanStart: t0, spanEnd: t0 + 2*minute, limit: 1000, want: 1000 - 200 - 500 - 19,
		},
	} {
		t.Run(c.name, func(t *testing.T) { checkTransition(t, c) })
	}
}

// TestWindowShrinkCountsOnlyOverlappingGrants: 2m -> 1m. A grant of the old
// 2m window counts against each new 1m window its [granted at, expires at)
// overlaps, and only those: a grant that ended before the new window began
// could not have been spent in it.
func TestWindowShrinkCountsOnlyOverlappingGrants(t *testing.T) {
	twoMin := atlas(StrategyDemand)
	twoMin.WindowMs = 2 * minute
	oneMin := atlas(StrategyDemand)
	grants := []oldGrant{
		{at: t0 + 10_000, region: "eu", pool: "atlas", tokens: 300},  // [t0+10s, t0+25s): first 1m half only
		{at: t0 + 50_000, region: "us", pool: "atlas", tokens: 150},  // [t0+50s, t0+65s): both halves
		{at: t0 + 70_000, region: "eu", pool: "atlas", tokens: 200},  // [t0+70s, t0+85s)
		{at: t0 + 110_000, region: "us", pool: "atlas", tokens: 100}, // [t0+110s, t0+120s): live at the change
	}
	shrink := func(h *harness) { h.publish(t0+115_000, oneMin) }
	for _, c := range []transitionCase{
		{
			name: "the window the change lands in", before: []QuotaSpec{twoMin}, pubAt: t0 - 1000, grants: grants, change: shrink,
			pool: "atlas", drainAt: []int64{t0 + 116_000}, spanStart: t0 + minute, spanEnd: t0 + 2*minute, limit: 1000, want: 1000 - 150 - 200 - 100,
		},
		{
			// Every old grant ended by t0+120s (clamped to the old window).
			name: "the next window is whole", before: []QuotaSpec{twoMin}, pubAt: t0 - 1000, grants: grants, change: shrink,
			pool: "atlas", drainAt: []int64{t0 + 2*minute}, spanStart: t0 + 2*minute, spanEnd: t0 + 3*minute, limit: 1000, want: 1000,
		},
	} {
		t.Run(c.name, func(t *testing.T) { checkTransition(t, c) })
	}
}

// TestRemoveAndReAddCountsSpentGrants: a quota removed and published again
// (with its old window or another) opens a window that counts every token
// its old pools granted that could be spent in it, expired leases included.
func TestRemoveAndReAddCountsSpentGrants(t *testing.T) {
	g := atlas(StrategyDemand)
	other := QuotaSpec{Name: "other", Limit: 10, WindowMs: minute, ChunkTokens: 1, TTLMs: minute}
	twoMin := g
	twoMin.WindowMs = 2 * minute
	std := QuotaSpec{Name: "std", Limit: 1000, WindowMs: minute, ChunkTokens: 100, TTLMs: 15_000, Clamp: true, TemplateKeys: 1}
	grants := []oldGrant{ // in time order
		{at: t0 - 30_000, region: "us", pool: "atlas", tokens: 700},  // the previous window: [t0-30s, t0-15s)
		{at: t0 - 10_000, region: "eu", pool: "std/x", tokens: 200},  // the previous window: clamped at t0
		{at: t0 - 5_000, region: "eu", pool: "std/z", tokens: 50},    // the previous window only
		{at: t0 + 5_000, region: "eu", pool: "atlas", tokens: 400},   // [t0+5s, t0+20s)
		{at: t0 + 5_000, region: "eu", pool: "std/x", tokens: 600},   // an instance of a template
		{at: t0 + 6_000, region: "eu", pool: "std/y", tokens: 1000},  // another tenant
		{at: t0 + 21_000, region: "us", pool: "atlas", tokens: 150},  // [t0+21s, t0+36s)
		{at: t0 + 40_000, region: "eu", pool: "other", tokens: 10},   // unaffected
		{at: t0 + 50_000, region: "eu", pool: "atlas", tokens: 100},  // [t0+50s, t0+60s): live at the removal
		{at: t0 + 50_000, region: "us", pool: "std/x", tokens: 100},  // live
		{at: t0 + 54_000, region: "apac", pool: "atlas", tokens: 50}, // live
	}
	readd := func(specs ...QuotaSpec) func(h *harness) {
		return func(h *harness) {
			if r := h.publish(t0+55_000, other); fmt.Sprint(r.Removed) != "[atlas std]" {
				t.Fatalf("Removed %v", r.Removed)
			}
			h.publish(t0+56_000, append(specs, other)...)
		}
	}
	for _, c := range []transitionCase{
		{
			name: "same window", before: []QuotaSpec{g, other, std}, pubAt: t0 - minute, grants: grants, change: readd(g, std),
			pool: "atlas", drainAt: []int64{t0 + 57_000}, spanStart: t0, spanEnd: t0 + minute, limit: 1000, want: 1000 - 400 - 150 - 100 - 50,
		},
		{
			name: "longer window", before: []QuotaSpec{g, other, std}, pubAt: t0 - minute, grants: grants, change: readd(twoMin, std),
			pool: "atlas", drainAt: []int64{t0 + 57_000, t0 + 100_000}, spanStart: t0, spanEnd: t0 + 2*minute, limit: 1000, want: 1000 - 400 - 150 - 100 - 50,
		},
		{
			name: "template instance", before: []QuotaSpec{g, other, std}, pubAt: t0 - minute, grants: grants, change: readd(g, std),
			pool: "std/x", drainAt: []int64{t0 + 57_000}, spanStart: t0, spanEnd: t0 + minute, limit: 1000, want: 1000 - 600 - 100,
		},
	} {
		t.Run(c.name, func(t *testing.T) { checkTransition(t, c) })
	}
}

// TestWindowGrowthBeyondHeldWindows: 1m -> 5m. The FSM holds only the
// previous and the current 1m window; the new 5m window also spans 1m
// windows it no longer holds, whose grants are forgotten: each of them
// counts as its whole limit (the most it can have granted), so the span
// never admits more than G, at the price of admitting less when those
// windows granted less.
func TestWindowGrowthBeyondHeldWindows(t *testing.T) {
	oneMin := atlas(StrategyDemand)
	fiveMin := oneMin
	fiveMin.WindowMs, fiveMin.Limit, fiveMin.ChunkTokens = 5*minute, 5000, 500
	var full []oldGrant
	for k := range int64(4) {
		full = append(full, oldGrant{at: t5 + k*minute + 1000, region: "eu", pool: "atlas", tokens: 1000})
	}
	full = append(full, oldGrant{at: t5 + 4*minute + 1000, region: "eu", pool: "atlas", tokens: 500})
	grow := func(h *harness) { h.publish(t5+4*minute+30_000, fiveMin) }
	for _, c := range []transitionCase{
		{
			name: "forgotten windows were full", before: []QuotaSpec{oneMin}, pubAt: t5 - 10*minute, grants: full, change: grow,
			pool: "atlas", drainAt: []int64{t5 + 4*minute + 31_000}, spanStart: t5, spanEnd: t5 + 5*minute, limit: 5000, want: 500,
		},
		{
			// Only the last two 1m windows granted anything; the three
			// before are forgotten, so they count as full.
			name: "forgotten windows were empty", before: []QuotaSpec{oneMin}, pubAt: t5 - 10*minute, grants: full[3:], change: grow,
			pool: "atlas", drainAt: []int64{t5 + 4*minute + 31_000}, spanStart: t5, spanEnd: t5 + 5*minute, limit: 5000, want: 5000 - 3*1000 - 1000 - 500,
		},
		{
			// The quota was published in the second 1m window of the span:
			// nothing before could have been granted.
			name: "the quota is younger than the span", before: []QuotaSpec{oneMin}, pubAt: t5 + 60_500, grants: full[1:], change: grow,
			pool: "atlas", drainAt: []int64{t5 + 4*minute + 31_000}, spanStart: t5, spanEnd: t5 + 5*minute, limit: 5000, want: 5000 - 2*1000 - 1000 - 500,
		},
		{
			// A second change that reaches back further than the first one
			// accounted for: conservative, the pool stays empty until the
			// window ends.
			name: "grown twice", before: []QuotaSpec{oneMin}, pubAt: t5 - 10*minute, grants: full[3:],
			change: func(h *harness) {
				twoMin := oneMin
				twoMin.WindowMs = 2 * minute
				h.publish(t5+4*minute+20_000, twoMin)
				h.publish(t5+4*minute+30_000, fiveMin)
			},
			pool: "atlas", drainAt: []int64{t5 + 4*minute + 31_000}, spanStart: t5, spanEnd: t5 + 5*minute, limit: 5000, want: -1,
		},
	} {
		t.Run(c.name, func(t *testing.T) { checkTransition(t, c) })
	}
}

// TestTemplateWindowChangeCountsSpentGrants: the operator's case for the
// instance of a template.
func TestTemplateWindowChangeCountsSpentGrants(t *testing.T) {
	std := QuotaSpec{Name: "std", Limit: 1000, WindowMs: minute, ChunkTokens: 100, TTLMs: 15_000, Clamp: true, TemplateKeys: 1}
	twoMin := std
	twoMin.WindowMs = 2 * minute
	grants := []oldGrant{
		{at: t0 + 10_000, region: "eu", pool: "std/x", tokens: 250},
		{at: t0 + 61_000, region: "eu", pool: "std/x", tokens: 300},
		{at: t0 + 95_000, region: "us", pool: "std/x", tokens: 60},
		{at: t0 + 95_000, region: "us", pool: "std/y", tokens: 900},
	}
	checkTransition(t, transitionCase{
		before: []QuotaSpec{std}, pubAt: t0 - 30_000, grants: grants, change: func(h *harness) { h.publish(t0+100_000, twoMin) },
		pool: "std/x", drainAt: []int64{t0 + 111_000}, spanStart: t0, spanEnd: t0 + 2*minute, limit: 1000, want: 1000 - 250 - 300 - 60,
	})
}
