package fsm

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"
	"testing/iotest"
)

// busyHarness applies a fixed mix of every command to a fresh FSM.
func busyHarness(t testing.TB) *harness {
	h := newHarness(t)
	birch := QuotaSpec{Name: "birch", Limit: 500, WindowMs: 10_000, ChunkTokens: 20, TTLMs: 4_000, Regions: []string{"eu", "us"}, FallbackPerRegion: 5}
	h.publish(t0, atlas(StrategyFairShare), birch)
	h.apply(Command{Type: CmdSetMember, NowUnixMs: t0, Member: &SetMember{ID: "a2", APIAddress: "10.0.0.2:7000"}})
	h.apply(Command{Type: CmdSetMember, NowUnixMs: t0, Member: &SetMember{ID: "a1", APIAddress: "10.0.0.1:7000"}})
	h.apply(Command{Type: CmdSetCluster, NowUnixMs: t0, Cluster: &SetCluster{ID: "3f2a9c"}})
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
	for _, want := range []string{`{"format":2,`, `"author":"alice"`, `"request_id":"req-39"`, `"request_id":"rel-37"`, `"demand":`, `"cluster_id":"3f2a9c"`} {
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
	records := snapshotRecords(t, good)
	// edit lets mod change a copy of the snapshot's records (header,
	// policies, quotas, idempotency records) and encodes them: sealed, as
	// this build writes them, or as an older build did. The integrity
	// trailer is recomputed, so what is refused is the content.
	edit := func(sealed bool, mod func(lines []map[string]any)) []byte {
		var lines []map[string]any
		b, _ := json.Marshal(records)
		if err := json.Unmarshal(b, &lines); err != nil {
			t.Fatal(err)
		}
		mod(lines)
		return encodeRecords(t, lines, sealed)
	}
	header := func(l []map[string]any) map[string]any { return l[0] }
	policy := func(l []map[string]any, i int) map[string]any { return l[1+i] }
	quota0 := func(l []map[string]any) map[string]any { return l[1+int(header(l)["policies"].(float64))] }
	idem0 := func(l []map[string]any) map[string]any {
		return l[1+int(header(l)["policies"].(float64))+int(header(l)["quotas"].(float64))]
	}
	window0 := func(l []map[string]any) map[string]any { return quota0(l)["windows"].([]any)[0].(map[string]any) }
	grant0 := func(l []map[string]any) map[string]any { return window0(l)["grants"].([]any)[0].(map[string]any) }

	body := snapshotBody(t, good)
	type test struct {
		name string
		give []byte
		// sealed: the trailer matches, so the records are what is refused.
		sealed bool
	}
	tests := []test{
		{name: "empty", give: nil},
		{name: "garbage", give: []byte("\x00\x01garbage")},
		{name: "truncated", give: good[:len(good)/2]},
		{name: "trailing data", give: append(bytes.Clone(good), `{}`...)},
		{name: "unsealed", give: body},
		{name: "trailing data under the seal", give: sealSnapshot(append(bytes.Clone(body), "{}\n"...)), sealed: true},
		{name: "sealed twice", give: sealSnapshot(good), sealed: true},
		{name: "old format sealed", give: sealSnapshot(downgradeSnapshot(t, good))},
	}
	edits := []struct {
		name string
		mod  func(l []map[string]any)
	}{
		{name: "unknown field", mod: func(l []map[string]any) { header(l)["extra"] = 1 }},
		{name: "future format", mod: func(l []map[string]any) { header(l)["format"] = 3 }},
		{name: "negative now", mod: func(l []map[string]any) { header(l)["now_unix_ms"] = -5 }},
		{name: "count too high", mod: func(l []map[string]any) { header(l)["idempotency"] = header(l)["idempotency"].(float64) + 1 }},
		{name: "count too low", mod: func(l []map[string]any) { header(l)["idempotency"] = header(l)["idempotency"].(float64) - 1 }},
		{name: "policy version gap", mod: func(l []map[string]any) { policy(l, 1)["version"] = 7 }},
		{name: "invalid spec", mod: func(l []map[string]any) {
			policy(l, 1)["quotas"].([]any)[0].(map[string]any)["limit"] = 0
		}},
		{name: "quota not in policy", mod: func(l []map[string]any) { quota0(l)["name"] = "ghost" }},
		{name: "over-released grant", mod: func(l []map[string]any) { grant0(l)["released"] = 1e9 }},
		{name: "duplicate grant id", mod: func(l []map[string]any) {
			window0(l)["grants"] = append(window0(l)["grants"].([]any), window0(l)["grants"].([]any)[0])
		}},
		{name: "window too old", mod: func(l []map[string]any) { window0(l)["index"] = window0(l)["index"].(float64) - 10 }},
		{name: "bad idempotency kind", mod: func(l []map[string]any) { idem0(l)["kind"] = 9 }},
		{name: "bad cluster id", mod: func(l []map[string]any) { header(l)["cluster_id"] = "a b" }},
		{name: "members out of order", mod: func(l []map[string]any) {
			ms := header(l)["members"].([]any)
			ms[0], ms[1] = ms[1], ms[0]
		}},
	}
	for _, sealed := range []bool{true, false} {
		// Control: the editing itself (decode and re-encode) keeps it valid.
		if err := restore(New(), edit(sealed, func([]map[string]any) {})); err != nil {
			t.Fatalf("unedited snapshot (sealed %v) rejected: %v", sealed, err)
		}
		for _, e := range edits {
			name := e.name
			if !sealed {
				name = "old format/" + name
			}
			tests = append(tests, test{name, edit(sealed, e.mod), sealed})
		}
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := busyHarness(t)
			before := snapshotBytes(t, h.f)
			err := restore(h.f, tt.give)
			if !errors.Is(err, ErrBadSnapshot) {
				t.Fatalf("Restore = %v, want ErrBadSnapshot", err)
			}
			if tt.sealed && strings.Contains(err.Error(), "integrity") {
				t.Fatalf("Restore = %v, want the records refused", err)
			}
			if after := snapshotBytes(t, h.f); !bytes.Equal(before, after) {
				t.Fatal("a failed restore changed the state")
			}
		})
	}
}

// damageHarness is a moderately busy state whose snapshot holds a record
// of every kind: members, two policy versions, quotas with windows,
// grants, carried tokens and demand, instances of a template, carry steps
// and idempotency records.
func damageHarness(t testing.TB) *harness {
	h := resetHarness(t)
	h.apply(Command{Type: CmdSetMember, NowUnixMs: t0 + 3000, Member: &SetMember{ID: "a1", APIAddress: "10.0.0.1:7000"}})
	h.acquire(t0+3500, "eu", "c", Want{Quota: "g", DemandPerSecond: 2.5}, Want{Quota: "std/y", Tokens: 3})
	return h
}

// TestRestoreRefusesDamage: every single-bit flip and every truncation of a
// snapshot is refused, though many leave a snapshot the decoder alone
// would accept (a digit of a count, a time or an id changed, a record cut
// at a line's end), and the state is left as it was. Damage past the
// format marker is named as such.
func TestRestoreRefusesDamage(t *testing.T) {
	snap := snapshotBytes(t, damageHarness(t).f)
	h := busyHarness(t)
	before, s := snapshotBytes(t, h.f), h.f.s
	bad, restored := 0, 0
	check := func(what string, at int, b []byte) {
		err := restore(h.f, b)
		msg := ""
		switch {
		case err == nil:
			msg = "restored"
			restored++
		case !errors.Is(err, ErrBadSnapshot):
			msg = fmt.Sprintf("Restore = %v, want ErrBadSnapshot", err)
		case at >= len(newPrefix) && !strings.Contains(err.Error(), "integrity"):
			msg = fmt.Sprintf("Restore = %v, want an integrity error", err)
		}
		if h.f.s != s {
			msg += "; the state was replaced"
			h.f.s = s
		}
		if msg != "" {
			if bad++; bad <= 10 {
				t.Errorf("%s: %s", what, msg)
			}
		}
	}
	b := bytes.Clone(snap)
	for i := range b {
		for bit := range 8 {
			b[i] ^= 1 << bit
			check(fmt.Sprintf("byte %d bit %d flipped", i, bit), i, b)
			b[i] ^= 1 << bit
		}
	}
	for n := range len(snap) {
		check(fmt.Sprintf("truncated to %d of %d bytes", n, len(snap)), n, snap[:n])
	}
	if bad > 0 {
		t.Errorf("%d of %d damaged snapshots not refused as they should be (%d restored)", bad, 9*len(snap), restored)
	}
	if !bytes.Equal(before, snapshotBytes(t, h.f)) {
		t.Fatal("refused restores changed the state")
	}
}

// TestSnapshotFormat pins the framing: a snapshot of this build is the
// records an older build wrote for the same state, format 2 in place of 1,
// then the integrity trailer; the older build's snapshot restores to the
// same state.
func TestSnapshotFormat(t *testing.T) {
	h := damageHarness(t)
	snap := snapshotBytes(t, h.f)
	if !bytes.HasPrefix(snap, []byte(newPrefix)) {
		t.Fatalf("snapshot does not begin with %s:\n%s", newPrefix, snap)
	}
	body := snapshotBody(t, snap)
	if n := bytes.Count(body, []byte("\n")); n != 13 || body[len(body)-1] != '\n' {
		t.Fatalf("%d records, want 13:\n%s", n, body)
	}
	old := downgradeSnapshot(t, snap)
	f := roundTrip(t, old)
	if got := snapshotBytes(t, f); !bytes.Equal(got, snap) {
		t.Fatalf("the older build's snapshot restores to another state:\n%s\n%s", got, snap)
	}
	roundTrip(t, snap)
}

// TestRestoreLargeSnapshot: a snapshot many times Restore's read buffer
// restores whatever sizes the reads return, the trailer found at its very
// end; cut or damaged at the buffer's edges it is refused, and a read error
// is returned, not taken for the end.
func TestRestoreLargeSnapshot(t *testing.T) {
	h := newHarness(t)
	specs := make([]QuotaSpec, 1000)
	wants := make([]Want, len(specs))
	for i := range specs {
		specs[i] = QuotaSpec{Name: fmt.Sprintf("tenant-%04d", i), Limit: 1000, WindowMs: minute, ChunkTokens: 10, TTLMs: 15_000, Clamp: true}
		wants[i] = Want{Quota: specs[i].Name, DemandPerSecond: 1}
	}
	h.publish(t0, specs...)
	h.acquire(t0+1, "eu", "big", wants...)
	snap := snapshotBytes(t, h.f)
	if len(snap) < 8<<16 {
		t.Fatalf("snapshot of %d bytes, want one many times the 64 KiB buffer", len(snap))
	}
	for name, r := range map[string]func(io.Reader) io.Reader{
		"whole":         func(r io.Reader) io.Reader { return r },
		"one byte":      iotest.OneByteReader,
		"half":          iotest.HalfReader,
		"EOF with data": iotest.DataErrReader,
		"odd boundaries": func(r io.Reader) io.Reader {
			return io.MultiReader(io.LimitReader(r, int64(1<<16-testTrailerLen+1)), r)
		},
	} {
		f := New()
		if err := f.Restore(io.NopCloser(r(bytes.NewReader(snap)))); err != nil {
			t.Fatalf("%s: Restore: %v", name, err)
		}
		if !bytes.Equal(snapshotBytes(t, f), snap) {
			t.Fatalf("%s: restored another state", name)
		}
	}
	for _, n := range []int{1<<16 - testTrailerLen, 1<<16 - 1, 1 << 16, 1<<16 + 1, len(snap) - testTrailerLen - 1, len(snap) - testTrailerLen, len(snap) - 1} {
		if err := restore(New(), snap[:n]); !errors.Is(err, ErrBadSnapshot) {
			t.Errorf("cut to %d bytes: Restore = %v", n, err)
		}
		b := bytes.Clone(snap)
		b[n] ^= 1
		if err := restore(New(), b); !errors.Is(err, ErrBadSnapshot) {
			t.Errorf("byte %d flipped: Restore = %v", n, err)
		}
	}
	gone := errors.New("disk gone")
	r := io.MultiReader(bytes.NewReader(snap[:len(snap)/2]), iotest.ErrReader(gone))
	if err := New().Restore(io.NopCloser(r)); !errors.Is(err, ErrBadSnapshot) || !errors.Is(err, gone) {
		t.Errorf("Restore = %v, want the read error", err)
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

// TestSnapshotMembers: the member table and the cluster id come from the
// header alone; what is not a snapshot header is an error.
func TestSnapshotMembers(t *testing.T) {
	snap := snapshotBytes(t, busyHarness(t).f)
	ms, id, err := SnapshotMembers(bytes.NewReader(snap))
	if err != nil || id != "3f2a9c" || fmt.Sprint(ms) != "map[a1:10.0.0.1:7000 a2:10.0.0.2:7000]" {
		t.Fatalf("SnapshotMembers = %v, %q, %v", ms, id, err)
	}
	if _, _, err := SnapshotMembers(strings.NewReader("not json")); err == nil {
		t.Fatal("no error for a non-snapshot")
	}
}
