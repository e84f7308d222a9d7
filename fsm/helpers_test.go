package fsm

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"testing"

	"github.com/hashicorp/raft"
)

// minute is the window of the reference design's examples.
const minute = 60_000

// t0 is the start of a minute-aligned window, in Unix milliseconds.
const t0 = 1_700_000_040_000

// tb is the part of testing.TB that rapid.T also has.
type tb interface {
	Helper()
	Fatalf(format string, args ...any)
}

// harness applies commands to an FSM with consecutive log indexes and keeps
// the log so that it can be replayed.
type harness struct {
	t     tb
	f     *FSM
	index uint64
	log   [][]byte
	// results holds every Apply result, printed.
	results []string
	// strict makes every rejected command check that the state is
	// untouched, by comparing snapshots.
	strict bool
}

func newHarness(t tb) *harness {
	return &harness{t: t, f: New()}
}

func (h *harness) applyBytes(b []byte) any {
	var before []byte
	if h.strict {
		before = snapshotBytes(h.t, h.f)
	}
	h.index++
	h.log = append(h.log, b)
	res := h.f.Apply(&raft.Log{Index: h.index, Type: raft.LogCommand, Data: b})
	h.results = append(h.results, fmt.Sprintf("%+v", res))
	if err, isErr := res.(error); isErr && h.strict {
		if after := snapshotBytes(h.t, h.f); !bytes.Equal(before, after) {
			h.t.Fatalf("rejected command changed the state: %v", err)
		}
	}
	return res
}

func (h *harness) apply(c Command) any {
	h.t.Helper()
	b, err := Encode(c)
	if err != nil {
		h.t.Fatalf("Encode: %v", err)
	}
	return h.applyBytes(b)
}

func (h *harness) publish(now int64, specs ...QuotaSpec) *PublishResult {
	h.t.Helper()
	p, _ := h.f.Policy()
	res := h.apply(Command{Type: CmdPublishPolicy, NowUnixMs: now, Publish: &Publish{
		ExpectedVersion: p.Version + 1, Author: "alice", Reason: "test", Document: []byte("doc"), Quotas: specs,
	}})
	r, ok := res.(*PublishResult)
	if !ok {
		h.t.Fatalf("publish: %v", res)
	}
	return r
}

func (h *harness) acquireRes(now int64, region, id string, wants ...Want) any {
	return h.apply(Command{Type: CmdAcquire, NowUnixMs: now, Acquire: &Acquire{Region: region, RequestID: id, Wants: wants}})
}

func (h *harness) acquire(now int64, region, id string, wants ...Want) *AcquireResult {
	h.t.Helper()
	res := h.acquireRes(now, region, id, wants...)
	r, ok := res.(*AcquireResult)
	if !ok {
		h.t.Fatalf("acquire %s/%s: %v", region, id, res)
	}
	return r
}

func (h *harness) releaseRes(now int64, region, grantID string, tokens int64) any {
	return h.apply(Command{Type: CmdRelease, NowUnixMs: now, Release: &Release{Region: region, GrantID: grantID, Tokens: tokens}})
}

func (h *harness) release(now int64, region, grantID string, tokens int64) *ReleaseResult {
	h.t.Helper()
	res := h.releaseRes(now, region, grantID, tokens)
	r, ok := res.(*ReleaseResult)
	if !ok {
		h.t.Fatalf("release %s: %v", grantID, res)
	}
	return r
}

// memSink is an in-memory raft.SnapshotSink.
type memSink struct {
	bytes.Buffer
	cancelled, closed bool
}

func (s *memSink) ID() string    { return "mem" }
func (s *memSink) Cancel() error { s.cancelled = true; return nil }
func (s *memSink) Close() error  { s.closed = true; return nil }

func snapshotBytes(t tb, f *FSM) []byte {
	t.Helper()
	b, err := persistSnapshot(f)
	if err != nil {
		t.Fatalf("%v", err)
	}
	return b
}

// persistSnapshot returns f's snapshot bytes. Unlike snapshotBytes it does
// not fail the test, so goroutines other than the test's may call it.
func persistSnapshot(f *FSM) ([]byte, error) {
	snap, err := f.Snapshot()
	if err != nil {
		return nil, fmt.Errorf("Snapshot: %w", err)
	}
	defer snap.Release()
	var sink memSink
	if err := snap.Persist(&sink); err != nil {
		return nil, fmt.Errorf("Persist: %w", err)
	}
	if !sink.closed || sink.cancelled {
		return nil, fmt.Errorf("Persist left sink closed=%v cancelled=%v", sink.closed, sink.cancelled)
	}
	return sink.Bytes(), nil
}

// roundTrip restores snap into a new FSM, checks that the new FSM's
// snapshot is byte-identical (for a snapshot of an older build: the same
// records, labeled and sealed as this build writes them), and returns it.
func roundTrip(t tb, snap []byte) *FSM {
	t.Helper()
	f := New()
	if err := restore(f, snap); err != nil {
		t.Fatalf("Restore: %v", err)
	}
	want := snap
	if bytes.HasPrefix(snap, []byte(oldPrefix)) {
		want = upgradeSnapshot(t, snap)
	}
	if got := snapshotBytes(t, f); !bytes.Equal(got, want) {
		t.Fatalf("restored snapshot differs:\n%s\n%s", got, want)
	}
	return f
}

// checkReplay asserts that replaying h's log into a fresh FSM reaches h's
// state (a byte-identical snapshot) and that the snapshot round-trips.
func checkReplay(t tb, h *harness) {
	t.Helper()
	snap := snapshotBytes(t, h.f)
	replica := newHarness(t)
	for _, b := range h.log {
		replica.applyBytes(b)
	}
	if !bytes.Equal(snapshotBytes(t, replica.f), snap) {
		t.Fatalf("replayed log gives a different snapshot")
	}
	roundTrip(t, snap)
}

// The first bytes of snapshots of this build and of older ones, and the
// length of this build's integrity trailer. The test spells the format
// out on its own rather than reuse snapshot.go's, so it pins it.
const (
	newPrefix      = `{"format":2,`
	oldPrefix      = `{"format":1,`
	testTrailerLen = len(`{"length":"00000000000000000000","crc32c":"00000000"}` + "\n")
)

// sealSnapshot appends to body the integrity trailer Persist writes: the
// length and CRC-32C (Castagnoli) of body.
func sealSnapshot(body []byte) []byte {
	sum := crc32.Checksum(body, crc32.MakeTable(crc32.Castagnoli))
	return fmt.Appendf(bytes.Clone(body), `{"length":"%020d","crc32c":"%08x"}`+"\n", len(body), sum)
}

// snapshotBody checks the integrity trailer of snap, a snapshot of this
// build, and returns the bytes before it.
func snapshotBody(t tb, snap []byte) []byte {
	t.Helper()
	if len(snap) < testTrailerLen || !bytes.HasPrefix(snap, []byte(newPrefix)) {
		t.Fatalf("not a snapshot of this build:\n%s", snap)
	}
	body := snap[:len(snap)-testTrailerLen]
	if got := sealSnapshot(body); !bytes.Equal(got, snap) {
		t.Fatalf("snapshot trailer %q, want %q", snap[len(body):], got[len(body):])
	}
	return body
}

// upgradeSnapshot returns what this build writes for the state of old, a
// snapshot of an older build: the same records, the header labeled format
// 2, then the integrity trailer.
func upgradeSnapshot(t tb, old []byte) []byte {
	t.Helper()
	rest, ok := bytes.CutPrefix(old, []byte(oldPrefix))
	if !ok {
		t.Fatalf("not a snapshot of an older build:\n%s", old)
	}
	return sealSnapshot(append([]byte(newPrefix), rest...))
}

// downgradeSnapshot returns what an older build wrote for the state of
// snap, a snapshot of this build: its records, format 1, no trailer.
func downgradeSnapshot(t tb, snap []byte) []byte {
	t.Helper()
	return append([]byte(oldPrefix), snapshotBody(t, snap)[len(newPrefix):]...)
}

// snapshotRecords decodes the records of snap, a snapshot of this build,
// into maps for a test to edit.
func snapshotRecords(t tb, snap []byte) []map[string]any {
	t.Helper()
	var records []map[string]any
	for _, l := range bytes.Split(bytes.TrimSuffix(snapshotBody(t, snap), []byte("\n")), []byte("\n")) {
		var m map[string]any
		if err := json.Unmarshal(l, &m); err != nil {
			t.Fatalf("%v", err)
		}
		records = append(records, m)
	}
	return records
}

// encodeRecords writes records (a header, then the rest) back as a
// snapshot: sealed, as this build writes one, with the header's format
// first; or, with sealed false, as an older build did, format 2 written as
// 1 and no trailer.
func encodeRecords(t tb, records []map[string]any, sealed bool) []byte {
	t.Helper()
	h := make(map[string]any, len(records[0]))
	for k, v := range records[0] {
		h[k] = v
	}
	format := h["format"]
	if f, _ := format.(float64); f == 2 && !sealed {
		format = 1
	}
	delete(h, "format")
	fb, err := json.Marshal(format)
	if err != nil {
		t.Fatalf("%v", err)
	}
	out := append([]byte(`{"format":`), fb...)
	hb, err := json.Marshal(h)
	if err != nil {
		t.Fatalf("%v", err)
	}
	if len(hb) > 2 {
		out = append(out, ',')
	}
	out = append(append(out, hb[1:]...), '\n')
	for _, m := range records[1:] {
		b, err := json.Marshal(m)
		if err != nil {
			t.Fatalf("%v", err)
		}
		out = append(append(out, b...), '\n')
	}
	if sealed {
		out = sealSnapshot(out)
	}
	return out
}

func restore(f *FSM, b []byte) error {
	return f.Restore(io.NopCloser(bytes.NewReader(b)))
}

// atlas is the reference design's quota: 1,000 per minute, chunks of 100,
// 15 s leases clamped to the window.
func atlas(strategy Strategy) QuotaSpec {
	return QuotaSpec{Name: "atlas", Limit: 1000, WindowMs: minute, ChunkTokens: 100, TTLMs: 15_000, Clamp: true, Strategy: strategy}
}

func wantErr(t testing.TB, res any, target error) error {
	t.Helper()
	err, ok := res.(error)
	if !ok {
		t.Fatalf("got %#v, want error %v", res, target)
	}
	if !errors.Is(err, target) {
		t.Fatalf("got error %v, want %v", err, target)
	}
	return err
}
