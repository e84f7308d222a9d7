package fsm

import (
	"bytes"
	"testing"
)

// TestPregrant: half a second before Atlas's minute ends, EU asks for the
// next minute's chunk. It gets 100 tokens of the next window, spendable from
// its start, whose 15 s TTL runs from that start; a second ask before the
// window opens gets nothing more (one chunk per region ahead of time); US
// gets its own chunk; a pre-grant released before its window opens goes
// back to that window's pool; once the window opens the pre-grants are
// part of its ledger.
func TestPregrant(t *testing.T) {
	h := newHarness(t)
	h.strict = true
	h.publish(t0, atlas(StrategyDemand), QuotaSpec{Name: "loose", Limit: 10, WindowMs: minute, ChunkTokens: 5, TTLMs: 1000})
	end := int64(t0 + minute)
	now := end - 500
	// In the first half of the window a pre-grant gets nothing.
	if early := h.acquire(t0+10_000, "eu", "eu-0", Want{Quota: "atlas", Tokens: 100, Next: true}).Grants[0]; early.Tokens != 0 || early.NotBeforeUnixMs != end {
		t.Fatalf("pre-grant 50 s ahead: %+v, want nothing", early)
	}
	if _, held := h.f.Window("atlas", end/minute); held {
		t.Fatal("an early pre-grant ask opened the next window")
	}

	r := h.acquire(now, "eu", "eu-1", Want{Quota: "atlas", Tokens: 100, Next: true})
	g := r.Grants[0]
	if g.Tokens != 100 || g.WindowIndex != end/minute || g.NotBeforeUnixMs != end || g.WindowEndUnixMs != end+minute {
		t.Fatalf("pre-grant %+v, want 100 tokens of window [%d, %d)", g, end, end+minute)
	}
	if g.ExpiresUnixMs != end+15_000 || g.TTLMs != 15_500 {
		t.Fatalf("pre-grant expires %d (ttl %d ms), want the window start + 15 s", g.ExpiresUnixMs, g.TTLMs)
	}
	if cur := h.f.CurrentWindow("atlas", now); cur.Granted != 0 || cur.Remaining != 1000 {
		t.Fatalf("the current window changed: %+v", cur)
	}
	if again := h.acquire(now+1, "eu", "eu-2", Want{Quota: "atlas", Tokens: 100, Next: true}).Grants[0]; again.Tokens != 0 || again.NotBeforeUnixMs != end {
		t.Fatalf("second pre-grant to eu: %+v, want nothing (one chunk ahead per region)", again)
	}
	us := h.acquire(now+2, "us", "us-1", Want{Quota: "atlas", Tokens: 300, Next: true}).Grants[0]
	if us.Tokens != 100 {
		t.Fatalf("us pre-grant of 300: %d tokens, want the chunk, 100", us.Tokens)
	}
	next, ok := h.f.Window("atlas", end/minute)
	if !ok || next.Granted != 200 || next.Remaining != 800 {
		t.Fatalf("next window %+v (held %v), want 200 granted", next, ok)
	}
	if rel := h.release(now+3, "us", us.GrantID, 40); rel.Returned != 40 || rel.PoolRemaining != 840 {
		t.Fatalf("release of a pre-grant before its window: %+v, want 40 back, pool 840", rel)
	}
	// Plain grants of the current window are untouched by all this.
	if cur := h.acquire(now+4, "eu", "eu-3", Want{Quota: "atlas", Tokens: 100}).Grants[0]; cur.WindowIndex != t0/minute || cur.NotBeforeUnixMs != 0 || cur.ExpiresUnixMs != end {
		t.Fatalf("plain grant %+v, want the current window clamped to its end", cur)
	}
	// A snapshot holding a next window round-trips.
	roundTrip(t, snapshotBytes(t, h.f))
	// The window opens: the pre-grants are its first grants.
	opened := h.f.CurrentWindow("atlas", end+1)
	h.acquire(end+1, "eu", "eu-4", Want{Quota: "atlas", Tokens: 100})
	if opened.Granted != 200 || opened.Outstanding != 160 || opened.Remaining != 840 {
		t.Fatalf("window at its start: %+v, want the 160 pre-granted tokens outstanding", opened)
	}
	if w := h.f.CurrentWindow("atlas", end+1); w.Granted != 300 || w.Remaining != 740 {
		t.Fatalf("after a plain grant in the opened window: %+v, want 300 granted, 740 left", w)
	}
}

// TestPregrantBadInput: a pre-grant of a quota with clamp off is refused
// with a message naming the field, and changes nothing.
func TestPregrantBadInput(t *testing.T) {
	h := newHarness(t)
	h.strict = true
	spec := atlas(StrategyDemand)
	spec.Clamp = false
	h.publish(t0, spec)
	res := h.acquireRes(t0+10, "eu", "eu-1", Want{Quota: "atlas", Next: true})
	if err := wantErr(t, res, ErrInvalidArgument); !bytes.Contains([]byte(err.Error()), []byte("wants[0].next")) {
		t.Fatalf("error %q does not name wants[0].next", err)
	}
}

// TestPregrantInstancesExpireInOrder: an instance holding a pre-grant lives
// a window longer than one acquired plainly after it. The dead one must
// still be forgotten (and a new Acquire of it must see a fresh instance)
// while the pre-granted one lives: a single list in Acquire order would
// have the living one in front and hide the dead one behind it.
func TestPregrantInstancesExpireInOrder(t *testing.T) {
	h := newHarness(t)
	h.strict = true
	const w int64 = 5_000
	h.publish(t0, QuotaSpec{Name: "tq", Limit: 1, WindowMs: w, ChunkTokens: 1, TTLMs: 1, Clamp: true, TemplateKeys: 1})
	late := t0 + w/2 + 1                                                                           // pre-grants are made in a window's second half
	if g := h.acquire(late, "eu", "a", Want{Quota: "tq/a", Next: true}).Grants[0]; g.Tokens != 1 { // lives until the end of window +2
		t.Fatalf("pre-grant of tq/a: %+v", g)
	}
	h.acquire(late, "eu", "b", Want{Quota: "tq/b"}) // lives until the end of window +1
	dead := t0 + 2*w                                // b is dead, a is alive
	if live := h.f.Stats().Instances; live != 2 {
		t.Fatalf("%d live instances, want 2", live)
	}
	r := h.acquire(dead, "eu", "b2", Want{Quota: "tq/b"})
	if r.Grants[0].Tokens != 1 {
		t.Fatalf("a fresh tq/b got %+v, want its full pool", r.Grants[0])
	}
	if v := h.f.CurrentWindow("tq/b", dead); v.Granted != 1 {
		t.Fatalf("tq/b's window after the grant: %+v, want 1 granted", v)
	}
	if live := h.f.Stats().Instances; live != 2 {
		t.Fatalf("%d live instances after b was reborn, want 2", live)
	}
}
