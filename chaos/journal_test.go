package chaos

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/allot-dev/allot/chaos/check"
	"github.com/allot-dev/allot/chaos/history"
	"github.com/allot-dev/allot/pkg/agent"
)

type eventSink struct {
	mu  sync.Mutex
	evs []history.Event
}

func (s *eventSink) record(evs ...history.Event) {
	s.mu.Lock()
	s.evs = append(s.evs, evs...)
	s.mu.Unlock()
}

func (s *eventSink) all() []history.Event {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]history.Event(nil), s.evs...)
}

const (
	tms  = int64(time.Millisecond)
	tsec = int64(time.Second)
)

// journalLines is an agent's journal: a process whose clock runs 500 ms
// ahead answers r1 on its second attempt (atlas 100 tokens deposited,
// birch none), never hears back on r2, hands back an undeposited grant of
// r3 (a journal without deposit lines for it), fails to deposit r4's grant
// after sending an attempt (withdrawn: nothing spendable after the
// deposit's At) and hands it back, cannot tell whether r5's landed
// (unknown), gives up r6's before sending any attempt (too late) and hands
// it back, and at shutdown withdraws and releases 30 tokens of r1's grant.
// Cut off after r2 went unanswered, it deposits cedar's fallback allowance
// of window 4 (made); after r3's answer, one of window 5 fails (withdrawn)
// (the checks object: the agent was not cut off); after r6's, one of window
// 7 has an unknown outcome. A second process, its clock the machine's,
// deposits window 10's before it ended any Acquire attempt (adding nothing:
// the allowance was in the store).
func journalLines() []agent.LeaseEvent {
	const skew = 500 * tms
	at := func(ns int64) int64 { return ns + skew } // the agent's clock
	wants := []agent.JournalWant{{Quota: "atlas", Tokens: 100}, {Quota: "birch", Tokens: 50}}
	return []agent.LeaseEvent{
		{Kind: agent.LeaseEventStart, At: at(9 * tsec), Region: "eu", ClockOffsetNs: skew, Pid: 42},
		{Kind: agent.LeaseEventAcquire, RequestID: "r1", FirstSent: at(10 * tsec), Sent: at(10 * tsec), At: at(10*tsec + 40*tms), Outcome: agent.LeaseUnknown, Err: "deadline exceeded", Wants: wants},
		{Kind: agent.LeaseEventAcquire, RequestID: "r1", FirstSent: at(10 * tsec), Sent: at(10*tsec + 50*tms), At: at(10*tsec + 150*tms), Outcome: agent.LeaseOK, Wants: wants,
			LeaderNowMs: 10_100, Replayed: true, Grants: []agent.JournalGrant{
				{Quota: "atlas", GrantID: "g1", Tokens: 100, ExpiresMs: 11_600, Window: 3, TTLMs: 1500},
				{Quota: "birch", Tokens: 0, Window: 3, Exhausted: true},
			}},
		{Kind: agent.LeaseEventDeposit, Quota: "atlas", GrantID: "g1", Tokens: 100, Sent: at(10*tsec + 151*tms), At: at(10*tsec + 152*tms),
			Outcome: agent.LeaseOK, ExpiresMs: 11_600, TTLMs: 1000, Deadline: at(11*tsec + 250*tms)},
		{Kind: agent.LeaseEventAcquire, RequestID: "r2", FirstSent: at(13 * tsec), Sent: at(13 * tsec), At: at(14 * tsec), Outcome: agent.LeaseUnknown, Err: "unavailable",
			Wants: []agent.JournalWant{{Quota: "atlas", Tokens: 10}}},
		{Kind: agent.LeaseEventAcquire, RequestID: "r3", FirstSent: at(15 * tsec), Sent: at(15 * tsec), At: at(15*tsec + 80*tms), Outcome: agent.LeaseOK,
			Wants: []agent.JournalWant{{Quota: "atlas", Tokens: 10}}, LeaderNowMs: 15_040,
			Grants: []agent.JournalGrant{{Quota: "atlas", GrantID: "g3", Tokens: 10, ExpiresMs: 15_050, Window: 5}}},
		{Kind: agent.LeaseEventRelease, RequestID: "release-g3", Quota: "atlas", GrantID: "g3", Tokens: 10, Sent: at(15*tsec + 81*tms), At: at(15*tsec + 90*tms), Outcome: agent.LeaseOK, Returned: 10},
		{Kind: agent.LeaseEventRelease, RequestID: "release-g1", Quota: "atlas", GrantID: "g1", Tokens: 30, Sent: at(16 * tsec), At: at(16*tsec + 50*tms), Outcome: agent.LeaseFailed, Code: "not_found", Err: "window gone"},
		{Kind: agent.LeaseEventAcquire, RequestID: "r4", FirstSent: at(17 * tsec), Sent: at(17 * tsec), At: at(17*tsec + 80*tms), Outcome: agent.LeaseOK,
			Wants: []agent.JournalWant{{Quota: "atlas", Tokens: 40}}, LeaderNowMs: 17_040,
			Grants: []agent.JournalGrant{{Quota: "atlas", GrantID: "g4", Tokens: 40, ExpiresMs: 18_500, Window: 5}}},
		{Kind: agent.LeaseEventDeposit, Quota: "atlas", GrantID: "g4", Tokens: 40, Sent: at(17*tsec + 100*tms), At: at(17*tsec + 700*tms),
			Outcome: agent.LeaseFailed, Err: "deposit timed out; withdrawn", ExpiresMs: 18_500, Deadline: at(18*tsec + 250*tms)},
		{Kind: agent.LeaseEventRelease, RequestID: "release-g4", Quota: "atlas", GrantID: "g4", Tokens: 40, Sent: at(17*tsec + 710*tms), At: at(17*tsec + 760*tms), Outcome: agent.LeaseOK, Returned: 40},
		{Kind: agent.LeaseEventAcquire, RequestID: "r5", FirstSent: at(19 * tsec), Sent: at(19 * tsec), At: at(19*tsec + 80*tms), Outcome: agent.LeaseOK,
			Wants: []agent.JournalWant{{Quota: "atlas", Tokens: 50}}, LeaderNowMs: 19_040,
			Grants: []agent.JournalGrant{{Quota: "atlas", GrantID: "g5", Tokens: 50, ExpiresMs: 20_500, Window: 6}}},
		{Kind: agent.LeaseEventDeposit, Quota: "atlas", GrantID: "g5", Tokens: 50, Sent: at(19*tsec + 100*tms), At: at(19*tsec + 600*tms),
			Outcome: agent.LeaseUnknown, Err: "i/o timeout", TTLMs: 900, ExpiresMs: 20_500, Deadline: at(20*tsec + 250*tms)},
		{Kind: agent.LeaseEventAcquire, RequestID: "r6", FirstSent: at(21 * tsec), Sent: at(21 * tsec), At: at(21*tsec + 80*tms), Outcome: agent.LeaseOK,
			Wants: []agent.JournalWant{{Quota: "atlas", Tokens: 20}}, LeaderNowMs: 21_040,
			Grants: []agent.JournalGrant{{Quota: "atlas", GrantID: "g6", Tokens: 20, ExpiresMs: 22_500, Window: 7}}},
		{Kind: agent.LeaseEventDeposit, Quota: "atlas", GrantID: "g6", Tokens: 20, At: at(21*tsec + 200*tms),
			Outcome: agent.LeaseFailed, Err: "too late", ExpiresMs: 22_500, Deadline: at(21*tsec + 210*tms)},
		{Kind: agent.LeaseEventRelease, RequestID: "release-g6", Quota: "atlas", GrantID: "g6", Tokens: 20, Sent: at(21*tsec + 210*tms), At: at(21*tsec + 260*tms), Outcome: agent.LeaseOK, Returned: 20},
	}
}

// fallbackLines are journalLines with the fallback allowances interleaved
// where they were journaled (see journalLines).
func fallbackLines() []agent.LeaseEvent {
	const skew = 500 * tms
	at := func(ns int64) int64 { return ns + skew }
	var out []agent.LeaseEvent
	for _, ev := range journalLines() {
		switch ev.RequestID {
		case "r3": // after r2 (unanswered at 14 s), before r3's answer at 15.08 s
			out = append(out, agent.LeaseEvent{Kind: agent.LeaseEventFallback, Region: "eu", Quota: "cedar", GrantID: "fb-eu-4", Window: 4, Tokens: 15,
				Sent: at(14*tsec + 200*tms), At: at(14*tsec + 203*tms), Outcome: agent.LeaseOK, LeaderNowMs: 14_190, Deadline: at(14*tsec + 700*tms), TTLMs: 450})
		case "release-g1": // after r3's answer
			out = append(out, agent.LeaseEvent{Kind: agent.LeaseEventFallback, Region: "eu", Quota: "cedar", GrantID: "fb-eu-5", Window: 5, Tokens: 15,
				Sent: at(15*tsec + 500*tms), At: at(15*tsec + 900*tms), Outcome: agent.LeaseFailed, Err: "deposit timed out; withdrawn", LeaderNowMs: 15_490,
				Deadline: at(17*tsec + 700*tms)})
		}
		out = append(out, ev)
	}
	return append(out,
		agent.LeaseEvent{Kind: agent.LeaseEventFallback, Region: "eu", Quota: "cedar", GrantID: "fb-eu-7", Window: 7, Tokens: 15,
			Sent: at(22 * tsec), At: at(22*tsec + 500*tms), Outcome: agent.LeaseUnknown, Err: "i/o timeout", LeaderNowMs: 21_990, Deadline: at(23*tsec + 700*tms), TTLMs: 1200},
		agent.LeaseEvent{Kind: agent.LeaseEventStart, At: 29 * tsec, Region: "eu", Pid: 43},
		agent.LeaseEvent{Kind: agent.LeaseEventFallback, Region: "eu", Quota: "cedar", GrantID: "fb-eu-10", Window: 10, Tokens: 0,
			Sent: 30*tsec + 100*tms, At: 30*tsec + 102*tms, Outcome: agent.LeaseOK, LeaderNowMs: 30_090, Deadline: 30*tsec + 2700*tms, TTLMs: 2500},
	)
}

func TestJournalConv(t *testing.T) {
	sink := &eventSink{}
	conv := newJournalConv("eu", sink.record)
	var probed []string
	conv.probe = func(id string, _ []agent.JournalWant) { probed = append(probed, id) }
	for _, ev := range fallbackLines() {
		b, err := json.Marshal(ev)
		if err != nil {
			t.Fatal(err)
		}
		conv.line(b)
	}
	conv.line([]byte("{not json"))
	conv.finish()
	if err := conv.err(); err == nil {
		t.Error("a malformed line was not reported")
	}
	byKey := map[string]history.Event{}
	for _, e := range conv.emitAll(sink) {
		byKey[string(e.Kind)+"/"+e.RequestID+"/"+e.Quota+"/"+e.GrantID] = e
	}
	tests := []struct {
		key  string
		want history.Event
	}{
		{"acquire/r1/atlas/g1", history.Event{Kind: history.KindAcquire, Region: "eu", Quota: "atlas", RequestID: "r1", Outcome: history.OK, Asked: 100,
			Call: 10 * tsec, At: 10*tsec + 150*tms, GrantID: "g1", Tokens: 100, Window: 3, ExpiresMs: 11_600, LeaderNowMs: 10_100, Replayed: true,
			Deadline: 10*tsec + 152*tms + 1000*tms}},
		{"acquire/r1/birch/", history.Event{Kind: history.KindAcquire, Region: "eu", Quota: "birch", RequestID: "r1", Outcome: history.OK, Asked: 50,
			Call: 10 * tsec, At: 10*tsec + 150*tms, Window: 3, LeaderNowMs: 10_100, Replayed: true, Exhausted: true}},
		{"acquire/r2/atlas/", history.Event{Kind: history.KindAcquire, Region: "eu", Quota: "atlas", RequestID: "r2", Outcome: history.Unknown, Asked: 10,
			Call: 13 * tsec, At: 14 * tsec, Err: "unavailable"}},
		{"acquire/r3/atlas/g3", history.Event{Kind: history.KindAcquire, Region: "eu", Quota: "atlas", RequestID: "r3", Outcome: history.OK, Asked: 10,
			Call: 15 * tsec, At: 15*tsec + 80*tms, GrantID: "g3", Tokens: 10, Window: 5, ExpiresMs: 15_050, LeaderNowMs: 15_040}},
		{"release//atlas/g3", history.Event{Kind: history.KindRelease, Region: "eu", Quota: "atlas", GrantID: "g3", Tokens: 10, Returned: 10, Window: 5,
			Call: 15*tsec + 81*tms, At: 15*tsec + 90*tms, Outcome: history.OK}},
		{"release//atlas/g1", history.Event{Kind: history.KindRelease, Region: "eu", Quota: "atlas", GrantID: "g1", Tokens: 30, Window: 3,
			Call: 16 * tsec, At: 16*tsec + 50*tms, Outcome: history.Failed, Err: "window gone", Reason: "not_found"}},
		{"deposit//atlas/g1", history.Event{Kind: history.KindDeposit, Region: "eu", Quota: "atlas", GrantID: "g1", Tokens: 100, Window: 3, ExpiresMs: 11_600,
			Call: 10*tsec + 151*tms, At: 10*tsec + 152*tms, Outcome: history.OK, Deadline: 10*tsec + 152*tms + 1000*tms}},
		// A failed deposit that sent an attempt: nothing of the grant is
		// spendable in the store after its At, the grant's deadline.
		{"acquire/r4/atlas/g4", history.Event{Kind: history.KindAcquire, Region: "eu", Quota: "atlas", RequestID: "r4", Outcome: history.OK, Asked: 40,
			Call: 17 * tsec, At: 17*tsec + 80*tms, GrantID: "g4", Tokens: 40, Window: 5, ExpiresMs: 18_500, LeaderNowMs: 17_040, Deadline: 17*tsec + 700*tms}},
		{"deposit//atlas/g4", history.Event{Kind: history.KindDeposit, Region: "eu", Quota: "atlas", GrantID: "g4", Tokens: 40, Window: 5, ExpiresMs: 18_500,
			Call: 17*tsec + 100*tms, At: 17*tsec + 700*tms, Outcome: history.Failed, Err: "deposit timed out; withdrawn", Deadline: 17*tsec + 700*tms}},
		{"release//atlas/g4", history.Event{Kind: history.KindRelease, Region: "eu", Quota: "atlas", GrantID: "g4", Tokens: 40, Returned: 40, Window: 5,
			Call: 17*tsec + 710*tms, At: 17*tsec + 760*tms, Outcome: history.OK}},
		// An unknown deposit bounds nothing: the grant has no deadline and
		// the deposit says unknown (check.CheckDepositUnknown).
		{"acquire/r5/atlas/g5", history.Event{Kind: history.KindAcquire, Region: "eu", Quota: "atlas", RequestID: "r5", Outcome: history.OK, Asked: 50,
			Call: 19 * tsec, At: 19*tsec + 80*tms, GrantID: "g5", Tokens: 50, Window: 6, ExpiresMs: 20_500, LeaderNowMs: 19_040}},
		{"deposit//atlas/g5", history.Event{Kind: history.KindDeposit, Region: "eu", Quota: "atlas", GrantID: "g5", Tokens: 50, Window: 6, ExpiresMs: 20_500,
			Call: 19*tsec + 100*tms, At: 19*tsec + 600*tms, Outcome: history.Unknown, Err: "i/o timeout"}},
		// A failed deposit that sent nothing: never deposited.
		{"acquire/r6/atlas/g6", history.Event{Kind: history.KindAcquire, Region: "eu", Quota: "atlas", RequestID: "r6", Outcome: history.OK, Asked: 20,
			Call: 21 * tsec, At: 21*tsec + 80*tms, GrantID: "g6", Tokens: 20, Window: 7, ExpiresMs: 22_500, LeaderNowMs: 21_040}},
		{"deposit//atlas/g6", history.Event{Kind: history.KindDeposit, Region: "eu", Quota: "atlas", GrantID: "g6", Tokens: 20, Window: 7, ExpiresMs: 22_500,
			At: 21*tsec + 200*tms, Outcome: history.Failed, Err: "too late"}},
		{"release//atlas/g6", history.Event{Kind: history.KindRelease, Region: "eu", Quota: "atlas", GrantID: "g6", Tokens: 20, Returned: 20, Window: 7,
			Call: 21*tsec + 210*tms, At: 21*tsec + 260*tms, Outcome: history.OK}},
		// Fallback allowances: times on the true clock, Deadline the store
		// expiry bound as for a deposit (made: return + TTL; failed: the
		// return; unknown: none), and the last Acquire attempt the process
		// ended before the send, answered or not (r2's unanswered attempt
		// for the first: cut off; r3's and r6's answers for the next two).
		{"fallback//cedar/fb-eu-4", history.Event{Kind: history.KindFallback, Region: "eu", Quota: "cedar", GrantID: "fb-eu-4", Tokens: 15, Window: 4,
			Call: 14*tsec + 200*tms, At: 14*tsec + 203*tms, Outcome: history.OK, LeaderNowMs: 14_190, Deadline: 14*tsec + 203*tms + 450*tms,
			LastAcquire: &history.Attempt{RequestID: "r2", At: 14 * tsec, Outcome: history.Unknown}}},
		{"fallback//cedar/fb-eu-5", history.Event{Kind: history.KindFallback, Region: "eu", Quota: "cedar", GrantID: "fb-eu-5", Tokens: 15, Window: 5,
			Call: 15*tsec + 500*tms, At: 15*tsec + 900*tms, Outcome: history.Failed, Err: "deposit timed out; withdrawn", LeaderNowMs: 15_490, Deadline: 15*tsec + 900*tms,
			LastAcquire: &history.Attempt{RequestID: "r3", At: 15*tsec + 80*tms, Outcome: history.OK}}},
		{"fallback//cedar/fb-eu-7", history.Event{Kind: history.KindFallback, Region: "eu", Quota: "cedar", GrantID: "fb-eu-7", Tokens: 15, Window: 7,
			Call: 22 * tsec, At: 22*tsec + 500*tms, Outcome: history.Unknown, Err: "i/o timeout", LeaderNowMs: 21_990,
			LastAcquire: &history.Attempt{RequestID: "r6", At: 21*tsec + 80*tms, Outcome: history.OK}}},
		// The second process: its clock the machine's, no attempt yet.
		{"fallback//cedar/fb-eu-10", history.Event{Kind: history.KindFallback, Region: "eu", Quota: "cedar", GrantID: "fb-eu-10", Window: 10,
			Call: 30*tsec + 100*tms, At: 30*tsec + 102*tms, Outcome: history.OK, LeaderNowMs: 30_090, Deadline: 30*tsec + 102*tms + 2500*tms}},
	}
	for _, tt := range tests {
		got, ok := byKey[tt.key]
		if !ok {
			t.Errorf("%s: not emitted (got %v)", tt.key, byKey)
			continue
		}
		if got.String() != tt.want.String() {
			t.Errorf("%s:\n got %s\nwant %s", tt.key, got, tt.want)
		}
	}
	if len(byKey) != len(tests) {
		t.Errorf("%d distinct events, want %d: %v", len(byKey), len(tests), byKey)
	}
	// The checks on the converted allowances: fb-eu-5, fb-eu-7 and
	// fb-eu-10 were deposited while the agent was not cut off, fb-eu-7's
	// outcome is unknown; each lives inside its window of 3 s, none
	// overlaps.
	var fbs []history.Event
	for _, e := range sink.all() {
		if e.Kind == history.KindFallback {
			fbs = append(fbs, e)
		}
	}
	cedar := check.Quota{Name: "cedar", Limit: 200, WindowMs: 3000, Bound: 90, FallbackPerRegion: 15}
	res := check.Run(history.History{Events: fbs}, check.Params{Quotas: []check.Quota{cedar}})
	var got []string
	for _, v := range res.Violations {
		got = append(got, fmt.Sprintf("%s %d", v.Check, v.Window))
	}
	slices.Sort(got)
	if want := []string{check.CheckDepositUnknown + " 7", check.CheckFallbackNotCutOff + " 10", check.CheckFallbackNotCutOff + " 5", check.CheckFallbackNotCutOff + " 7"}; !slices.Equal(got, want) || res.Fallbacks != 4 {
		t.Errorf("checks of the converted allowances: %q (%d allowances), want %q (4): %v", got, res.Fallbacks, want, res.Violations)
	}
	if want := []string{"r1", "r3", "r4", "r5", "r6"}; !slices.Equal(probed, want) {
		t.Errorf("probes offered for %v, want the answered %v", probed, want)
	}
	// Every granted chunk is emitted once.
	grants := map[string]int{}
	for _, e := range sink.all() {
		if e.Kind == history.KindAcquire && e.GrantID != "" {
			grants[e.GrantID]++
		}
	}
	for id, n := range grants {
		if n != 1 {
			t.Errorf("grant %s emitted %d times", id, n)
		}
	}
}

// emitAll returns what the converter emitted so far.
func (j *journalConv) emitAll(s *eventSink) []history.Event { return s.all() }

func TestJournalTail(t *testing.T) {
	path := filepath.Join(t.TempDir(), "journal.jsonl")
	sink := &eventSink{}
	tail := startJournalTail(path, newJournalConv("eu", sink.record))
	time.Sleep(2 * journalPoll) // no file yet: nothing happens
	f, err := os.OpenFile(path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var all []byte
	for _, ev := range journalLines() {
		b, err := json.Marshal(ev)
		if err != nil {
			t.Fatal(err)
		}
		all = append(append(all, b...), '\n')
	}
	// Half a line first: the tail must wait for its end.
	if _, err := f.Write(all[:len(all)/2]); err != nil {
		t.Fatal(err)
	}
	time.Sleep(3 * journalPoll)
	if _, err := f.Write(all[len(all)/2:]); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := tail.close(ctx); err != nil {
		t.Fatal(err)
	}
	kinds := map[history.Kind]int{}
	for _, e := range sink.all() {
		kinds[e.Kind]++
	}
	if kinds[history.KindAcquire] != 7 || kinds[history.KindRelease] != 4 || kinds[history.KindDeposit] != 4 {
		t.Fatalf("events by kind %v, want 7 acquires, 4 releases and 4 deposits", kinds)
	}
}
