package agent

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/zap"

	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/allocator"
)

// simTime is the true time of a simulation (the leader's clock, and the
// store's): how far it has run since a base instant.
type simTime struct {
	base    time.Time // a real reading moved to the simulation's start: it carries a monotonic reading
	elapsed atomic.Int64
}

// simClock is a machine clock in a simulation: offset from the true time
// and running ppm fast. Its readings, like time.Now's, carry a monotonic
// reading (the offset moves it too: a process started with its wall clock
// off).
type simClock struct {
	t      *simTime
	offset time.Duration
	ppm    int64
}

func (c simClock) Now() time.Time {
	e := time.Duration(c.t.elapsed.Load())
	return c.t.base.Add(c.offset + e + e*time.Duration(c.ppm)/1_000_000)
}

// TestFallbackAllowancesOfTwoWindowsNeverLiveAtOnce: two agents of a region
// (or a process and its restart) cut off from the allocator never hold the
// fallback allowances of two windows at once, whatever their wall clocks
// say: the region's pool never holds more than fallback_per_region of them.
// Agent a's clock is exact; b's is 6 s ahead and restarted during the
// partition (it never measured the leader's clock: it must deposit
// nothing), or ran 200 ppm fast through an hour's partition (720 ms: more
// than the 250 ms margin), or is 6 s ahead but measured the leader's clock.
// Both deposit their allowance at every 20 ms step from 5 s before the
// window's end to 5 s after it, on an in-memory store keeping the true time.
// (Estimating the window by the wall clock plus the offset measured at the
// last answer, b deposited the next window's allowance while a's was live:
// 10 tokens in the pool.)
func TestFallbackAllowancesOfTwoWindowsNeverLiveAtOnce(t *testing.T) {
	for _, tt := range []struct {
		name     string
		offset   time.Duration
		ppm      int64
		measured bool
	}{
		{"restarted during the partition, clock 6s ahead", 6 * time.Second, 0, false},
		{"clock 200ppm fast for an hour", 0, 200, true},
		{"clock 6s ahead, measured", 6 * time.Second, 0, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			// The window [S, E) of the simulation is an hour of the real
			// calendar (the policy's window is 1h); it starts a minute into it.
			end := time.Now().Truncate(time.Hour).Add(time.Hour)
			start := end.Add(-time.Hour + time.Minute)
			now := time.Now()
			sim := &simTime{base: now.Add(start.Sub(now))}
			truth := simClock{t: sim}
			st, err := admission.NewMemoryStore(admission.DefaultMemoryConfig(), truth)
			if err != nil {
				t.Fatal(err)
			}
			eng, doc := poolEngine(t, st, "skew")
			client, err := allocator.NewClient([]string{"127.0.0.1:1"}) // never called
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(client.Close)
			cfg := DefaultLeaseConfig() // 250 ms margin, 200 ppm
			agentOn := func(c simClock, measured bool) (*leases, *quota) {
				l := newLeases(cfg, "eu", client, c, zap.NewNop(), newMetrics(), "test", newWithdrawer(nil, "skew"), time.Second)
				l.setPolicy(doc, eng)
				l.mu.Lock()
				defer l.mu.Unlock()
				l.cutOff = true
				if measured { // an Acquire answered at the simulation's start
					l.observeLeader(truth.Now().UnixMilli(), c.Now(), c.Now())
				}
				return l, l.quotas["q"]
			}
			la, qa := agentOn(simClock{t: sim}, true)
			lb, qb := agentOn(simClock{t: sim, offset: tt.offset, ppm: tt.ppm}, tt.measured)
			ctx := context.Background()
			const f = 5 // poolPolicy's fallback_per_region
			from := end.Add(-5 * time.Second).Sub(start)
			for step := time.Duration(0); step <= 10*time.Second; step += 20 * time.Millisecond {
				sim.elapsed.Store(int64(from + step))
				la.depositFallback(ctx, eng, qa)
				lb.depositFallback(ctx, eng, qb)
				ps, err := eng.PoolStats(ctx, "q")
				if err != nil {
					t.Fatal(err)
				}
				if ps.Available > f {
					lb.mu.Lock()
					idx := qb.fallbackIdx
					lb.mu.Unlock()
					t.Fatalf("%s from the window's end: %d tokens spendable, want at most fallback_per_region %d (a's allowance of window %d, b's of %d)",
						truth.Now().Sub(end), ps.Available, f, qa.fallbackIdx, idx)
				}
				if step == 0 && ps.Available != f {
					t.Fatalf("5 s before the window's end: %d tokens spendable, want a's allowance of %d", ps.Available, f)
				}
			}
			if ps, err := eng.PoolStats(ctx, "q"); err != nil || ps.Available != f {
				t.Fatalf("5 s into the next window: pool %+v, %v; want its allowance of %d", ps, err, f)
			}
			lb.mu.Lock()
			defer lb.mu.Unlock()
			if !tt.measured && qb.hasFallback {
				t.Fatalf("b deposited the allowance of window %d without ever measuring the leader's clock", qb.fallbackIdx)
			}
		})
	}
}

// TestLeaderWall: the clock the agent gives its engine's in-process
// fallback reads the agent's own clock until the leader's clock is
// measured, and the leader's clock after, whatever the agent's says: an
// agent clock 3 s behind reads true time (within the measuring call's
// round trip) once an answer stamped by the leader (the machine's clock
// here) is observed.
func TestLeaderWall(t *testing.T) {
	client, err := allocator.NewClient([]string{"127.0.0.1:1"}) // never called
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(client.Close)
	agentClock := OffsetClock{Offset: -3 * time.Second}
	l := newLeases(DefaultLeaseConfig(), "eu", client, agentClock, zap.NewNop(), newMetrics(), "test", newWithdrawer(nil, "lw"), time.Second)
	w := leaderWall{l}
	if d := time.Since(w.Now()); d < 3*time.Second-50*time.Millisecond || d > 3*time.Second+50*time.Millisecond {
		t.Fatalf("before a measurement: %s behind the machine's clock, want the agent's 3 s", d)
	}
	sent := agentClock.Now()
	stamp := time.Now().UnixMilli() // the leader's
	recv := agentClock.Now()
	l.mu.Lock()
	l.observeLeader(stamp, sent, recv)
	l.mu.Unlock()
	time.Sleep(20 * time.Millisecond)
	if d := time.Since(w.Now()); d < -5*time.Millisecond || d > 5*time.Millisecond {
		t.Fatalf("after a measurement: %s off the leader's (the machine's) clock, want within 5 ms", d)
	}
}
