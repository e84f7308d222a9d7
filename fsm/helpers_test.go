package fsm

import (
	"bytes"
	"errors"
	"fmt"
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
// snapshot is byte-identical, and returns it.
func roundTrip(t tb, snap []byte) *FSM {
	t.Helper()
	f := New()
	if err := restore(f, snap); err != nil {
		t.Fatalf("Restore: %v", err)
	}
	if got := snapshotBytes(t, f); !bytes.Equal(got, snap) {
		t.Fatalf("restored snapshot differs:\n%s\n%s", got, snap)
	}
	return f
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
