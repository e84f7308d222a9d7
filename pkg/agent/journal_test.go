package agent_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/allot-dev/allot/pkg/agent"
)

// syncBuffer is a bytes.Buffer safe for the lease manager's goroutines.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) events(t *testing.T) []agent.LeaseEvent {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []agent.LeaseEvent
	sc := bufio.NewScanner(bytes.NewReader(s.b.Bytes()))
	for sc.Scan() {
		var ev agent.LeaseEvent
		if err := json.Unmarshal(sc.Bytes(), &ev); err != nil {
			t.Fatalf("journal line %q: %v", sc.Text(), err)
		}
		out = append(out, ev)
	}
	return out
}

// TestLeaseJournal: with WithLeaseObserver, the agent journals each Acquire
// with its grants, each deposit with a store expiry bound (At + TTL) inside
// the lease, and at shutdown the Release of what it withdrew; times are the
// agent's clock, which -clock-offset (OffsetClock) moves without moving the
// deadlines.
func TestLeaseJournal(t *testing.T) {
	rdb, _, doc, cfg := threeQuotasAgent(t)
	cfg.StarveWait = 0
	var buf syncBuffer
	j := agent.NewLeaseJournal(&buf)
	const skew = 2 * time.Second
	a := newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1), agent.WithLeaseObserver(j.Record), agent.WithClock(agent.OffsetClock{Offset: skew}))
	mustCheck(t, a, tenant("a")) // starves: the next round asks
	// The machine's clock around the renewal (the acquire and its deposit)
	// and around the shutdown (the release).
	renewStart := time.Now()
	a.Renew(context.Background())
	renewEnd := time.Now()
	if v := mustCheck(t, a, tenant("a")); !v.Allowed {
		t.Fatalf("after the renewal: %+v, want allowed", v)
	}
	r := runAgent(t, a)
	stopStart := time.Now()
	if err := r.stop(); err != nil { // shutdown: withdraw and release the rest
		t.Fatal(err)
	}
	stopEnd := time.Now()
	if err := j.Close(); err != nil {
		t.Fatal(err)
	}
	evs := buf.events(t)
	// onAgentClock fails unless stamp (Unix ns) was taken on the agent's
	// clock between from and to by the machine's: skew ahead of them, give or
	// take a slack well under the skew, so a machine-clock stamp fails.
	const slack = skew / 4
	onAgentClock := func(what string, stamp int64, from, to time.Time) {
		t.Helper()
		lo, hi := from.Add(skew-slack).UnixNano(), to.Add(skew+slack).UnixNano()
		if stamp < lo || stamp > hi {
			t.Errorf("%s %d: not on the agent's clock, want within [%d, %d] (the machine's clock %s ahead, ±%s)",
				what, stamp, lo, hi, skew, slack)
		}
	}
	var acq, dep, rel *agent.LeaseEvent
	for i := range evs {
		e := &evs[i]
		onAgentClock(e.Kind+" at", e.At, renewStart, stopEnd)
		switch e.Kind {
		case agent.LeaseEventAcquire:
			acq = e
		case agent.LeaseEventDeposit:
			dep = e
		case agent.LeaseEventRelease:
			rel = e
		}
	}
	if acq == nil || dep == nil || rel == nil {
		t.Fatalf("journal %+v: want an acquire, a deposit and a release", evs)
	}
	if acq.Outcome != agent.LeaseOK || len(acq.Wants) != 1 || len(acq.Grants) != 1 || acq.Grants[0].Tokens != 10 || acq.FirstSent == 0 {
		t.Fatalf("acquire %+v: want one answered want of q-a granted 10", acq)
	}
	// The renewal acquired and deposited; the shutdown released.
	onAgentClock("acquire at", acq.At, renewStart, renewEnd)
	onAgentClock("acquire sent", acq.Sent, renewStart, renewEnd)
	onAgentClock("acquire first sent", acq.FirstSent, renewStart, renewEnd)
	g := acq.Grants[0]
	if dep.Outcome != agent.LeaseOK || dep.GrantID != g.GrantID || dep.Tokens != 10 || dep.ExpiresMs != g.ExpiresMs {
		t.Fatalf("deposit %+v: want grant %s deposited", dep, g.GrantID)
	}
	onAgentClock("deposit at", dep.At, renewStart, renewEnd)
	onAgentClock("deposit sent", dep.Sent, renewStart, renewEnd)
	onAgentClock("release at", rel.At, stopStart, stopEnd)
	onAgentClock("release sent", rel.Sent, stopStart, stopEnd)
	// On the machine's clock the store expires the chunk at most at
	// At - skew + TTL: within the allocator's expiry (minus the margin).
	if bound := dep.At - int64(skew) + dep.TTLMs*int64(time.Millisecond); bound > g.ExpiresMs*int64(time.Millisecond)-int64(cfg.Lease.Margin) {
		t.Errorf("store expiry bound %d after the allocator's expiry %d ms minus the margin", bound, g.ExpiresMs)
	}
	if dep.Deadline-int64(skew) > g.ExpiresMs*int64(time.Millisecond)-int64(cfg.Lease.Margin) {
		t.Errorf("deadline %d (agent clock) moved with the skew past expiry %d ms - margin", dep.Deadline, g.ExpiresMs)
	}
	// The deadline is the send-time rule on the agent's clock: the lease's
	// remaining time by the leader (less 1 ms for its truncated stamp) from
	// the first send, minus the margin.
	remaining := time.Duration(g.ExpiresMs-acq.LeaderNowMs)*time.Millisecond - time.Millisecond
	if want := acq.FirstSent + int64(remaining) - int64(cfg.Lease.Margin); dep.Deadline != want {
		t.Errorf("deadline %d, want %d: first sent %d + %s (expiry %d - leader now %d, less 1 ms) - margin %s",
			dep.Deadline, want, acq.FirstSent, remaining, g.ExpiresMs, acq.LeaderNowMs, cfg.Lease.Margin)
	}
	if rel.GrantID != g.GrantID || rel.Tokens != 9 || rel.Returned != 9 || rel.Outcome != agent.LeaseOK || rel.RequestID != "release-"+g.GrantID {
		t.Fatalf("release %+v: want the 9 unspent tokens of %s handed back", rel, g.GrantID)
	}
}

// failingWriter fails every write after ok of them.
type failingWriter struct{ ok int }

func (w *failingWriter) Write(p []byte) (int, error) {
	if w.ok == 0 {
		return 0, errors.New("no space left on device")
	}
	w.ok--
	return len(p), nil
}

// TestLeaseJournalLogsItsFirstError: with SetLogger, the write error that
// stops the journal is logged as a warning when it happens, once; Err and
// Close still return it.
func TestLeaseJournalLogsItsFirstError(t *testing.T) {
	core, logs := observer.New(zapcore.InfoLevel)
	j := agent.NewLeaseJournal(&failingWriter{ok: 1})
	j.SetLogger(zap.New(core))
	j.Record(agent.LeaseEvent{Kind: agent.LeaseEventStart})
	if n := logs.Len(); n != 0 {
		t.Fatalf("%d messages after a write that succeeded: %v", n, logs.All())
	}
	j.Record(agent.LeaseEvent{Kind: agent.LeaseEventAcquire})
	j.Record(agent.LeaseEvent{Kind: agent.LeaseEventDeposit})
	warned := logs.FilterLevelExact(zapcore.WarnLevel).FilterMessageSnippet("lease journal stopped")
	if warned.Len() != 1 || logs.Len() != 1 {
		t.Fatalf("logged %v, want one warning that the journal stopped", logs.All())
	}
	if err := j.Close(); err == nil || !strings.Contains(err.Error(), "no space") {
		t.Fatalf("Close: %v, want the write error", err)
	}
}
