package agent

import "time"

// ClockOffset returns the lease manager's estimates of the leader's wall
// clock minus the agent's (ms) and of an Acquire's round trip.
func (a *Agent) ClockOffset() (int64, time.Duration) {
	a.leases.mu.Lock()
	defer a.leases.mu.Unlock()
	return a.leases.offsetMs, a.leases.acquireRTT
}
