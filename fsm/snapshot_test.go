package fsm

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
)

// busyHarness applies a fixed mix of every command to a fresh FSM.
func busyHarness(t testing.TB) *harness {
	h := newHarness(t)
	birch := QuotaSpec{Name: "birch", Limit: 500, WindowMs: 10_000, ChunkTokens: 20, TTLMs: 4_000, Regions: []string{"eu", "us"}, FallbackPerRegion: 5}
	h.publish(t0, atlas(StrategyFairShare), birch)
	h.apply(Command{Type: CmdSetMember, NowUnixMs: t0, Member: &SetMember{ID: "a2", APIAddress: "10.0.0.2:7000"}})
	h.apply(Command{Type: CmdSetMember, NowUnixMs: t0, Member: &SetMember{ID: "a1", APIAddress: "10.0.0.1:7000"}})
	for i := range 40 {
		now := t0 + int64(i)*700
		region := []string{"eu", "us", "apac"}[i%3]
		wants := []Want{{Quota: "atlas", Tokens: int64(i % 50), DemandPerSecond: float64(i) / 3}}
		if region != "apac" {
			wants = append(wants, Want{Quota: "birch", DemandPerSecond: 1.25})
		}
		r := h.acquire(now, region, fmt.Sprint("req-", i), wants...)
		if id := r.Grants[0].GrantID; id != "" && i%4 == 0 {
			h.release(now+1, region, id, 1)
		} else if id != "" && i%4 == 1 {
			h.apply(Command{Type: CmdRelease, NowUnixMs: now + 1, Release: &Release{Region: region, GrantID: id, Tokens: 1, RequestID: fmt.Sprint("rel-", i)}})
		}
		if i == 20 {
			changed := atlas(StrategyFairShare)
			changed.Limit = 700
			h.publish(now+2, changed, birch)
		}
	}
	return h
}

func TestSnapshotDeterministic(t *testing.T) {
	a, b := busyHarness(t), busyHarness(t)
	sa, sb := snapshotBytes(t, a.f), snapshotBytes(t, b.f)
	if !bytes.Equal(sa, sb) {
		t.Fatal("same log, different snapshots")
	}
	if !bytes.Equal(sa, snapshotBytes(t, a.f)) {
		t.Fatal("two snapshots of one state differ")
	}
	for _, want := range []string{`{"format":1,`, `"author":"alice"`, `"request_id":"req-39"`, `"request_id":"rel-37"`, `"demand":`} {
		if !bytes.Contains(sa, []byte(want)) {
			t.Fatalf("snapshot lacks %s", want)
		}
	}
}

func TestSnapshotRestoreRoundTrip(t *testing.T) {
	h := busyHarness(t)
	want := snapshotBytes(t, h.f)
	f := New()
	if err := restore(f, want); err != nil {
		t.Fatalf("Restore: %v", err)
	}
	if got := snapshotBytes(t, f); !bytes.Equal(got, want) {
		t.Fatalf("round trip changed the snapshot:\n%s\n%s", got, want)
	}
	// The restored FSM answers reads and continues the log identically.
	if fmt.Sprint(f.Stats()) != fmt.Sprint(h.f.Stats()) {
		t.Fatalf("stats %+v vs %+v", f.Stats(), h.f.Stats())
	}
	now := h.f.Now()
	if fmt.Sprint(f.CurrentWindow("atlas", now)) != fmt.Sprint(h.f.CurrentWindow("atlas", now)) {
		t.Fatal("restored window differs")
	}
	r := newHarness(t)
	r.f, r.index = f, h.index
	for i, c := range []Command{
		{Type: CmdAcquire, NowUnixMs: now + 10, Acquire: &Acquire{Region: "eu", RequestID: "req-39", Wants: []Want{{Quota: "atlas"}}}}, // a replay
		{Type: CmdAcquire, NowUnixMs: now + 20, Acquire: &Acquire{Region: "us", RequestID: "new", Wants: []Want{{Quota: "atlas", DemandPerSecond: 4}}}},
	} {
		if got, want := fmt.Sprintf("%+v", r.apply(c)), fmt.Sprintf("%+v", h.apply(c)); got != want {
			t.Fatalf("command %d: restored FSM answered %s, original %s", i, got, want)
		}
	}
	if !bytes.Equal(snapshotBytes(t, f), snapshotBytes(t, h.f)) {
		t.Fatal("states diverged after restore")
	}
}

func TestRestoreRejectsBadSnapshots(t *testing.T) {
	good := snapshotBytes(t, busyHarness(t).f)
	// edit decodes the snapshot's lines (header, policies, quotas,
	// idempotency records), lets mod change them and re-encodes them.
	edit := func(mod func(lines []map[string]any)) []byte {
		var lines []map[string]any
		for _, l := range bytes.Split(bytes.TrimSpace(good), []byte("\n")) {
			var m map[string]any
			if err := json.Unmarshal(l, &m); err != nil {
				t.Fatal(err)
			}
			lines = append(lines, m)
		}
		mod(lines)
		var out []byte
		for _, m := range lines {
			b, _ := json.Marshal(m)
			out = append(append(out, b...), '\n')
		}
		return out
	}
	header := func(l []map[string]any) map[string]any { return l[0] }
	policy := func(l []map[string]any, i int) map[string]any { return l[1+i] }
	quota0 := func(l []map[string]any) map[string]any { return l[1+int(header(l)["policies"].(float64))] }
	idem0 := func(l []map[string]any) map[string]any {
		return l[1+int(header(l)["policies"].(float64))+int(header(l)["quotas"].(float64))]
	}
	window0 := func(l []map[string]any) map[string]any { return quota0(l)["windows"].([]any)[0].(map[string]any) }
	grant0 := func(l []map[string]any) map[string]any { return window0(l)["grants"].([]any)[0].(map[string]any) }

	// Control: the editing itself (decode and re-encode) keeps it valid.
	if err := restore(New(), edit(func([]map[string]any) {})); err != nil {
		t.Fatalf("unedited snapshot rejected: %v", err)
	}
	tests := []struct {
		name string
		give []byte
	}{
		{name: "empty", give: nil},
		{name: "garbage", give: []byte("\x00\x01garbage")},
		{name: "truncated", give: good[:len(good)/2]},
		{name: "trailing data", give: append(append([]byte{}, good...), []byte(`{}`)...)},
		{name: "unknown field", give: edit(func(l []map[string]any) { header(l)["extra"] = 1 })},
		{name: "future format", give: edit(func(l []map[string]any) { header(l)["format"] = 2 })},
		{name: "negative now", give: edit(func(l []map[string]any) { header(l)["now_unix_ms"] = -5 })},
		{name: "count too high", give: edit(func(l []map[string]any) { header(l)["idempotency"] = header(l)["idempotency"].(float64) + 1 })},
		{name: "count too low", give: edit(func(l []map[string]any) { header(l)["idempotency"] = header(l)["idempotency"].(float64) - 1 })},
		{name: "policy version gap", give: edit(func(l []map[string]any) { policy(l, 1)["version"] = 7 })},
		{name: "invalid spec", give: edit(func(l []map[string]any) {
			policy(l, 1)["quotas"].([]any)[0].(map[string]any)["limit"] = 0
		})},
		{name: "quota not in policy", give: edit(func(l []map[string]any) { quota0(l)["name"] = "ghost" })},
		{name: "over-released grant", give: edit(func(l []map[string]any) { grant0(l)["released"] = 1e9 })},
		{name: "duplicate grant id", give: edit(func(l []map[string]any) {
			window0(l)["grants"] = append(window0(l)["grants"].([]any), window0(l)["grants"].([]any)[0])
		})},
		{name: "window too old", give: edit(func(l []map[string]any) { window0(l)["index"] = window0(l)["index"].(float64) - 10 })},
		{name: "bad idempotency kind", give: edit(func(l []map[string]any) { idem0(l)["kind"] = 9 })},
		{name: "members out of order", give: edit(func(l []map[string]any) {
			ms := header(l)["members"].([]any)
			ms[0], ms[1] = ms[1], ms[0]
		})},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := busyHarness(t)
			before := snapshotBytes(t, h.f)
			err := restore(h.f, tt.give)
			if !errors.Is(err, ErrBadSnapshot) {
				t.Fatalf("Restore = %v, want ErrBadSnapshot", err)
			}
			if after := snapshotBytes(t, h.f); !bytes.Equal(before, after) {
				t.Fatal("a failed restore changed the state")
			}
		})
	}
}

// failingSink fails every write.
type failingSink struct{ memSink }

func (s *failingSink) Write([]byte) (int, error) { return 0, errors.New("disk full") }

func TestPersistCancelsOnError(t *testing.T) {
	snap, err := busyHarness(t).f.Snapshot()
	if err != nil {
		t.Fatalf("Snapshot: %v", err)
	}
	var sink failingSink
	err = snap.Persist(&sink)
	if err == nil || !strings.Contains(err.Error(), "disk full") {
		t.Fatalf("Persist = %v, want the write error", err)
	}
	if !sink.cancelled {
		t.Fatal("sink not cancelled")
	}
}

func TestSnapshotIsolatedFromLaterApplies(t *testing.T) {
	h := busyHarness(t)
	snap, err := h.f.Snapshot()
	if err != nil {
		t.Fatalf("Snapshot: %v", err)
	}
	var before memSink
	if err := snap.Persist(&before); err != nil {
		t.Fatalf("first Persist: %v", err)
	}
	h.acquire(h.f.Now()+1, "eu", "later", Want{Quota: "atlas", Tokens: 1})
	var again memSink
	if err := snap.Persist(&again); err != nil {
		t.Fatalf("second Persist: %v", err)
	}
	if !bytes.Equal(before.Bytes(), again.Bytes()) {
		t.Fatal("a snapshot taken earlier changed after a later Apply")
	}
}

// TestRestoreAcceptsRecycledTokens: a window counts every token it granted,
// released ones too, so tokens released and granted again sum past twice
// the largest limit while what is outstanding stays within the limit. Such a
// state is reachable by valid commands, so its snapshot must restore: a
// follower that cannot install it stops (raft panics on a failed restore).
func TestRestoreAcceptsRecycledTokens(t *testing.T) {
	h := newHarness(t)
	h.publish(t0, QuotaSpec{Name: "big", Limit: MaxLimit, WindowMs: 60_000, ChunkTokens: MaxLimit, TTLMs: 30_000, Regions: []string{"eu"}})
	for i := range 3 {
		now := t0 + int64(i)*10
		g := h.acquire(now, "eu", fmt.Sprint("a-", i), Want{Quota: "big", Tokens: MaxLimit}).Grants[0]
		if g.Tokens != MaxLimit {
			t.Fatalf("acquire %d: %d tokens, want the whole limit (the earlier ones were released)", i, g.Tokens)
		}
		h.release(now+1, "eu", g.GrantID, MaxLimit)
	}
	b := snapshotBytes(t, h.f)
	f := New()
	if err := restore(f, b); err != nil {
		t.Fatalf("Restore of a state valid commands reached: %v", err)
	}
	if got := snapshotBytes(t, f); !bytes.Equal(got, b) {
		t.Fatal("round trip changed the snapshot")
	}
}
