package agent

import (
	"math"
	"time"

	"go.uber.org/zap"

	"github.com/allot-dev/allot/pkg/lease"
)

// Why a fallback allowance due is withheld (allot_agent_fallback_withheld_total).
const (
	// withheldUnmeasured: this process never measured the leader's clock
	// (no fresh Acquire answer since it started), so it cannot tell which
	// window the allocator is in: its wall clock has no bound against the
	// leader's.
	withheldUnmeasured = "unmeasured"
	// withheldWindowStart: within the estimate's error of a window's start,
	// the leader's clock may still be in the previous window.
	withheldWindowStart = "window_start"
)

// leaderClock is the leader's clock as a fresh Acquire answer measured it:
// its reading at the local monotonic instant at, within err.
type leaderClock struct {
	ns  int64     // the leader's Unix time at at, in nanoseconds
	at  time.Time // local, with its monotonic reading: when the answer arrived
	err time.Duration
}

// observeLeader measures the leader's clock from the stamp (whole
// milliseconds) of a fresh answer to an Acquire sent at sent and received at
// recv, local readings. The leader stamped it between the two, so at recv
// its clock read between the stamp and the stamp plus the round trip and a
// millisecond: the estimate is the middle, the error half of that (and the
// drift over the round trip). It also sets the measured offset of the
// leader's wall clock from ours, for the gauge. The caller holds l.mu.
func (l *leases) observeLeader(stampMs int64, sent, recv time.Time) {
	rtt := max(recv.Sub(sent), 0)
	half := (rtt + time.Millisecond) / 2
	l.leader = leaderClock{ns: stampMs*int64(time.Millisecond) + int64(half), at: recv, err: half + l.driftOver(rtt)}
	lc := l.leader
	l.leaderSnap.Store(&lc)
	l.offsetMs = stampMs - (sent.UnixMilli() + rtt.Milliseconds()/2)
	l.m.clockOffset.Set(float64(l.offsetMs) / 1e3)
}

// leaderNow estimates the leader's clock at now, in Unix nanoseconds, and
// bounds the estimate's error: the measurement's, plus MaxDriftPPM of the
// time since. Since the measurement it reads only the monotonic clock, never
// the wall clock, which a restart, a step or a drift moves without bound
// against the leader's. ok is false while no fresh answer has measured it.
// Standalone (no allocator), the region's windows are the agent's own clock.
// The caller holds l.mu.
func (l *leases) leaderNow(now time.Time) (ns int64, err time.Duration, ok bool) {
	if l.client == nil {
		return now.UnixNano(), 0, true
	}
	if l.leader.at.IsZero() {
		return 0, 0, false
	}
	since := max(now.Sub(l.leader.at), 0)
	return l.leader.ns + int64(since), l.leader.err + l.driftOver(since), true
}

// leaderWall is an admission.Clock reading the leader's clock as last
// measured and carried on by the monotonic clock (leaderNow's estimate,
// without its error), or the agent's clock before the first measurement and
// standalone. It takes no lock: the engine reads it for every decision its
// in-process fallback makes while Redis fails. The estimate's error (half a
// round trip, plus MaxDriftPPM of the time since the last answer) is far
// under the pool fallback margin unless the agent has been cut off from the
// allocator for many minutes as well.
type leaderWall struct{ l *leases }

// Now returns the estimate of the leader's clock now.
func (w leaderWall) Now() time.Time {
	now := w.l.clock.Now()
	lc := w.l.leaderSnap.Load()
	if lc == nil || w.l.client == nil {
		return now
	}
	return time.Unix(0, lc.ns+int64(max(now.Sub(lc.at), 0)))
}

// leaderMs is leaderNow in Unix milliseconds, for scheduling only: before
// the first measurement, the agent's wall clock. The caller holds l.mu.
func (l *leases) leaderMs(now time.Time) int64 {
	if ns, _, ok := l.leaderNow(now); ok {
		return ns / int64(time.Millisecond)
	}
	return now.UnixMilli()
}

// driftOver is how far the leader's clock and ours may part over d, at
// MaxDriftPPM, rounded up.
func (l *leases) driftOver(d time.Duration) time.Duration {
	if d <= 0 || l.cfg.MaxDriftPPM <= 0 {
		return 0
	}
	return time.Duration(math.Ceil(float64(d) * float64(l.cfg.MaxDriftPPM) / 1e6))
}

// fallbackWindow places now in q's windows by the leader's clock, for a
// fallback allowance: idx is the window that surely holds the leader's
// clock now (its start is at least the estimate's error behind the
// estimate), and deadline (monotonic) when that window's allowance must be
// gone: the margin and the estimate's error before the window ends, the
// error as it will have grown by then. So the leader's clock is inside the
// window for as long as the allowance lives, whatever the agent's wall
// clock says. withheld says why no window is sure ("" when one is).
// The caller holds l.mu.
func (l *leases) fallbackWindow(q *quota, now time.Time) (idx int64, deadline time.Time, withheld string) {
	est, e, ok := l.leaderNow(now)
	if !ok {
		return 0, time.Time{}, withheldUnmeasured
	}
	w := q.spec.Window.Milliseconds()
	idx = lease.WindowIndex((est-int64(e))/int64(time.Millisecond), w)
	if idx != lease.WindowIndex(est/int64(time.Millisecond), w) {
		return 0, time.Time{}, withheldWindowStart
	}
	left := time.Duration(lease.WindowEnd(idx, w)*int64(time.Millisecond)-est) - l.margin() - e
	return idx, now.Add(left - l.driftOver(left)), ""
}

// withhold records that q's fallback allowance is due but withheld, and
// why; starving is whether requests starve for it. The caller holds l.mu.
func (l *leases) withhold(q *quota, why string, starving bool, now time.Time) {
	l.m.fallbackHeld.WithLabelValues(why).Inc()
	switch why {
	case withheldUnmeasured:
		if !l.warnedUnmeasured {
			l.warnedUnmeasured = true
			l.log.Warn("allocator unreachable since this agent started: fallback allowances withheld until an answer measures the leader's clock",
				zap.String("quota", q.name))
		}
	case withheldWindowStart:
		// Look again when the window is sure, its requests still starving.
		est, e, _ := l.leaderNow(now)
		w := q.spec.Window.Milliseconds()
		start := lease.WindowStart(lease.WindowIndex(est/int64(time.Millisecond), w), w) * int64(time.Millisecond)
		at := now.Add(time.Duration(start-est) + e + l.driftOver(e) + time.Millisecond)
		q.nextPoll = minTime(q.nextPoll, at)
		q.starving = q.starving || starving
	}
}

// minTime is the earlier of a and b.
func minTime(a, b time.Time) time.Time {
	if b.Before(a) {
		return b
	}
	return a
}

// margin is the expiry margin of every deadline the agent computes: its own
// (LeaseConfig.Margin), or the allocator's when that is larger (the one
// the stated bound assumes, in its answers' lease_margin_ms). The caller
// holds l.mu.
func (l *leases) margin() time.Duration { return max(l.cfg.Margin, l.allocMargin) }

// observeMargin records the margin an allocator's answer states, warning
// when it is larger than the agent's own (once per value). 0 is an
// allocator that does not state it: the last one stated, or the agent's
// own, stays in force. The caller holds l.mu.
func (l *leases) observeMargin(ms int64) {
	if ms <= 0 {
		return
	}
	m := time.Duration(ms) * time.Millisecond
	l.allocMargin = m
	if m > l.cfg.Margin && m != l.warnedMargin {
		l.warnedMargin = m
		l.log.Warn("the allocator's lease margin is larger than this agent's: lease deadlines use the allocator's (set -lease-margin to match it)",
			zap.Duration("allocator_margin", m), zap.Duration("agent_margin", l.cfg.Margin))
	}
}
