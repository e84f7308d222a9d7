package agent_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/allot-dev/allot/pkg/agent"
	"github.com/allot-dev/allot/pkg/checkclient"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
	"github.com/allot-dev/allot/proto/allot/v1/allotv1connect"
)

// collectBatch reads a CheckBatch stream to its end: every outcome by index
// (failing on an index answered twice or out of range) and the number of
// messages.
func collectBatch(t *testing.T, c allotv1connect.AdmissionServiceClient, checks ...*allotv1.CheckRequest) (map[uint32]*allotv1.CheckOutcome, int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	stream, err := c.CheckBatch(ctx, connect.NewRequest(&allotv1.CheckBatchRequest{Checks: checks}))
	if err != nil {
		t.Fatalf("CheckBatch: %v", err)
	}
	defer stream.Close()
	got := map[uint32]*allotv1.CheckOutcome{}
	msgs := 0
	for stream.Receive() {
		msgs++
		for _, o := range stream.Msg().GetOutcomes() {
			if _, dup := got[o.GetIndex()]; dup || int(o.GetIndex()) >= len(checks) {
				t.Fatalf("outcome for check %d: answered twice or out of range", o.GetIndex())
			}
			got[o.GetIndex()] = o
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatalf("CheckBatch stream: %v", err)
	}
	if len(got) != len(checks) {
		t.Fatalf("%d outcomes for %d checks", len(got), len(checks))
	}
	return got, msgs
}

// TestCheckBatchDecidesEachCheckOnItsOwn: on the Connect API and on the gRPC
// listener, every check of a batch gets its own outcome: decisions as Check
// gives them, and each bad check its own error naming the check and the
// field (checks[i].cost), debiting nothing. A batch over the limit fails as
// a whole and debits nothing.
func TestCheckBatchDecidesEachCheckOnItsOwn(t *testing.T) {
	onBothListeners(t, func(t *testing.T, c allotv1connect.AdmissionServiceClient) {
		u1 := entries("tenant", "acme", "user", "u1")
		got, _ := collectBatch(t, c,
			&allotv1.CheckRequest{Entries: u1},
			&allotv1.CheckRequest{Entries: u1, Cost: -1},
			&allotv1.CheckRequest{Entries: entries("tenant", "acme", "user", "u2"), Cost: 5},
			&allotv1.CheckRequest{Entries: entries("tenant", "acme", "tenant", "beta")},
			&allotv1.CheckRequest{Entries: u1, Cost: 2},
		)
		for _, i := range []uint32{0, 2, 4} {
			r := got[i].GetResponse()
			if r == nil || !r.Allowed || r.Rule != "bucket" || r.DecisionId == "" || got[i].GetError() != nil {
				t.Fatalf("check %d: %v, want allowed by bucket", i, got[i])
			}
		}
		// u1's checks 0 and 4 were decided concurrently: 3 units in all.
		if r0, r4 := got[0].GetResponse().Remaining, got[4].GetResponse().Remaining; min(r0, r4) != 97 || max(r0, r4) < 98 {
			t.Fatalf("u1 remaining after its two checks: %d and %d, want 97 after both", r0, r4)
		}
		if r := got[2].GetResponse(); r.Remaining != 95 {
			t.Fatalf("u2 remaining %d, want 95", r.Remaining)
		}
		for i, want := range map[uint32]string{1: "checks[1].cost: must not be negative", 3: "checks[3].entries[1].key"} {
			e := got[i].GetError()
			if got[i].GetResponse() != nil || e.GetCode() != connect.CodeInvalidArgument.String() || !strings.Contains(e.GetMessage(), want) {
				t.Fatalf("check %d: %v, want invalid_argument naming %q", i, got[i], want)
			}
		}
		if r := check(t, c, &allotv1.CheckRequest{Entries: u1}); r.Remaining != 96 {
			t.Fatalf("u1 after the batch: %d left, want 96 (the bad check debited nothing)", r.Remaining)
		}

		tooMany := make([]*allotv1.CheckRequest, agent.MaxBatchChecks+1)
		for i := range tooMany {
			tooMany[i] = &allotv1.CheckRequest{Entries: u1}
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		stream, err := c.CheckBatch(ctx, connect.NewRequest(&allotv1.CheckBatchRequest{Checks: tooMany}))
		if err == nil {
			for stream.Receive() {
				t.Fatal("an oversized batch was answered")
			}
			err = stream.Err()
			stream.Close()
		}
		if connect.CodeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), "checks: 1025 checks") {
			t.Fatalf("batch of %d: %v, want InvalidArgument naming checks", len(tooMany), err)
		}
		if r := check(t, c, &allotv1.CheckRequest{Entries: u1}); r.Remaining != 95 {
			t.Fatalf("u1 after the refused batch: %d left, want 95", r.Remaining)
		}
		if got, _ := collectBatch(t, c); len(got) != 0 {
			t.Fatalf("empty batch: %d outcomes", len(got))
		}
	})
}

// TestCheckBatchAnswersWithoutWaitingForTheSlowest: a check that waits for a
// renewal holds back no other check of its batch; its own answer follows
// when the renewal lands.
func TestCheckBatchAnswersWithoutWaitingForTheSlowest(t *testing.T) {
	rdb, fa, doc, cfg := threeQuotasAgent(t)
	cfg.StarveWait = 5 * time.Second
	release := make(chan struct{})
	fa.setHook(func(ctx context.Context, _ *allotv1.AcquireRequest, commit func() (*allotv1.AcquireResponse, error)) (*allotv1.AcquireResponse, error) {
		select {
		case <-release:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
		return commit()
	})
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1)))
	s := serve(t, a.Agent)

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	stream, err := s.connect.CheckBatch(ctx, connect.NewRequest(&allotv1.CheckBatchRequest{Checks: []*allotv1.CheckRequest{
		{Entries: entries("tenant", "a")},           // waits for q-a's first renewal
		{Entries: entries("tenant", "nobody")},      // matches no rule
		{Entries: entries("tenant", "a"), Cost: -1}, // bad input
	}}))
	if err != nil {
		t.Fatal(err)
	}
	defer stream.Close()
	got := map[uint32]*allotv1.CheckOutcome{}
	for len(got) < 2 {
		if !stream.Receive() {
			t.Fatalf("stream ended after %d outcomes: %v", len(got), stream.Err())
		}
		for _, o := range stream.Msg().GetOutcomes() {
			got[o.GetIndex()] = o
		}
	}
	if _, early := got[0]; early || got[1].GetResponse() == nil || !got[1].GetResponse().Allowed || got[2].GetError() == nil {
		t.Fatalf("first outcomes %v: want checks 1 (allowed) and 2 (an error) while check 0 waits", got)
	}
	close(release)
	if !stream.Receive() {
		t.Fatalf("stream ended before check 0: %v", stream.Err())
	}
	last := stream.Msg().GetOutcomes()
	if len(last) != 1 || last[0].GetIndex() != 0 || !last[0].GetResponse().GetAllowed() || last[0].GetResponse().GetRule() != "q-a" {
		t.Fatalf("last message %v: want check 0 allowed by q-a after the renewal", last)
	}
	if stream.Receive() {
		t.Fatalf("a message after every check was answered: %v", stream.Msg())
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
}

// TestCheckClientThroughTheAgent: the coalescing client answers what Check
// answers, bad input included (the same table as the Connect API), and its
// concurrent callers each get their own decision.
func TestCheckClientThroughTheAgent(t *testing.T) {
	_, s := standalone(t, nil)
	cc, err := checkclient.New(s.connect, checkclient.Config{})
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	badInput(t, cc)

	// 40 callers, 2 checks each of cost 1 on their own user, all at once:
	// every user ends at 98 left, whichever batches carried the checks.
	const callers = 40
	errc := make(chan error, callers)
	for i := range callers {
		go func() {
			user := entries("tenant", "acme", "user", "c"+string(rune('A'+i)))
			var err error
			for range 2 {
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				var resp *connect.Response[allotv1.CheckResponse]
				resp, err = cc.Check(ctx, connect.NewRequest(&allotv1.CheckRequest{Entries: user}))
				cancel()
				if err == nil && !resp.Msg.Allowed {
					err = connect.NewError(connect.CodeInternal, nil)
				}
				if err != nil {
					break
				}
			}
			errc <- err
		}()
	}
	for range callers {
		if err := <-errc; err != nil {
			t.Fatalf("concurrent check: %v", err)
		}
	}
	for i := range callers {
		user := entries("tenant", "acme", "user", "c"+string(rune('A'+i)))
		if r := check(t, s.connect, &allotv1.CheckRequest{Entries: user}); r.Remaining != 97 {
			t.Fatalf("user %d: %d left after its third check, want 97", i, r.Remaining)
		}
	}
}

// TestCheckWithoutEntriesIsInvalid: a check with no entries at all is a
// gateway's bug, not a request no rule matches: Check (Connect and the gRPC
// listener) answers InvalidArgument naming entries, and a batch answers
// that check InvalidArgument naming checks[i].entries, the others decided.
// Entries whose values are empty stay a request (an empty value counts as
// absent).
func TestCheckWithoutEntriesIsInvalid(t *testing.T) {
	onBothListeners(t, func(t *testing.T, c allotv1connect.AdmissionServiceClient) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := c.Check(ctx, connect.NewRequest(&allotv1.CheckRequest{RequestId: "r1"}))
		if connect.CodeOf(err) != connect.CodeInvalidArgument || !strings.Contains(err.Error(), "entries: must not be empty") {
			t.Fatalf("Check without entries: %v, want InvalidArgument naming entries", err)
		}
		if r := check(t, c, &allotv1.CheckRequest{Entries: entries("tenant", "")}); !r.Allowed {
			t.Fatalf("Check with an empty value: %+v, want allowed (no rule matches)", r)
		}
		got, _ := collectBatch(t, c,
			&allotv1.CheckRequest{Entries: entries("tenant", "acme", "user", "u1")},
			&allotv1.CheckRequest{},
		)
		if r := got[0].GetResponse(); r == nil || !r.Allowed || r.Rule != "bucket" {
			t.Fatalf("check 0: %v, want allowed by bucket", got[0])
		}
		if e := got[1].GetError(); got[1].GetResponse() != nil || e.GetCode() != connect.CodeInvalidArgument.String() ||
			!strings.Contains(e.GetMessage(), "checks[1].entries: must not be empty") {
			t.Fatalf("check 1: %v, want invalid_argument naming checks[1].entries", got[1])
		}
	})
}
