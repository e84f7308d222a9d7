package driver

import (
	"sync"
	"testing"
	"time"

	"github.com/allot-dev/allot/chaos/history"
	"github.com/allot-dev/allot/pkg/lease"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

type fakeClock struct{ ns int64 }

func (c *fakeClock) Now() int64 { return c.ns }

type sink struct {
	mu  sync.Mutex
	evs []history.Event
}

func (s *sink) emit(e history.Event) {
	s.mu.Lock()
	s.evs = append(s.evs, e)
	s.mu.Unlock()
}

func (s *sink) sum(kind history.Kind) int64 {
	var n int64
	for _, e := range s.evs {
		if e.Kind == kind {
			n += e.Tokens
		}
	}
	return n
}

const (
	ms  = int64(time.Millisecond)
	sec = int64(time.Second)
)

// newTest returns a driver at true time 100 s (window 33 of 3 s windows
// starts at 99 s) with one quota, and its state.
func newTest(t *testing.T, qc QuotaConfig) (*Driver, *state, *fakeClock, *sink) {
	t.Helper()
	clk := &fakeClock{ns: 100 * sec}
	out := &sink{}
	if qc.Name == "" {
		qc.Name = "q"
	}
	if qc.WindowMs == 0 {
		qc.WindowMs = 3000
	}
	if qc.Sizing == (lease.Sizing{}) {
		qc.Sizing = lease.Sizing{MinChunk: 1, MaxChunk: 100, Lead: 300 * time.Millisecond, RTT: 100 * time.Millisecond}
	}
	d, err := New(Config{Region: "eu", Quotas: []QuotaConfig{qc}, Margin: 250 * time.Millisecond}, clk, nil, out.emit)
	if err != nil {
		t.Fatal(err)
	}
	s := &state{quotas: map[string]*quotaState{qc.Name: {cfg: qc, rate: qc.Rate}}, names: []string{qc.Name}, lastTick: clk.ns}
	return d, s, clk, out
}

func TestDeadlineIsTheSendTimeRuleWhateverTheSkew(t *testing.T) {
	sent := 100 * sec
	// The leader stamped 100.080 s (its clock), expiry 101.080 s: 1 s left.
	want := lease.Deadline(time.Unix(0, sent), 101_080, 100_080, 250*time.Millisecond).UnixNano()
	for _, skew := range []time.Duration{-500 * time.Millisecond, 0, 500 * time.Millisecond} {
		d, s, _, _ := newTest(t, QuotaConfig{Rate: 10})
		d.SetSkew(skew)
		if got := d.deadline(s.quotas["q"], sent, 101_080, 100_080); got != want {
			t.Errorf("skew %s: deadline %d, want %d (send + remaining TTL - margin)", skew, got, want)
		}
		s.quotas["q"].cfg.WallDeadline = true
		wall := d.deadline(s.quotas["q"], sent, 101_080, 100_080)
		if wantWall := 101_080*ms - 250*ms - int64(skew); wall != wantWall {
			t.Errorf("skew %s: wall-clock deadline %d, want %d", skew, wall, wantWall)
		}
	}
}

func TestSpendNeverPastTheDeadline(t *testing.T) {
	d, s, clk, out := newTest(t, QuotaConfig{Rate: 10})
	q := s.quotas["q"]
	q.chunks = []*chunk{
		{grantID: "late", left: 5, deadline: clk.ns + 500*ms},
		{grantID: "early", left: 5, deadline: clk.ns + 100*ms},
	}
	d.spend(q, clk.ns, 3) // earliest deadline first
	if q.chunks[0].grantID != "early" || q.chunks[0].left != 2 {
		t.Fatalf("chunks after spending 3: %+v, want 3 taken from the earliest deadline", q.chunks[0])
	}
	clk.ns += 100 * ms // "early" dies now
	d.expire(q, clk.ns)
	d.spend(q, clk.ns, 7)
	if got := out.sum(history.KindStrand); got != 2 {
		t.Errorf("stranded %d, want the 2 left in the dead chunk", got)
	}
	if got, want := out.sum(history.KindAdmit), int64(3+5); got != want {
		t.Errorf("admitted %d, want %d", got, want)
	}
	if got := out.sum(history.KindDeny); got != 2 {
		t.Errorf("denied %d, want 2", got)
	}
	for _, e := range out.evs {
		if e.Kind == history.KindAdmit && e.At >= e.Deadline {
			t.Errorf("admission at %d past its chunk's deadline %d", e.At, e.Deadline)
		}
	}
}

func TestRenewal(t *testing.T) {
	// Window 33 is [99 s, 102 s). Rate 100/s, lead 300 ms: renew when the
	// tokens still spendable 300 ms from now are 30 or fewer.
	tests := []struct {
		name    string
		chunks  []*chunk
		clampAt int64 // deadline of a clamped grant of window 33 (0: none)
		now     int64
		skew    time.Duration
		want    bool
	}{
		{name: "plenty held", chunks: []*chunk{{left: 80, deadline: 101 * sec}}, now: 100 * sec},
		{name: "running low", chunks: []*chunk{{left: 20, deadline: 101 * sec}}, now: 100 * sec, want: true},
		{name: "tokens that die within the lead do not count", chunks: []*chunk{{left: 80, deadline: 100*sec + 200*ms}}, now: 100 * sec, want: true},
		{name: "unclamped grant past the window end renews as usual", chunks: []*chunk{{left: 80, deadline: 102*sec + 400*ms, expiresMs: 102_700}}, now: 102*sec + 200*ms, want: true},
		{name: "clamped: enough until the clamped deadline", chunks: []*chunk{{left: 20, deadline: 101*sec + 700*ms}}, clampAt: 101*sec + 700*ms, now: 101*sec + 550*ms},
		{name: "clamped: too little until the clamped deadline", chunks: []*chunk{{left: 5, deadline: 101*sec + 700*ms}}, clampAt: 101*sec + 700*ms, now: 101*sec + 550*ms, want: true},
		{name: "clamped deadline passed: wait for the next window", clampAt: 101*sec + 700*ms, now: 101*sec + 800*ms},
		{name: "next window by the region's clock", clampAt: 101*sec + 700*ms, now: 102*sec + 10*ms, want: true},
		{name: "a clock 500 ms behind waits longer", clampAt: 101*sec + 700*ms, now: 102*sec + 10*ms, skew: -500 * time.Millisecond},
		{name: "a clock 500 ms ahead asks early", clampAt: 101*sec + 700*ms, now: 101*sec + 600*ms + 1, skew: 500 * time.Millisecond, want: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d, s, _, _ := newTest(t, QuotaConfig{Rate: 100, Clamp: true})
			d.SetSkew(tt.skew)
			q := s.quotas["q"]
			q.chunks = tt.chunks
			if tt.clampAt != 0 {
				q.clampEndMs, q.clampDeadline = 102_000, tt.clampAt
			}
			_, got := d.needsRenewal(q, tt.now)
			if got != tt.want {
				t.Fatalf("needsRenewal = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestIndependentRegionIgnoresTheAllocator(t *testing.T) {
	d, s, clk, out := newTest(t, QuotaConfig{Rate: 1000, Independent: 50})
	q := s.quotas["q"]
	d.spendLocal(q, clk.ns, 40)
	d.spendLocal(q, clk.ns+sec, 40) // same window: 10 more, 30 denied
	d.spendLocal(q, 102*sec, 40)    // next window: a fresh local limit
	if got := out.sum(history.KindAdmit); got != 90 {
		t.Errorf("admitted %d, want 50 + 40", got)
	}
	for _, e := range out.evs {
		if e.Kind == history.KindAdmit && e.GrantID != "" {
			t.Errorf("an independent admission names grant %q", e.GrantID)
		}
	}
}

func TestApplyRecordsGrantsAndClamping(t *testing.T) {
	for _, clamp := range []bool{false, true} {
		d, s, clk, out := newTest(t, QuotaConfig{Rate: 100, Clamp: clamp})
		// Granted at 101.000 s by the leader with TTL 1 s: expiry 102.000 s,
		// which is also the window's end, by coincidence when clamp is off.
		resp := &allotv1.AcquireResponse{LeaderNowUnixMs: 101_000, Grants: []*allotv1.Grant{{
			Quota: "q", GrantId: "7-0", Tokens: 40, WindowIndex: 33, WindowEndUnixMs: 102_000, ExpiresUnixMs: 102_000, TtlMs: 1000,
		}}}
		req := request{id: "eu-1", wants: []want{{quota: "q", asked: 40}}, normal: true, call: clk.ns}
		d.apply(s, result{req: req, resp: resp, outcome: history.OK, at: clk.ns + 100*ms})
		q := s.quotas["q"]
		if len(q.chunks) != 1 || q.chunks[0].left != 40 {
			t.Fatalf("clamp %v: chunks %+v, want one of 40", clamp, q.chunks)
		}
		if got := q.clampDeadline != 0; got != clamp {
			t.Errorf("clamp %v: treated as clamped = %v", clamp, got)
		}
		if len(out.evs) != 1 || out.evs[0].Kind != history.KindAcquire || out.evs[0].Call != clk.ns || out.evs[0].Deadline != q.chunks[0].deadline {
			t.Errorf("clamp %v: events %v, want one acquire stamped with the first send and the chunk's deadline", clamp, out.evs)
		}
	}
}
