// Package testclock is a clock tests move by hand, for code that takes its
// time from a clock interface (admission.Clock, the agent's WithClock).
package testclock

import (
	"sync"
	"time"
)

// Manual is a clock that reads what it was set to; safe for concurrent use.
type Manual struct {
	mu sync.Mutex
	t  time.Time
}

// New returns a clock reading t.
func New(t time.Time) *Manual { return &Manual{t: t} }

// Now returns the clock's reading.
func (c *Manual) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

// Advance moves the clock by d (back when d is negative).
func (c *Manual) Advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

// Set moves the clock to t.
func (c *Manual) Set(t time.Time) {
	c.mu.Lock()
	c.t = t
	c.mu.Unlock()
}
