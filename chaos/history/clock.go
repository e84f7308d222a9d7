package history

import (
	"time"

	"golang.org/x/sys/unix"
)

// Clock is the one true clock of a chaos run.
type Clock interface {
	// Now returns the true time in Unix nanoseconds.
	Now() int64
}

// TrueClock reads CLOCK_MONOTONIC, which all processes of the machine
// share and which no wall-clock step or skew touches, shifted by Offset into
// Unix nanoseconds.
type TrueClock struct {
	// Offset is added to CLOCK_MONOTONIC readings (see NewTrueClock).
	Offset int64
}

// NewTrueClock measures the offset between the wall clock and
// CLOCK_MONOTONIC once; the suite passes it to every driver it starts so
// that all of them read the same clock.
func NewTrueClock() TrueClock {
	return TrueClock{Offset: time.Now().UnixNano() - monotonic()}
}

// Now implements Clock.
func (c TrueClock) Now() int64 { return monotonic() + c.Offset }

// Drift returns how far the wall clock has moved from the true clock since
// the offset was measured (positive: the wall clock is ahead). The report
// shows it: it should stay within a few milliseconds.
func (c TrueClock) Drift() time.Duration {
	return time.Duration(time.Now().UnixNano() - c.Now())
}

func monotonic() int64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		// CLOCK_MONOTONIC cannot fail on Linux; fall back to Go's clock.
		return time.Now().UnixNano()
	}
	return ts.Nano()
}
