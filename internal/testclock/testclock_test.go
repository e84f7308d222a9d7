package testclock

import (
	"testing"
	"time"
)

func TestManual(t *testing.T) {
	t0 := time.UnixMilli(1_700_000_000_000)
	c := New(t0)
	if !c.Now().Equal(t0) {
		t.Fatalf("new clock reads %v, want %v", c.Now(), t0)
	}
	c.Advance(1500 * time.Millisecond)
	if got := c.Now().Sub(t0); got != 1500*time.Millisecond {
		t.Fatalf("after Advance: %s past t0, want 1.5s", got)
	}
	c.Set(t0.Add(-time.Second))
	if got := c.Now().Sub(t0); got != -time.Second {
		t.Fatalf("after Set: %s past t0, want -1s", got)
	}
}
