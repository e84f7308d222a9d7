package fsm

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"testing"
)

// acquireAt has region ask for tokens of pool at now with a fresh request
// id and returns the tokens granted.
func (h *harness) acquireAt(now int64, region, pool string, tokens int64) int64 {
	h.t.Helper()
	id := fmt.Sprint("r-", len(h.log)) // unique: every call appends an entry
	return h.acquire(now, region, id, Want{Quota: pool, Tokens: tokens}).Grants[0].Tokens
}

// ask is one Acquire made after a reset and what it must get.
type ask struct {
	at     int64
	pool   string
	tokens int64
	want   int64
}

// TestResetCarriesLiveTokens: a publish that resets a quota's pools (a
// changed window length, a removal followed by a re-add) keeps regions'
// leases valid, so the pools of the windows those leases reach leave room
// for their unreleased tokens: one window never sees 2G of live tokens. In
// the first window that starts after the leases end, the pool is full
// again. (transition_test.go: expired leases count too.)
func TestResetCarriesLiveTokens(t *testing.T) {
	g := QuotaSpec{Name: "g", Limit: 1000, WindowMs: minute, ChunkTokens: 100, TTLMs: minute, Clamp: true}
	other := QuotaSpec{Name: "other", Limit: 10, WindowMs: minute, ChunkTokens: 1, TTLMs: minute}
	half := g
	half.WindowMs = minute / 2
	half.TTLMs = minute / 2
	unclamped := g
	unclamped.Clamp = false
	unclamped.TTLMs = 90_000
	tests := []struct {
		name    string
		spec    QuotaSpec // published first; eu takes 1,000 at t0+1s
		release int64     // eu releases this many before the reset
		reset   func(h *harness)
		asks    []ask // by us, afterwards
		noReset bool  // the publish keeps the pools: nothing is carried
	}{
		{
			name: "removed and added again",
			spec: g,
			reset: func(h *harness) {
				if r := h.publish(t0+2000, other); fmt.Sprint(r.Removed) != "[g]" {
					t.Fatalf("Removed %v", r.Removed)
				}
				h.publish(t0+2500, g, other)
			},
			asks: []ask{{t0 + 3000, "g", 1000, 0}, {t0 + 59_999, "g", 1000, 0}, {t0 + minute, "g", 1000, 1000}},
		},
		{
			name:    "removed and added again after a partial release",
			spec:    g,
			release: 400,
			reset: func(h *harness) {
				h.publish(t0+2000, other)
				h.publish(t0+2500, g, other)
			},
			asks: []ask{{t0 + 3000, "g", 1000, 400}, {t0 + minute, "g", 1000, 1000}},
		},
		{
			name: "removed and added again with another window",
			spec: g,
			reset: func(h *harness) {
				h.publish(t0+2000, other)
				h.publish(t0+2500, half, other)
			},
			asks: []ask{{t0 + 3000, "g", 1000, 0}, {t0 + 30_000, "g", 1000, 0}, {t0 + minute, "g", 1000, 1000}},
		},
		{
			// The leases end at t0+60s: both 30 s windows they overlap
			// leave room for them.
			name: "window_ms changed to 30s",
			spec: g,
			reset: func(h *harness) {
				if r := h.publish(t0+2000, half, other); fmt.Sprint(r.WindowsReset) != "[g]" {
					t.Fatalf("WindowsReset %v", r.WindowsReset)
				}
			},
			asks: []ask{{t0 + 3000, "g", 1000, 0}, {t0 + 30_000, "g", 1000, 0}, {t0 + minute, "g", 1000, 1000}},
		},
		{
			// A second reset while the first one's tokens live keeps them,
			// and adds what the windows between granted (nothing here).
			name: "window_ms changed and changed back",
			spec: g,
			reset: func(h *harness) {
				h.publish(t0+2000, half, other)
				h.publish(t0+2500, g, other)
			},
			asks: []ask{{t0 + 3000, "g", 1000, 0}, {t0 + minute, "g", 1000, 1000}},
		},
		{
			// Unclamped, eu's lease lives until t0+91s: into the fourth
			// 30 s window, [t0+90s, t0+120s), which leaves room for it even
			// once it ended (eu may have spent it in that second).
			name: "unclamped lease outliving the window, window_ms changed",
			spec: unclamped,
			reset: func(h *harness) {
				s := unclamped
				s.WindowMs = minute / 2
				h.publish(t0+2000, s, other)
			},
			asks: []ask{{t0 + 3000, "g", 1000, 0}, {t0 + minute, "g", 1000, 0}, {t0 + 91_000, "g", 1000, 0}, {t0 + 2*minute, "g", 1000, 1000}},
		},
		{
			// A limit change is no reset: the pool is the new limit less
			// what is outstanding.
			name: "limit changed",
			spec: g,
			reset: func(h *harness) {
				s := g
				s.Limit = 1500
				if r := h.publish(t0+2000, s, other); len(r.WindowsReset) != 0 {
					t.Fatalf("WindowsReset %v", r.WindowsReset)
				}
			},
			asks:    []ask{{t0 + 3000, "g", 1000, 500}},
			noReset: true,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t)
			h.strict = true
			h.publish(t0, tt.spec, other)
			eu := h.acquire(t0+1000, "eu", "eu-1", Want{Quota: "g", Tokens: 1000}).Grants[0]
			if eu.Tokens != 1000 {
				t.Fatalf("eu got %d", eu.Tokens)
			}
			if tt.release > 0 {
				h.release(t0+1500, "eu", eu.GrantID, tt.release)
			}
			tt.reset(h)
			for _, a := range tt.asks {
				w := h.f.CurrentWindow(a.pool, a.at)
				if got := h.acquireAt(a.at, "us", a.pool, a.tokens); got != a.want {
					t.Fatalf("us asked %d of %s at +%d ms: got %d, want %d (window before: %+v)", a.tokens, a.pool, a.at-t0, got, a.want, w)
				}
				if live := eu.Tokens - tt.release; !tt.noReset && a.at < eu.ExpiresUnixMs && w.Carried < live {
					t.Fatalf("at +%d ms the window carries %d, eu still holds %d", a.at-t0, w.Carried, live)
				}
			}
			// Replaying the log and restoring the snapshot reach the same state.
			checkReplay(t, h)
		})
	}
}

// TestResetCarriesTemplates: the instances of a template are carried one by
// one when their names keep their meaning (a changed window, a removed and
// re-added template); when TemplateKeys change, a new instance cannot be
// matched to the old ones, so it leaves room for all of their live tokens,
// and a single pool and a template of the same name carry into each other
// whole.
func TestResetCarriesTemplates(t *testing.T) {
	std := QuotaSpec{Name: "std", Limit: 1000, WindowMs: minute, ChunkTokens: 100, TTLMs: minute, Clamp: true, TemplateKeys: 1}
	other := QuotaSpec{Name: "other", Limit: 10, WindowMs: minute, ChunkTokens: 1, TTLMs: minute}
	single := std
	single.TemplateKeys = 0
	halfWindow := std
	halfWindow.WindowMs, halfWindow.TTLMs = minute/2, minute/2
	twoKeys := std
	twoKeys.TemplateKeys = 2
	tests := []struct {
		name  string
		spec  QuotaSpec
		take  map[string]int64 // eu's grants at t0+1s
		reset func(h *harness)
		asks  []ask
	}{
		{
			name:  "instance window changed",
			spec:  std,
			take:  map[string]int64{"std/x": 1000},
			reset: func(h *harness) { h.publish(t0+2000, halfWindow, other) },
			asks: []ask{
				{t0 + 3000, "std/x", 1000, 0}, {t0 + 3000, "std/y", 1000, 1000}, // other tenants are unaffected
				{t0 + 30_000, "std/x", 1000, 0}, {t0 + minute, "std/x", 1000, 1000},
			},
		},
		{
			name: "template removed and added again",
			spec: std,
			take: map[string]int64{"std/x": 700},
			reset: func(h *harness) {
				h.publish(t0+2000, other)
				h.publish(t0+2500, std, other)
			},
			asks: []ask{{t0 + 3000, "std/x", 1000, 300}, {t0 + 3000, "std/y", 1000, 1000}, {t0 + minute, "std/x", 1000, 1000}},
		},
		{
			name:  "template keys changed",
			spec:  std,
			take:  map[string]int64{"std/x": 400, "std/y": 300},
			reset: func(h *harness) { h.publish(t0+2000, twoKeys, other) },
			asks:  []ask{{t0 + 3000, "std/a/b", 1000, 300}, {t0 + 3000, "std/c/d", 1000, 300}, {t0 + minute, "std/a/b", 1000, 1000}},
		},
		{
			name:  "single pool became a template",
			spec:  single,
			take:  map[string]int64{"std": 700},
			reset: func(h *harness) { h.publish(t0+2000, std, other) },
			asks:  []ask{{t0 + 3000, "std/a", 1000, 300}, {t0 + 3000, "std/b", 1000, 300}, {t0 + minute, "std/a", 1000, 1000}},
		},
		{
			name:  "template became a single pool",
			spec:  std,
			take:  map[string]int64{"std/x": 400, "std/y": 300},
			reset: func(h *harness) { h.publish(t0+2000, single, other) },
			asks:  []ask{{t0 + 3000, "std", 1000, 300}, {t0 + minute, "std", 1000, 1000}},
		},
		{
			name: "template became a single pool, removed, and came back",
			spec: std,
			take: map[string]int64{"std/x": 400},
			reset: func(h *harness) {
				h.publish(t0+2000, single, other)
				h.acquireAt(t0+2100, "eu", "std", 100) // the single pool grants 100 more
				h.publish(t0+2200, other)
				h.publish(t0+2300, std, other)
			},
			// std/x: its own 400 and the single pool's 100 (which any
			// tenant may have spent); std/y: the single pool's 100.
			asks: []ask{{t0 + 3000, "std/x", 1000, 500}, {t0 + 3000, "std/y", 1000, 900}, {t0 + minute, "std/x", 1000, 1000}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := newHarness(t)
			h.strict = true
			h.publish(t0, tt.spec, other)
			for pool, n := range tt.take { // independent pools: order does not matter
				if got := h.acquireAt(t0+1000, "eu", pool, n); got != n {
					t.Fatalf("eu got %d of %s, want %d", got, pool, n)
				}
			}
			tt.reset(h)
			for _, a := range tt.asks {
				if got := h.acquireAt(a.at, "us", a.pool, a.tokens); got != a.want {
					t.Fatalf("us asked %d of %s at +%d ms: got %d, want %d", a.tokens, a.pool, a.at-t0, got, a.want)
				}
			}
			roundTrip(t, snapshotBytes(t, h.f))
		})
	}
}

// resetHarness reaches a state holding carries of every kind: a removed
// single pool, a single pool whose window changed, a template's instance.
func resetHarness(t testing.TB) *harness {
	h := newHarness(t)
	g := QuotaSpec{Name: "g", Limit: 1000, WindowMs: minute, ChunkTokens: 100, TTLMs: minute, Clamp: true}
	gone := QuotaSpec{Name: "gone", Limit: 50, WindowMs: minute, ChunkTokens: 5, TTLMs: 30_000}
	std := QuotaSpec{Name: "std", Limit: 100, WindowMs: minute, ChunkTokens: 10, TTLMs: minute, Clamp: true, TemplateKeys: 1}
	h.publish(t0, g, gone, std)
	h.acquire(t0+1000, "eu", "a", Want{Quota: "g", Tokens: 600}, Want{Quota: "gone", Tokens: 20}, Want{Quota: "std/x", Tokens: 70})
	g2, std2 := g, std
	g2.WindowMs, std2.WindowMs = minute/2, minute/2
	g2.TTLMs, std2.TTLMs = minute/2, minute/2
	h.publish(t0+2000, g2, std2)
	h.acquire(t0+3000, "us", "b", Want{Quota: "g", Tokens: 1000}, Want{Quota: "std/x", Tokens: 100})
	return h
}

// TestResetCarriesSnapshot: carries and the windows that carry tokens
// round-trip through a snapshot byte for byte, the restored FSM continues
// the log identically, and carries whose leases ended leave the snapshot.
func TestResetCarriesSnapshot(t *testing.T) {
	h := resetHarness(t)
	snap := snapshotBytes(t, h.f)
	for _, want := range []string{`"carries":4`, `{"name":"g","tokens":600,`, `{"name":"gone","tokens":20,`, `{"name":"std","tokens":70,`, `"template_keys":1`, `{"name":"std/x","tokens":70,`, `"carried":600`, `"carried":70`} {
		if !bytes.Contains(snap, []byte(want)) {
			t.Fatalf("snapshot lacks %s:\n%s", want, snap)
		}
	}
	f := roundTrip(t, snap)
	if got, want := f.CurrentWindow("g", t0+3000), h.f.CurrentWindow("g", t0+3000); fmt.Sprint(got) != fmt.Sprint(want) || got.Carried != 600 || got.Remaining != 0 {
		t.Fatalf("restored window %+v, original %+v", got, want)
	}
	r := newHarness(t)
	r.f, r.index = f, h.index
	cmds := []Command{
		{Type: CmdPublishPolicy, NowUnixMs: t0 + 4000, Publish: &Publish{ExpectedVersion: 3, Author: "a", Quotas: []QuotaSpec{
			{Name: "gone", Limit: 50, WindowMs: minute, ChunkTokens: 5, TTLMs: 30_000},
			{Name: "std", Limit: 100, WindowMs: minute / 2, ChunkTokens: 10, TTLMs: minute / 2, Clamp: true, TemplateKeys: 1},
		}}},
		{Type: CmdAcquire, NowUnixMs: t0 + 5000, Acquire: &Acquire{Region: "us", RequestID: "c", Wants: []Want{{Quota: "gone", Tokens: 50}, {Quota: "std/x", Tokens: 100}, {Quota: "std/y", Tokens: 100}}}},
		{Type: CmdAcquire, NowUnixMs: t0 + 31_000, Acquire: &Acquire{Region: "us", RequestID: "d", Wants: []Want{{Quota: "gone", Tokens: 50}}}},
	}
	for i, c := range cmds {
		if got, want := fmt.Sprintf("%+v", r.apply(c)), fmt.Sprintf("%+v", h.apply(c)); got != want {
			t.Fatalf("command %d: restored FSM answered %s, original %s", i, got, want)
		}
	}
	if !bytes.Equal(snapshotBytes(t, f), snapshotBytes(t, h.f)) {
		t.Fatal("states diverged after restore")
	}
	// Once no window of the policy versions held (1m at the longest) can
	// start before they end, a publish collapses the exact steps of each
	// name into one of MaxLimit tokens, which only a longer window
	// published later would reach; the windows opened since carry nothing.
	h.publish(t0+2*minute, QuotaSpec{Name: "gone", Limit: 50, WindowMs: minute, ChunkTokens: 5, TTLMs: 30_000})
	b := snapshotBytes(t, h.f)
	for _, want := range []string{
		fmt.Sprintf(`{"name":"g","tokens":%d,"expires_unix_ms":%d}`, int64(MaxLimit), t0+minute),
		fmt.Sprintf(`{"name":"gone","tokens":%d,"expires_unix_ms":%d}`, int64(MaxLimit), t0+31_000),
		fmt.Sprintf(`{"name":"std","tokens":%d,"expires_unix_ms":%d}`, int64(MaxLimit), t0+minute),
	} {
		if !bytes.Contains(b, []byte(want)) {
			t.Fatalf("snapshot lacks %s:\n%s", want, b)
		}
	}
	if bytes.Contains(b, []byte(`"name":"std/x"`)) || bytes.Contains(b, []byte(`"carried"`)) {
		t.Fatalf("exact steps kept after they can no longer count:\n%s", b)
	}
	if w := h.f.CurrentWindow("gone", t0+2*minute); w.Carried != 0 || w.Remaining != 50 {
		t.Fatalf("gone after the collapse: %+v", w)
	}
	roundTrip(t, b)
	// No window reaches back more than MaxWindowMs: then they go.
	h.publish(t0+2*minute+MaxWindowMs, QuotaSpec{Name: "gone", Limit: 50, WindowMs: minute, ChunkTokens: 5, TTLMs: 30_000})
	if b := snapshotBytes(t, h.f); bytes.Contains(b, []byte(`"carries"`)) || bytes.Contains(b, []byte(`"carried"`)) {
		t.Fatalf("carries no window can reach still in the snapshot:\n%s", b)
	}
	if n := len(h.f.s.carries); n != 0 {
		t.Fatalf("%d carries kept after a publish", n)
	}
}

// TestRestoreSnapshotWithoutCarries: a snapshot written before carries
// existed (no "carries" in the header, no "carried" in windows) restores,
// and is written back byte for byte.
func TestRestoreSnapshotWithoutCarries(t *testing.T) {
	old := []byte(`{"format":1,"now_unix_ms":5,"tokens_granted":5,"last_grant_index":1,"policies":1,"quotas":1,"idempotency":0,"members":[]}` + "\n" +
		`{"version":1,"author":"a","reason":"","published_unix_ms":1,"document":null,"quotas":[{"name":"q","limit":5,"window_ms":10,"chunk_tokens":1,"ttl_ms":5,"clamp":false,"strategy":"demand","fallback_per_region":0}]}` + "\n" +
		`{"name":"q","windows":[{"index":0,"limit":5,"grants":[{"id":"1-0","region":"eu","tokens":5,"released":1,"granted_unix_ms":1,"expires_unix_ms":6}]}]}` + "\n")
	f := roundTrip(t, old)
	if w := f.CurrentWindow("q", 5); w.Carried != 0 || w.Remaining != 1 || w.Outstanding != 4 {
		t.Fatalf("window %+v", w)
	}
}

// oldCarrySnapshot was written by the build before expired leases were
// carried: g and the template std changed from 1m to 2m windows at t0+10s,
// their live leases carried (one entry per name and keys, live at now).
const oldCarrySnapshot = `{"format":1,"now_unix_ms":1700000051000,"tokens_granted":1040,"last_grant_index":5,"policies":2,"quotas":1,"carries":3,"idempotency":3,"members":[]}
{"version":1,"author":"alice","reason":"test","published_unix_ms":1700000040000,"document":"ZG9j","quotas":[{"name":"g","limit":1000,"window_ms":60000,"chunk_tokens":100,"ttl_ms":20000,"clamp":true,"strategy":"demand","fallback_per_region":0},{"name":"std","limit":100,"window_ms":60000,"chunk_tokens":10,"ttl_ms":20000,"clamp":true,"strategy":"demand","fallback_per_region":0,"template_keys":1}]}
{"version":2,"author":"alice","reason":"test","published_unix_ms":1700000050000,"document":"ZG9j","quotas":[{"name":"g","limit":1000,"window_ms":120000,"chunk_tokens":100,"ttl_ms":20000,"clamp":true,"strategy":"demand","fallback_per_region":0},{"name":"std","limit":100,"window_ms":120000,"chunk_tokens":10,"ttl_ms":20000,"clamp":true,"strategy":"demand","fallback_per_region":0,"template_keys":1}]}
{"name":"g","windows":[{"index":14166667,"limit":1000,"carried":500,"grants":[{"id":"5-0","region":"eu","tokens":500,"released":0,"granted_unix_ms":1700000051000,"expires_unix_ms":1700000071000}]}],"demand":[{"region":"eu","per_second":0,"reported_unix_ms":1700000051000},{"region":"us","per_second":0,"reported_unix_ms":1700000045000}]}
{"name":"g","tokens":500,"expires_unix_ms":1700000065000}
{"name":"std","tokens":40,"expires_unix_ms":1700000061000,"template_keys":1}
{"name":"std/x","tokens":40,"expires_unix_ms":1700000061000,"template_keys":1}
{"kind":1,"region":"eu","request_id":"a","at_unix_ms":1700000041000,"acquire":{"region":"eu","request_id":"a","now_unix_ms":1700000041000,"replayed":false,"grants":[{"quota":"g","grant_id":"2-0","requested":300,"tokens":300,"window_index":28333334,"window_end_unix_ms":1700000100000,"expires_unix_ms":1700000061000,"ttl_ms":20000,"pool_remaining":700,"pool_exhausted":false},{"quota":"std/x","grant_id":"2-1","requested":40,"tokens":40,"window_index":28333334,"window_end_unix_ms":1700000100000,"expires_unix_ms":1700000061000,"ttl_ms":20000,"pool_remaining":60,"pool_exhausted":false}]}}
{"kind":1,"region":"us","request_id":"b","at_unix_ms":1700000045000,"acquire":{"region":"us","request_id":"b","now_unix_ms":1700000045000,"replayed":false,"grants":[{"quota":"g","grant_id":"3-0","requested":200,"tokens":200,"window_index":28333334,"window_end_unix_ms":1700000100000,"expires_unix_ms":1700000065000,"ttl_ms":20000,"pool_remaining":500,"pool_exhausted":false}]}}
{"kind":1,"region":"eu","request_id":"c","at_unix_ms":1700000051000,"acquire":{"region":"eu","request_id":"c","now_unix_ms":1700000051000,"replayed":false,"grants":[{"quota":"g","grant_id":"5-0","requested":1000,"tokens":500,"window_index":14166667,"window_end_unix_ms":1700000160000,"expires_unix_ms":1700000071000,"ttl_ms":20000,"pool_remaining":0,"pool_exhausted":true}]}}
`

// TestRestoreOldBuildCarries: a snapshot with carries written by the build
// before expired leases were carried restores, is written back byte for
// byte, and its carries count as the steps they are: against every window
// starting before they end.
func TestRestoreOldBuildCarries(t *testing.T) {
	f := roundTrip(t, []byte(oldCarrySnapshot))
	if w := f.CurrentWindow("g", t0+11_000); w.Carried != 500 || w.Remaining != 0 {
		t.Fatalf("g: %+v", w)
	}
	// The instance's carried lease ended at t0+21s; it may have been spent
	// in the 2m window, which still leaves room for it after then.
	if w := f.CurrentWindow("std/x", t0+30_000); w.Carried != 40 || w.Remaining != 60 {
		t.Fatalf("std/x: %+v", w)
	}
	if w := f.CurrentWindow("std/x", t0+2*minute); w.Carried != 0 || w.Remaining != 100 {
		t.Fatalf("std/x, next window: %+v", w)
	}
	h := newHarness(t)
	h.f, h.index = f, 5
	if got := h.acquireAt(t0+30_000, "us", "std/x", 100); got != 60 {
		t.Fatalf("std/x granted %d, want 60", got)
	}
	roundTrip(t, snapshotBytes(t, f))
}

func TestRestoreRejectsBadCarries(t *testing.T) {
	lines := snapshotRecords(t, snapshotBytes(t, resetHarness(t).f))
	h := lines[0]
	n := func(k string) int { v, _ := h[k].(float64); return int(v) }
	first := 1 + n("policies") + n("quotas") + n("instances") // the first carry
	if n("carries") < 2 {
		t.Fatalf("fixture has %d carries", n("carries"))
	}
	edit := func(mod func(l []map[string]any)) []byte {
		var l []map[string]any
		b, _ := json.Marshal(lines)
		_ = json.Unmarshal(b, &l)
		mod(l)
		return encodeRecords(t, l, true)
	}
	if err := restore(New(), edit(func([]map[string]any) {})); err != nil {
		t.Fatalf("unedited snapshot rejected: %v", err)
	}
	now := h["now_unix_ms"].(float64)
	tests := []struct {
		name string
		mod  func(l []map[string]any)
	}{
		{"zero tokens", func(l []map[string]any) { l[first]["tokens"] = 0 }},
		{"tokens over any limit", func(l []map[string]any) { l[first]["tokens"] = float64(MaxLimit) + 1 }},
		{"out of reach", func(l []map[string]any) { l[first]["expires_unix_ms"] = now - MaxWindowMs }},
		{"repeated", func(l []map[string]any) { l[first+1] = l[first] }},
		{"expiry too far", func(l []map[string]any) { l[first]["expires_unix_ms"] = now + 2*MaxWindowMs + 1 }},
		{"out of order", func(l []map[string]any) { l[first], l[first+1] = l[first+1], l[first] }},
		{"empty name", func(l []map[string]any) { l[first]["name"] = "" }},
		{"bad template keys", func(l []map[string]any) { l[first]["template_keys"] = MaxTemplateKeys + 1 }},
		{"negative template keys", func(l []map[string]any) { l[first]["template_keys"] = -1 }},
		{"count too high", func(l []map[string]any) { l[0]["carries"] = float64(n("carries") + 1) }},
		{"negative count", func(l []map[string]any) { l[0]["carries"] = -1 }},
		{"negative carried", func(l []map[string]any) {
			l[1+n("policies")]["windows"].([]any)[0].(map[string]any)["carried"] = -1
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := restore(New(), edit(tt.mod)); !errors.Is(err, ErrBadSnapshot) {
				t.Fatalf("Restore = %v, want ErrBadSnapshot", err)
			}
		})
	}
}

// TestPregrantedWindowCarriesOnlyLiveLeases: a pre-grant opens the next
// window during the current one, while a reset's carried leases still live;
// clamped, they all end when the next window starts, so that window leaves
// no room for them (before, its whole pool was withheld for the window).
func TestPregrantedWindowCarriesOnlyLiveLeases(t *testing.T) {
	g := QuotaSpec{Name: "g", Limit: 1000, WindowMs: minute, ChunkTokens: 100, TTLMs: minute, Clamp: true}
	other := QuotaSpec{Name: "other", Limit: 10, WindowMs: minute, ChunkTokens: 1, TTLMs: minute}
	for _, pre := range []bool{false, true} {
		h := newHarness(t)
		h.publish(t0, g, other)
		h.acquire(t0+1000, "eu", "eu-1", Want{Quota: "g", Tokens: 1000})
		h.publish(t0+2000, other)    // g removed: its 1000 live tokens are carried
		h.publish(t0+2500, g, other) // and added back
		if got := h.acquireAt(t0+3000, "us", "g", 100); got != 0 {
			t.Fatalf("pre=%v: us got %d in the window whose 1000 are still leased", pre, got)
		}
		if pre {
			// An agent's usual pre-grant ask in the second half of the window.
			h.acquire(t0+45_000, "us", "us-pre", Want{Quota: "g", Tokens: 100, Next: true})
		}
		if w := h.f.CurrentWindow("g", t0+minute); w.Carried != 0 {
			t.Errorf("pre=%v: next window carries %d, but every carried lease ended at its start", pre, w.Carried)
		}
		if got := h.acquireAt(t0+minute, "us", "g", 1000); got < 900 {
			t.Errorf("pre=%v: us got %d of the next window's pool (at most its own 100 pre-granted are out)", pre, got)
		}
	}
}
