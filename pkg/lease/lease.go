package lease

import (
	"errors"
	"fmt"
	"math"
	"time"

	"github.com/allot-dev/allot/internal/satmath"
)

// WindowIndex returns the index of the window of windowMs milliseconds that
// holds the instant nowMs (Unix milliseconds): floor(nowMs / windowMs).
// Instants before the epoch fall in negative windows. windowMs must be
// positive; WindowIndex returns 0 otherwise instead of dividing by zero.
func WindowIndex(nowMs, windowMs int64) int64 {
	if windowMs <= 0 {
		return 0
	}
	q := nowMs / windowMs
	if nowMs%windowMs < 0 {
		q--
	}
	return q
}

// WindowStart returns the first instant (Unix milliseconds) of window idx.
func WindowStart(idx, windowMs int64) int64 {
	return idx * windowMs
}

// WindowEnd returns the end of window idx in Unix milliseconds: the first
// instant of the next window, so window idx is [WindowStart, WindowEnd).
func WindowEnd(idx, windowMs int64) int64 {
	return (idx + 1) * windowMs
}

// ClampExpiry returns the expiry of a lease granted at nowMs with a TTL of
// ttlMs: nowMs+ttlMs, or min(nowMs+ttlMs, windowEndMs) when clamp is set, so
// that tokens of one window cannot be spent in the next. The sum saturates
// instead of overflowing.
func ClampExpiry(nowMs, ttlMs, windowEndMs int64, clamp bool) int64 {
	exp := satAdd(nowMs, ttlMs)
	if clamp && windowEndMs < exp {
		return windowEndMs
	}
	return exp
}

// Deadline returns the instant, on the caller's monotonic clock, after which
// the region must stop spending a lease:
//
//	deadline = sentAt + (expiresUnixMs - leaderNowUnixMs) - margin
//
// sentAt is the caller's clock reading taken when the Acquire was SENT;
// expiresUnixMs and leaderNowUnixMs are the lease expiry and the time the
// leader stamped on the request, both read from the allocator's clock.
//
// The deadline is never later than the allocator's expiry, whatever the
// offset between the two machines' clocks. Only differences of readings of
// one clock are used: expires-leaderNow is an interval on the leader's clock
// and is added to a reading of the caller's clock, so neither clock's offset
// appears. By causality the leader stamped leaderNow after the request was
// sent, so in real time the region starts counting the remaining TTL no later
// than the allocator did and therefore stops no later than the allocator's
// expiry. The network and queueing delay between send and stamp only makes
// the region stop earlier (capacity stranded, never overspent). What is left
// is the rate at which the two clocks drift apart over one TTL and the margin
// that must cover it: margin >= drift rate x TTL keeps the deadline at or
// before the expiry.
//
// A negative margin counts as zero. A lease already expired when stamped
// yields a deadline before sentAt.
func Deadline(sentAt time.Time, expiresUnixMs, leaderNowUnixMs int64, margin time.Duration) time.Time {
	if margin < 0 {
		margin = 0
	}
	// leaderNow is the leader's clock truncated to the millisecond: the
	// stamp was taken up to 1 ms after it, so the remaining time may be up
	// to 1 ms shorter than expires-leaderNow. One millisecond comes off.
	remaining := msToDuration(satSub(expiresUnixMs, leaderNowUnixMs))
	if remaining > math.MinInt64+time.Millisecond { // saturated: do not wrap around
		remaining -= time.Millisecond
	}
	return sentAt.Add(remaining).Add(-margin)
}

// DefaultMaxDriftPPM is the relative clock drift rate, in parts per million,
// that the stated bound assumes by default (the allocator's -max-drift-ppm,
// bound.DefaultConfig): NotBefore allows for it over a pre-grant's lead.
const DefaultMaxDriftPPM = 200

// NotBefore returns the instant, on the caller's monotonic clock, before
// which the region must not spend a pre-grant (tokens of the window after
// the current one): NotBeforeDrift at DefaultMaxDriftPPM. A caller that
// knows the drift the bound assumes passes it to NotBeforeDrift.
func NotBefore(receivedAt time.Time, notBeforeUnixMs, leaderNowUnixMs int64) time.Time {
	return NotBeforeDrift(receivedAt, notBeforeUnixMs, leaderNowUnixMs, DefaultMaxDriftPPM)
}

// NotBeforeDrift returns the instant, on the caller's monotonic clock,
// before which the region must not spend a pre-grant (tokens of the window
// after the current one), given the largest relative drift rate of the two
// clocks, driftPPM:
//
//	lead      = notBeforeUnixMs - leaderNowUnixMs
//	notBefore = receivedAt + lead + ceil(lead x driftPPM / 1e6) + 1 ms
//
// receivedAt is the caller's clock reading taken when the Acquire's answer
// ARRIVED; notBeforeUnixMs (the window's start) and leaderNowUnixMs are
// read from the allocator's clock. It mirrors Deadline: only an interval of
// the leader's clock is added to a reading of the caller's, so no offset
// between the clocks appears, and by causality the answer arrived after the
// leader stamped leaderNow, so in real time the region starts spending no
// earlier than the leader's clock reaches the window's start, as long as
// the caller's clock does not measure the lead shorter than the leader's:
// the drift term covers a caller's clock running up to driftPPM faster
// over the lead (a pre-grant comes up to a minute ahead: 12 ms at 200 ppm),
// and the 1 ms the stamp's truncation and rounding. No margin is added:
// the lease margin already ends every chunk of the previous window that
// early (Deadline), which keeps the two windows' spending apart in real time
// even across a leader change, as long as the leaders' clocks differ by less
// than the margin. A negative driftPPM counts as zero.
func NotBeforeDrift(receivedAt time.Time, notBeforeUnixMs, leaderNowUnixMs, driftPPM int64) time.Time {
	d := msToDuration(satSub(notBeforeUnixMs, leaderNowUnixMs))
	if d > 0 && driftPPM > 0 {
		d = time.Duration(satAdd(int64(d), satmath.MulDivCeil(int64(d), driftPPM, 1_000_000)))
	}
	if d < math.MaxInt64-time.Millisecond {
		d += time.Millisecond
	}
	return receivedAt.Add(d)
}

// RedisTTL returns the relative TTL with which a chunk leased until deadline
// may be deposited in the regional store at now, given the measured delay
// storeDelay between the agent and the store: deadline-now-storeDelay,
// truncated down to whole milliseconds (the resolution of Redis PX) so the
// store's expiry is never later than the deadline. Zero means "do not
// deposit"; the result is never negative.
func RedisTTL(deadline, now time.Time, storeDelay time.Duration) time.Duration {
	if storeDelay < 0 {
		storeDelay = 0
	}
	// Compare before subtracting: Sub saturates at MinInt64 for a deadline
	// far in the past (the zero time), and subtracting from it would wrap
	// around to a TTL of centuries.
	left := deadline.Sub(now)
	if left <= storeDelay {
		return 0
	}
	return (left - storeDelay).Truncate(time.Millisecond)
}

// Sizing sizes the chunks a region asks for from its observed demand.
type Sizing struct {
	// MinChunk is the smallest chunk asked for, even when demand is zero.
	MinChunk int64
	// MaxChunk caps every chunk, so one region cannot park most of a pool.
	MaxChunk int64
	// Lead is how long before running out the agent renews a chunk.
	Lead time.Duration
	// RTT is the measured round trip of an Acquire to the allocator.
	RTT time.Duration
}

// ErrInvalidSizing reports a Sizing whose fields contradict each other.
var ErrInvalidSizing = errors.New("lease: invalid sizing")

// Validate reports which field of s is wrong, wrapping ErrInvalidSizing.
func (s Sizing) Validate() error {
	switch {
	case s.MinChunk < 1:
		return fmt.Errorf("min_chunk %d: must be >= 1: %w", s.MinChunk, ErrInvalidSizing)
	case s.MaxChunk < s.MinChunk:
		return fmt.Errorf("max_chunk %d: must be >= min_chunk %d: %w", s.MaxChunk, s.MinChunk, ErrInvalidSizing)
	case s.Lead < 0:
		return fmt.Errorf("lead %s: must not be negative: %w", s.Lead, ErrInvalidSizing)
	case s.RTT < 0:
		return fmt.Errorf("rtt %s: must not be negative: %w", s.RTT, ErrInvalidSizing)
	}
	return nil
}

// Chunk returns the number of tokens to ask for at a demand of ratePerSec
// tokens per second: enough to last until the next renewal arrives,
// ceil(rate x (Lead + RTT)), clamped to [MinChunk, MaxChunk]. A negative or
// NaN rate counts as zero; MaxChunk wins if it is below MinChunk. Lead + RTT
// saturates instead of overflowing.
func (s Sizing) Chunk(ratePerSec float64) int64 {
	n := ceilTokens(ratePerSec, time.Duration(satAdd(int64(s.Lead), int64(s.RTT))))
	if n < s.MinChunk {
		n = s.MinChunk
	}
	if n > s.MaxChunk {
		n = s.MaxChunk
	}
	return n
}

// PregrantChunk returns the number of tokens to ask for as a pre-grant of
// the next window at a demand of ratePerSec: a chunk (Chunk) plus the
// demand of gap, the stretch before the window's start in which the
// current window's tokens are already past their deadline (the lease
// margin): the requests that queue in it are served from the pre-grant the
// moment it opens, and the chunk must still last until the new window's
// first renewal lands. Clamped to MaxChunk like Chunk.
func (s Sizing) PregrantChunk(ratePerSec float64, gap time.Duration) int64 {
	return min(satAdd(s.Chunk(ratePerSec), ceilTokens(ratePerSec, gap)), s.MaxChunk)
}

// LowWatermark returns the level of held tokens under which a chunk must be
// renewed at a demand of ratePerSec: ceil(rate x Lead), the tokens spent
// while the renewal is in flight. A negative or NaN rate counts as zero.
func (s Sizing) LowWatermark(ratePerSec float64) int64 {
	return ceilTokens(ratePerSec, s.Lead)
}

// LeadWithin returns the renewal lead to use for a pool whose chunks stay
// spendable for life after they land: lead, shortened when the stock it
// keeps would outlive the grants. A region renews at lead's worth of demand
// and asks for lead plus rtt's worth, so it holds up to about two leads plus
// the round trip of demand; spent earliest-expiring first, the newest
// chunk's last token goes that long after it lands, up to a tick late. So
// the lead is at most (life - tick - rtt) / 2, and never below tick + rtt,
// the least time a renewal needs to land (a life that short strands some
// tokens rather than starve requests). Negative arguments count as zero.
func LeadWithin(lead, life, tick, rtt time.Duration) time.Duration {
	lead, life, tick, rtt = max(lead, 0), max(life, 0), max(tick, 0), max(rtt, 0)
	return min(lead, max((life-tick-rtt)/2, tick+rtt))
}

// ceilTokens returns ceil(rate x d) saturated to [0, MaxInt64].
func ceilTokens(ratePerSec float64, d time.Duration) int64 {
	if !(ratePerSec > 0) || d <= 0 { // also catches NaN
		return 0
	}
	x := math.Ceil(ratePerSec * d.Seconds())
	if x >= math.MaxInt64 { // float64(MaxInt64) rounds up to 2^63
		return math.MaxInt64
	}
	return int64(x)
}

// msToDuration converts milliseconds to a Duration, saturating at the
// Duration range instead of overflowing.
func msToDuration(ms int64) time.Duration {
	const maxMs = int64(math.MaxInt64 / int64(time.Millisecond))
	switch {
	case ms > maxMs:
		return math.MaxInt64
	case ms < -maxMs:
		return math.MinInt64
	}
	return time.Duration(ms) * time.Millisecond
}

func satAdd(a, b int64) int64 {
	s := a + b
	switch {
	case a > 0 && b > 0 && s < 0:
		return math.MaxInt64
	case a < 0 && b < 0 && s >= 0:
		return math.MinInt64
	}
	return s
}

// satSub returns a - b, saturating at the int64 bounds.
func satSub(a, b int64) int64 {
	if b == math.MinInt64 {
		if a >= 0 {
			return math.MaxInt64
		}
		return a - b
	}
	return satAdd(a, -b)
}
