package chaos

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/allot-dev/allot/chaos/history"
	"github.com/allot-dev/allot/pkg/policy"
)

// TestCountDropped reads the packet counters of tagged DROP rules from the
// output of `iptables -L -v -x -n` (the format of iptables 1.8, nf_tables),
// which partition-region and cut-allocators use to prove their cut took
// effect.
func TestCountDropped(t *testing.T) {
	out := `Chain INPUT (policy ACCEPT 0 packets, 0 bytes)
    pkts      bytes target     prot opt in     out     source               destination         
      17     1020 DROP       0    --  *      *       10.77.0.21           0.0.0.0/0            /* chaos-cut */
       4      240 DROP       0    --  *      *       10.77.0.22           0.0.0.0/0            /* chaos-cut */
       9      540 DROP       0    --  *      *       10.77.0.23           0.0.0.0/0            /* chaos-partition */

Chain FORWARD (policy ACCEPT 0 packets, 0 bytes)
    pkts      bytes target     prot opt in     out     source               destination         

Chain OUTPUT (policy ACCEPT 52 packets, 3120 bytes)
    pkts      bytes target     prot opt in     out     source               destination         
       0        0 DROP       0    --  *      *       0.0.0.0/0            10.77.0.21           /* chaos-cut */
     100     6000 ACCEPT     0    --  *      *       0.0.0.0/0            10.77.0.22           /* chaos-cut */
`
	if got := countDropped(out, "chaos-cut"); got != 21 {
		t.Errorf("chaos-cut: %d packets dropped, want 21 (17 + 4 + 0; the ACCEPT rule does not count)", got)
	}
	if got := countDropped(out, "chaos-partition"); got != 9 {
		t.Errorf("chaos-partition: %d packets dropped, want 9", got)
	}
	if got := countDropped(out, "chaos-isolate"); got != 0 {
		t.Errorf("chaos-isolate (no rule): %d packets dropped, want 0", got)
	}
}

// TestScheduleStepsDependOnSeedAndPlace: step i of a schedule (its
// scenarios and their parameters' seeds) depends on the run's seed and i
// alone, so a soak replayed with another -chaos.soak runs the same steps
// first, and a scenario gets the same parameters wherever the same seed
// puts it at the same place.
func TestScheduleStepsDependOnSeedAndPlace(t *testing.T) {
	for _, withStore := range []bool{true, false} {
		short, long := RandomSchedule(42, 5, withStore), RandomSchedule(42, 50, withStore)
		if len(short) != 5 || len(long) != 50 {
			t.Fatalf("%d and %d steps, want 5 and 50", len(short), len(long))
		}
		for i := range short {
			if short[i].String() != long[i].String() || !slices.Equal(short[i].Seeds, long[i].Seeds) {
				t.Errorf("step %d: %s %v with n=5, %s %v with n=50", i, short[i], short[i].Seeds, long[i], long[i].Seeds)
			}
			if len(short[i].Seeds) != len(short[i].Scenarios) {
				t.Errorf("step %d: %d seeds for %d scenarios", i, len(short[i].Seeds), len(short[i].Scenarios))
			}
		}
		for _, st := range long {
			for _, sc := range st.Scenarios {
				if !withStore && sc.Name == "restart-store" {
					t.Errorf("restart-store drawn for regions without a store")
				}
			}
		}
		if other := RandomSchedule(43, 5, withStore); fmt.Sprint(other) == fmt.Sprint(short) {
			t.Errorf("seeds 42 and 43 drew the same schedule %v", short)
		}
	}
	// A fixed schedule gives step i the same seeds whatever follows it.
	all := ShortSchedule(42)
	some := FixedSchedule(42, Scenarios()[:3])
	for i := range some {
		if !slices.Equal(some[i].Seeds, all[i].Seeds) {
			t.Errorf("fixed step %d: seeds %v and %v", i, some[i].Seeds, all[i].Seeds)
		}
	}
}

// fakeCluster is a restarter whose allocators come back after upIn and
// elect a leader after leaderIn, noting when (true clock).
type fakeCluster struct {
	clock            history.TrueClock
	upIn, leaderIn   time.Duration
	started, leading int64
}

func (f *fakeCluster) kill() int { return 3 }

func (f *fakeCluster) start() error { f.started = f.clock.Now(); return nil }

func (f *fakeCluster) waitUp(ctx context.Context) error { return sleepCtx(ctx, f.upIn) }

func (f *fakeCluster) waitLeader(ctx context.Context) (string, error) {
	if err := sleepCtx(ctx, f.leaderIn); err != nil {
		return "", err
	}
	f.leading = f.clock.Now()
	return "a2", nil
}

// TestRestartAllSpanEndsWithALeader: restart-all's span (Birch's excuse)
// ends once the allocators are up and a leader is known, like
// kill-leader-storm's, not when their processes were started; recovery
// counts from the restart.
func TestRestartAllSpanEndsWithALeader(t *testing.T) {
	s := &Suite{clock: history.NewTrueClock(), rec: &history.Recorder{}}
	c := &fakeCluster{clock: s.clock, upIn: 100 * time.Millisecond, leaderIn: 200 * time.Millisecond}
	sp, err := s.restartAll(context.Background(), c)
	if err != nil {
		t.Fatal(err)
	}
	if sp.End < c.leading {
		t.Errorf("the span ends %s before the leader was known", time.Duration(c.leading-sp.End))
	}
	if sp.RecoverFrom < c.started || sp.RecoverFrom >= c.leading {
		t.Errorf("recovery counted from %d, want the restart (%d, before the leader at %d)", sp.RecoverFrom, c.started, c.leading)
	}
	h := s.rec.Snapshot()
	last := h.Faults[len(h.Faults)-1]
	if last.Action != "heal" || last.At != sp.End || !strings.Contains(last.Detail, "leader a2") {
		t.Errorf("last fault %+v, want the heal at the span's end naming the leader", last)
	}
}

// TestPolicyDocCarriesTheCap: a quota plan's MaxHeldPerRegion reaches the
// published policy (and only when set).
func TestPolicyDocCarriesTheCap(t *testing.T) {
	cfg := DefaultConfig(1)
	cfg.Quotas[0].MaxHeldPerRegion = 300
	s := &Suite{cfg: cfg}
	d, err := policy.Parse(s.policyDoc())
	if err != nil {
		t.Fatalf("%v\n%s", err, s.policyDoc())
	}
	if err := d.Validate(); err != nil {
		t.Fatal(err)
	}
	if got := d.Rule("atlas").Lease.MaxHeldPerRegion; got != 300 {
		t.Errorf("atlas max_held_per_region = %d, want 300", got)
	}
	if got := d.Rule("birch").Lease.MaxHeldPerRegion; got != 0 {
		t.Errorf("birch max_held_per_region = %d, want none", got)
	}
}
