package agent

import (
	"time"

	"github.com/allot-dev/allot/pkg/admission"
)

// OffsetClock is the system clock set Offset away from the machine's: an
// injected clock fault (regionagent -clock-offset, the chaos suite's
// skew-region scenario) for WithClock. time.Time.Add moves the wall and the
// monotonic reading alike, so intervals, and the lease deadlines measured on
// them from the moment an Acquire was sent, do not move; what moves is
// every wall-clock reading of the agent (its estimate of where the window
// ends, before the leader's clock corrects it, and its logs).
type OffsetClock struct {
	// Offset is added to every reading.
	Offset time.Duration
}

// Now implements admission.Clock.
func (c OffsetClock) Now() time.Time { return time.Now().Add(c.Offset) }

var _ admission.Clock = OffsetClock{}
