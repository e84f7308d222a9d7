package agent

import (
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/allocator"
)

// TestFallbackWindowBounds: the allowance is withheld until the leader's
// clock is measured, and within the estimate's error of a window's start;
// its deadline is the margin and the error (grown by the drift until then)
// before the window's end. The error is half the measuring call's round
// trip plus the stamp's millisecond, plus MaxDriftPPM of the time since.
func TestFallbackWindowBounds(t *testing.T) {
	client, err := allocator.NewClient([]string{"127.0.0.1:1"}) // never called
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(client.Close)
	st, err := admission.NewMemoryStore(admission.DefaultMemoryConfig(), nil)
	if err != nil {
		t.Fatal(err)
	}
	eng, doc := poolEngine(t, st, "fw")
	cfg := DefaultLeaseConfig()
	cfg.MaxDriftPPM = 1000 // 1 ms per second
	l := newLeases(cfg, "eu", client, admission.SystemClock{}, zap.NewNop(), newMetrics(), "test", newWithdrawer(nil, "fw"), time.Second)
	l.setPolicy(doc, eng)
	l.mu.Lock()
	defer l.mu.Unlock()
	q := l.quotas["q"]
	t0 := time.Now()
	if _, _, why := l.fallbackWindow(q, t0); why != withheldUnmeasured {
		t.Fatalf("before any answer: withheld %q, want %q", why, withheldUnmeasured)
	}
	// Measured 10 s into a window by a call of 8 ms: error 4.5 ms.
	hour := time.Hour.Milliseconds()
	s := (t0.UnixMilli()/hour + 1) * hour // a window's start, as Unix ms
	l.observeLeader(s+10_000, t0.Add(-8*time.Millisecond), t0)
	_, e, _ := l.leaderNow(t0)
	if want := 4500*time.Microsecond + 8*time.Microsecond; e != want {
		t.Fatalf("error at the measurement %s, want %s", e, want)
	}
	idx, deadline, why := l.fallbackWindow(q, t0)
	if why != "" || idx != s/hour {
		t.Fatalf("10 s into window %d: window %d, withheld %q", s/hour, idx, why)
	}
	// The estimate at t0 is s + 10 s + 4.5 ms: the window ends 3590 s -
	// 4.5 ms later; less the margin, the error and the drift until then.
	left := time.Hour - 10*time.Second - 4500*time.Microsecond - cfg.Margin - e
	want := t0.Add(left - left/1000)
	if d := deadline.Sub(want); d < -time.Millisecond || d > 0 {
		t.Fatalf("deadline %s after the measurement, want %s (at most 1 ms earlier)", deadline.Sub(t0), want.Sub(t0))
	}
	// Measured 2 s before the estimate reads the next window's start: the
	// error is then 4.508 ms plus 2 ms of drift. 5 ms into the window the
	// estimate is not sure of it; 7 ms into it, it is.
	at := t0.Add(time.Hour)
	l.leader.at = at.Add(-2 * time.Second)
	l.leader.ns = (s+hour)*int64(time.Millisecond) - int64(2*time.Second)
	if _, _, why := l.fallbackWindow(q, at.Add(5*time.Millisecond)); why != withheldWindowStart {
		t.Fatalf("5 ms into the next window, error 6.5 ms: withheld %q, want %q", why, withheldWindowStart)
	}
	if idx, _, why := l.fallbackWindow(q, at.Add(7*time.Millisecond)); why != "" || idx != s/hour+1 {
		t.Fatalf("7 ms into the next window, error 6.5 ms: window %d, withheld %q; want %d", idx, why, s/hour+1)
	}
}
