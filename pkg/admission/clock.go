package admission

import "time"

// Clock tells the time. Engines use it for everything they time in process;
// it must be monotonic for durations (time.Now readings are).
type Clock interface {
	// Now returns the current time.
	Now() time.Time
}

// SystemClock is the real clock.
type SystemClock struct{}

// Now returns time.Now().
func (SystemClock) Now() time.Time { return time.Now() }

var _ Clock = SystemClock{}
