package fsm

import (
	"bytes"
	"testing"
)

// capped is Atlas with each region holding at most 250 tokens.
func capped() QuotaSpec {
	s := atlas(StrategyDemand)
	s.MaxHeldPerRegion = 250
	return s
}

// TestMaxHeldPerRegion: a region's grants stop at the cap (a partial grant,
// then 0, neither reported as an exhausted pool), another region is not
// affected, and a release or an expiry makes room again.
func TestMaxHeldPerRegion(t *testing.T) {
	h := newHarness(t)
	h.strict = true
	h.publish(t0, capped())
	chunk := Want{Quota: "atlas"}

	a := h.acquire(t0, "eu", "eu-1", chunk).Grants[0]       // holds 100
	b := h.acquire(t0+1_000, "eu", "eu-2", chunk).Grants[0] // 200
	c := h.acquire(t0+2_000, "eu", "eu-3", chunk).Grants[0] // 250: capped
	if a.Tokens != 100 || b.Tokens != 100 || c.Tokens != 50 {
		t.Fatalf("eu got %d, %d, %d; want 100, 100 and 50 (cap 250)", a.Tokens, b.Tokens, c.Tokens)
	}
	if c.PoolExhausted || c.PoolRemaining != 750 || c.Requested != 100 {
		t.Fatalf("grant cut short by the cap: %+v, want pool 750 and not exhausted", c)
	}
	zero := h.acquire(t0+3_000, "eu", "eu-4", chunk).Grants[0]
	if zero.Tokens != 0 || zero.GrantID != "" || zero.ExpiresUnixMs != 0 || zero.TTLMs != 0 {
		t.Fatalf("eu at its cap got %+v, want nothing", zero)
	}
	if zero.PoolExhausted || zero.PoolRemaining != 750 {
		t.Fatalf("a region at its cap is told the pool is exhausted: %+v", zero)
	}

	// Another region has a cap of its own.
	us := h.acquire(t0+3_000, "us", "us-1", Want{Quota: "atlas", Tokens: 300}).Grants[0]
	if us.Tokens != 250 || us.PoolExhausted {
		t.Fatalf("us asked 300 with eu at its cap: %+v, want 250", us)
	}

	// A release makes room for what it returned.
	if rel := h.release(t0+4_000, "eu", a.GrantID, 30); rel.Returned != 30 {
		t.Fatalf("release: %+v", rel)
	}
	if got := h.acquire(t0+4_000, "eu", "eu-5", chunk).Grants[0]; got.Tokens != 30 {
		t.Fatalf("after releasing 30 eu got %d, want 30", got.Tokens)
	}
	if got := h.acquire(t0+4_000, "eu", "eu-6", chunk).Grants[0]; got.Tokens != 0 {
		t.Fatalf("eu back at its cap got %d", got.Tokens)
	}

	// Expiry makes room: at t0+15 s the first grant (70 unreleased) has
	// expired, a second later the second one (100).
	if got := h.acquire(t0+15_000, "eu", "eu-7", chunk).Grants[0]; got.Tokens != 70 {
		t.Fatalf("after the first grant expired eu got %d, want its 70 unreleased tokens", got.Tokens)
	}
	if got := h.acquire(t0+16_000, "eu", "eu-8", Want{Quota: "atlas", Tokens: 1000}).Grants[0]; got.Tokens != 100 || got.PoolExhausted {
		t.Fatalf("after the second grant expired eu got %+v, want 100", got)
	}

	// A restored replica counts the same holdings.
	snap := snapshotBytes(t, h.f)
	r := newHarness(t)
	r.f, r.index = roundTrip(t, snap), h.index
	for _, x := range []*harness{h, r} {
		if got := x.acquire(t0+16_500, "eu", "eu-9", chunk).Grants[0]; got.Tokens != 0 {
			t.Fatalf("eu at its cap got %d", got.Tokens)
		}
	}
}

// TestMaxHeldCountsPregrants: a pre-grant of the next window counts toward
// the cap, before its window opens and after.
func TestMaxHeldCountsPregrants(t *testing.T) {
	h := newHarness(t)
	h.strict = true
	h.publish(t0, capped())
	end := int64(t0 + minute)
	if g := h.acquire(end-5_000, "eu", "cur", Want{Quota: "atlas", Tokens: 200}).Grants[0]; g.Tokens != 200 || g.ExpiresUnixMs != end {
		t.Fatalf("current grant %+v", g)
	}
	pre := h.acquire(end-4_000, "eu", "pre", Want{Quota: "atlas", Tokens: 100, Next: true}).Grants[0]
	if pre.Tokens != 50 || pre.NotBeforeUnixMs != end {
		t.Fatalf("pre-grant with 200 held: %+v, want 50 (cap 250)", pre)
	}
	if g := h.acquire(end-3_000, "eu", "cur-2", Want{Quota: "atlas"}).Grants[0]; g.Tokens != 0 || g.PoolExhausted {
		t.Fatalf("a current grant beside the pre-grant: %+v, want 0, not exhausted", g)
	}
	// The window turns: the clamped grant has expired, the pre-grant is
	// held (and spendable) now.
	if g := h.acquire(end, "eu", "new", Want{Quota: "atlas", Tokens: 1000}).Grants[0]; g.Tokens != 200 {
		t.Fatalf("after the turn eu got %d, want 250 - 50 pre-granted", g.Tokens)
	}
}

// TestMaxHeldPoolStillExhausts: when the pool, not the cap, cuts a grant
// short, it is reported exhausted as before.
func TestMaxHeldPoolStillExhausts(t *testing.T) {
	h := newHarness(t)
	h.publish(t0, QuotaSpec{Name: "small", Limit: 300, WindowMs: minute, ChunkTokens: 100, TTLMs: 15_000, Clamp: true, MaxHeldPerRegion: 250})
	for i, want := range []int64{100, 100, 50} {
		if g := h.acquire(t0, "eu", string(rune('a'+i)), Want{Quota: "small"}).Grants[0]; g.Tokens != want || g.PoolExhausted {
			t.Fatalf("eu grant %d: %+v, want %d, not exhausted", i, g, want)
		}
	}
	if g := h.acquire(t0, "us", "us-1", Want{Quota: "small"}).Grants[0]; g.Tokens != 50 || !g.PoolExhausted || g.PoolRemaining != 0 {
		t.Fatalf("us took the last 50: %+v, want exhausted", g)
	}
	if g := h.acquire(t0, "us", "us-2", Want{Quota: "small"}).Grants[0]; g.Tokens != 0 || !g.PoolExhausted {
		t.Fatalf("us on an empty pool: %+v, want exhausted", g)
	}
}

// TestMaxHeldPerInstance: each instance of a template has the cap, per
// region, on its own.
func TestMaxHeldPerInstance(t *testing.T) {
	h := newHarness(t)
	h.publish(t0, QuotaSpec{Name: "plan", Limit: 1000, WindowMs: minute, ChunkTokens: 100, TTLMs: 15_000, Clamp: true, MaxHeldPerRegion: 150, TemplateKeys: 1})
	r := h.acquire(t0, "eu", "1", Want{Quota: "plan/atlas", Tokens: 1000}, Want{Quota: "plan/birch", Tokens: 100})
	r2 := h.acquire(t0+1, "eu", "2", Want{Quota: "plan/atlas", Tokens: 100}, Want{Quota: "plan/birch", Tokens: 100})
	if got := []int64{r.Grants[0].Tokens, r.Grants[1].Tokens, r2.Grants[0].Tokens, r2.Grants[1].Tokens}; got[0] != 150 || got[1] != 100 || got[2] != 0 || got[3] != 50 {
		t.Fatalf("instance grants %v, want [150 100 0 50]", got)
	}
}

// TestMaxHeldEncoding: a spec without a cap encodes as before the field
// existed (old logs and snapshots decode and re-encode the same bytes); one
// with a cap names it.
func TestMaxHeldEncoding(t *testing.T) {
	for _, tt := range []struct {
		spec QuotaSpec
		want bool
	}{{atlas(StrategyDemand), false}, {capped(), true}} {
		b, err := Encode(Command{Type: CmdPublishPolicy, NowUnixMs: t0, Publish: &Publish{ExpectedVersion: 1, Author: "a", Quotas: []QuotaSpec{tt.spec}}})
		if err != nil {
			t.Fatal(err)
		}
		if got := bytes.Contains(b, []byte(`"max_held_per_region":250`)); got != tt.want || !tt.want && bytes.Contains(b, []byte("max_held")) {
			t.Errorf("cap %d encodes as %s", tt.spec.MaxHeldPerRegion, b)
		}
		c, err := Decode(b)
		if err != nil || c.Publish.Quotas[0].MaxHeldPerRegion != tt.spec.MaxHeldPerRegion {
			t.Errorf("decode: %+v, %v", c.Publish, err)
		}
	}
}
