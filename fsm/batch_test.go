package fsm

import (
	"errors"
	"testing"
)

// TestBatchAppliesEachCommandOnItsOwn checks a group-committed entry: each
// command succeeds or fails alone, grant ids stay unique across the entry,
// and a failing command leaves no trace.
func TestBatchAppliesEachCommandOnItsOwn(t *testing.T) {
	h := newHarness(t)
	h.strict = true
	h.publish(t0, atlas(StrategyDemand))
	first := h.acquire(t0+1, "us", "pre", Want{Quota: "atlas", Tokens: 50})
	res := h.apply(Command{Type: CmdBatch, NowUnixMs: t0 + 2, Batch: []Command{
		{Type: CmdAcquire, Acquire: &Acquire{Region: "eu", RequestID: "a", Wants: []Want{{Quota: "atlas", Tokens: 100}}}},
		{Type: CmdAcquire, Acquire: &Acquire{Region: "eu", RequestID: "b", Wants: []Want{{Quota: "nope"}}}},
		{Type: CmdRelease, Release: &Release{Region: "us", GrantID: first.Grants[0].GrantID, Tokens: 20}},
		{Type: CmdAcquire, Acquire: &Acquire{Region: "us", RequestID: "c", Wants: []Want{{Quota: "atlas", Tokens: 200}}}},
		{Type: CmdAcquire, Acquire: &Acquire{Region: "eu", RequestID: "a", Wants: []Want{{Quota: "atlas", Tokens: 100}}}},
	}})
	br, ok := res.(*BatchResult)
	if !ok || len(br.Results) != 5 {
		t.Fatalf("batch result %+v", res)
	}
	a, okA := br.Results[0].(*AcquireResult)
	c, okC := br.Results[3].(*AcquireResult)
	if !okA || !okC || a.Grants[0].Tokens != 100 || c.Grants[0].Tokens != 200 {
		t.Fatalf("acquires in batch: %+v / %+v", br.Results[0], br.Results[3])
	}
	if a.Grants[0].GrantID == c.Grants[0].GrantID {
		t.Errorf("grant ids collide inside a batch: %s", a.Grants[0].GrantID)
	}
	if err, isErr := br.Results[1].(error); !isErr || !errors.Is(err, ErrUnknownQuota) {
		t.Errorf("bad command in batch: got %v, want ErrUnknownQuota", br.Results[1])
	}
	if r, ok := br.Results[2].(*ReleaseResult); !ok || r.Returned != 20 {
		t.Errorf("release in batch: %+v", br.Results[2])
	}
	if r, ok := br.Results[4].(*AcquireResult); !ok || !r.Replayed || r.Grants[0].GrantID != a.Grants[0].GrantID {
		t.Errorf("a retry inside the same batch must replay: %+v", br.Results[4])
	}
	w := h.f.CurrentWindow("atlas", t0+2)
	if w.Granted != 350 || w.Released != 20 || w.Remaining != 1000-330 {
		t.Errorf("window after batch: granted %d released %d remaining %d", w.Granted, w.Released, w.Remaining)
	}
	// The next entry still gets fresh grant ids.
	next := h.acquire(t0+3, "eu", "d", Want{Quota: "atlas", Tokens: 1})
	for _, id := range []string{a.Grants[0].GrantID, c.Grants[0].GrantID, first.Grants[0].GrantID} {
		if next.Grants[0].GrantID == id {
			t.Errorf("grant id %s reused", id)
		}
	}
}

func TestBatchDecodeRejectsNesting(t *testing.T) {
	enc := func(c Command) []byte {
		b, err := Encode(c)
		if err != nil {
			t.Fatalf("Encode: %v", err)
		}
		return b
	}
	// releases returns n valid Release sub-commands, so that only the
	// batch's size can make Decode refuse them.
	releases := func(n int) []Command {
		cmds := make([]Command, n)
		for i := range cmds {
			cmds[i] = Command{Type: CmdRelease, Release: &Release{Region: "eu", GrantID: grantID(1, i), Tokens: 1}}
		}
		return cmds
	}
	// The limit itself is accepted: the cases below fail for the reason
	// they name.
	if c, err := Decode(enc(Command{Type: CmdBatch, Batch: releases(MaxBatch)})); err != nil || len(c.Batch) != MaxBatch {
		t.Fatalf("a batch of MaxBatch releases: %d commands, %v", len(c.Batch), err)
	}
	tests := []struct {
		name string
		give []byte
	}{
		// Encode leaves an empty Batch out (omitempty): write the bytes.
		{"empty", append([]byte{FormatV1}, `{"type":5,"batch":[]}`...)},
		{"null", append([]byte{FormatV1}, `{"type":5,"batch":null}`...)},
		{"missing", append([]byte{FormatV1}, `{"type":5}`...)},
		{"publish inside", enc(Command{Type: CmdBatch, Batch: []Command{{Type: CmdPublishPolicy, Publish: &Publish{}}}})},
		{"batch inside", enc(Command{Type: CmdBatch, Batch: []Command{{Type: CmdBatch, Batch: []Command{{Type: CmdRelease, Release: &Release{}}}}}})},
		{"mismatched payload", enc(Command{Type: CmdBatch, Batch: []Command{{Type: CmdAcquire, Release: &Release{}}}})},
		{"too many", enc(Command{Type: CmdBatch, Batch: releases(MaxBatch + 1)})},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if _, err := Decode(tt.give); !errors.Is(err, ErrMalformedCommand) {
				t.Errorf("Decode accepted %s: %v", tt.name, err)
			}
		})
	}
}
