package fsm

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/allot-dev/allot/pkg/policy"
)

// standard is a per-tenant plan: a template of 1,000 per minute.
func standard() QuotaSpec {
	s := atlas(StrategyDemand)
	s.Name, s.TemplateKeys = "standard", 1
	return s
}

func TestTemplateInstancesArePoolsOfTheirOwn(t *testing.T) {
	h := newHarness(t)
	h.strict = true
	h.publish(t0, standard(), atlas(StrategyDemand))

	r := h.acquire(t0+1, "eu", "r1", Want{Quota: "standard/birch", Tokens: 1000}, Want{Quota: "standard/cedar", Tokens: 300}, Want{Quota: "atlas"})
	if g := r.Grants[0]; g.Quota != "standard/birch" || g.Tokens != 1000 || !g.PoolExhausted {
		t.Fatalf("birch: %+v, want the whole pool of 1,000", g)
	}
	if g := r.Grants[1]; g.Tokens != 300 || g.PoolRemaining != 700 {
		t.Fatalf("cedar: %+v, want 300 of its own 1,000", g)
	}
	if got := h.f.CurrentWindow("standard/cedar", t0+1); got.Quota != "standard/cedar" || got.Remaining != 700 || got.Limit != 1000 {
		t.Fatalf("CurrentWindow(cedar) = %+v", got)
	}
	if got := h.f.CurrentWindow("standard/dune", t0+1); got.Quota != "standard/dune" || got.Remaining != 1000 {
		t.Fatalf("an instance not acquired yet shows its full pool: %+v", got)
	}
	if w, ok := h.f.Window("standard/birch", r.Grants[0].WindowIndex); !ok || w.Granted != 1000 {
		t.Fatalf("Window(birch) = %+v, %v", w, ok)
	}
	if g, ok := h.f.Grant(r.Grants[1].GrantID); !ok || g.Quota != "standard/cedar" {
		t.Fatalf("Grant = %+v, %v", g, ok)
	}
	spec, ok := h.f.Quota("standard/birch")
	if !ok || spec.Name != "standard/birch" || spec.TemplateKeys != 0 || spec.Limit != 1000 {
		t.Fatalf("Quota(instance) = %+v, %v", spec, ok)
	}
	if st := h.f.Stats(); st.Quotas != 2 || st.Instances != 2 {
		t.Fatalf("stats %+v, want 2 quotas and 2 instances", st)
	}
	// A release goes back to the instance's pool.
	rel := h.release(t0+2, "eu", r.Grants[1].GrantID, 100)
	if rel.Returned != 100 || rel.PoolRemaining != 800 {
		t.Fatalf("release: %+v", rel)
	}
	// The snapshot carries the instances; restoring it gives the same bytes.
	snap := snapshotBytes(t, h.f)
	if !bytes.Contains(snap, []byte(`"name":"standard/cedar"`)) {
		t.Fatalf("snapshot lacks the instance:\n%s", snap)
	}
	f := New()
	if err := restore(f, snap); err != nil {
		t.Fatal(err)
	}
	if got := snapshotBytes(t, f); !bytes.Equal(got, snap) {
		t.Fatalf("restored snapshot differs:\n%s\n%s", got, snap)
	}
	if got := f.CurrentWindow("standard/cedar", t0+2); got.Remaining != 800 {
		t.Fatalf("restored cedar: %+v", got)
	}
}

func TestTemplateRejectsBadNames(t *testing.T) {
	h := newHarness(t)
	h.strict = true
	h.publish(t0, standard(), atlas(StrategyDemand), QuotaSpec{Name: "route", Limit: 10, WindowMs: minute, ChunkTokens: 1, TTLMs: 1000, TemplateKeys: 2})
	h.acquire(t0, "eu", "warm", Want{Quota: "standard/birch"})
	tests := []struct {
		give   string
		target error
		want   string
	}{
		{"standard", ErrInvalidArgument, `wants[0].quota "standard": a template, not a pool`},
		{"nope/birch", ErrUnknownQuota, `wants[0].quota "nope/birch"`},
		{"atlas/birch", ErrUnknownQuota, `"atlas" is a single pool, not a template`},
		{"standard/a/b", ErrInvalidArgument, "2 values, the template has 1"},
		{"route/a", ErrInvalidArgument, "1 values, the template has 2"},
		{"standard/", ErrInvalidArgument, "value 1 is empty"},
		{"standard/a%2fb", ErrInvalidArgument, `escape "%2f"`},
		{"standard/a%41", ErrInvalidArgument, `escape "%41"`},
		{"standard/a{b", ErrInvalidArgument, "unescaped"},
		{"standard/#xyz", ErrInvalidArgument, "hashed instance"},
		{"standard/" + strings.Repeat("x", MaxQuotaNameBytes), ErrInvalidArgument, "bytes, at most 128"},
	}
	for i, tt := range tests {
		t.Run(tt.give, func(t *testing.T) {
			res := h.acquireRes(t0+1, "eu", fmt.Sprint("bad-", i), Want{Quota: tt.give})
			err := wantErr(t, res, tt.target)
			if !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("error %q, want it to contain %q", err, tt.want)
			}
		})
	}
	for _, good := range []string{"route/atlas/GET %2Fcatalog", "standard/#0123456789abcdef0123456789abcdef"} {
		h.acquire(t0+1, "eu", "good-"+good, Want{Quota: good})
	}
	if _, ok := h.f.Quota("standard/a/b"); ok {
		t.Error("Quota accepts an instance with too many values")
	}
	if w := h.f.CurrentWindow("standard", t0); w.Quota != "" {
		t.Errorf("CurrentWindow of a template's own name: %+v", w)
	}
}

// TestTemplateNamesAgreeWithPolicy: every name policy.InstanceName writes
// is an instance for the state machine, and none is refused.
func TestTemplateNamesAgreeWithPolicy(t *testing.T) {
	h := newHarness(t)
	spec := standard()
	spec.TemplateKeys = 2
	h.publish(t0, spec)
	values := [][]string{
		{"atlas", "GET /catalog"}, {"a%b", "#x{y}"}, {"ünï", "c ø"}, {strings.Repeat("v", 200), "w"}, {"%", "/"},
	}
	for i, v := range values {
		name := policy.InstanceName(spec.Name, v)
		if len(name) > MaxQuotaNameBytes {
			t.Fatalf("%q: %d bytes", name, len(name))
		}
		r := h.acquire(t0, "eu", fmt.Sprint("r", i), Want{Quota: name, Tokens: 1})
		if r.Grants[0].Quota != name || r.Grants[0].Tokens != 1 {
			t.Fatalf("%q: %+v", name, r.Grants[0])
		}
	}
	if n := h.f.Stats().Instances; n != len(values) {
		t.Fatalf("%d instances, want %d", n, len(values))
	}
}

func TestIdleInstancesAreForgotten(t *testing.T) {
	h := newHarness(t)
	h.strict = true
	h.publish(t0, standard())
	r := h.acquire(t0, "eu", "r1", Want{Quota: "standard/birch", Tokens: 400})
	h.acquire(t0+40_000, "eu", "r2", Want{Quota: "standard/cedar", Tokens: 10})

	// Birch's window and demand are visible until the end of the next
	// minute; then it holds nothing and goes.
	if st := h.f.Stats(); st.Instances != 2 {
		t.Fatalf("%d instances, want 2", st.Instances)
	}
	h.acquire(t0+2*minute-1, "us", "r3", Want{Quota: "standard/cedar", Tokens: 1})
	if !bytes.Contains(snapshotBytes(t, h.f), []byte(`"name":"standard/birch"`)) {
		t.Fatal("birch forgotten while its window is the previous one")
	}
	h.acquire(t0+2*minute, "us", "r4", Want{Quota: "standard/cedar", Tokens: 1})
	if bytes.Contains(snapshotBytes(t, h.f), []byte(`"name":"standard/birch"`)) {
		t.Fatal("birch kept in the snapshot after it holds nothing")
	}
	if st := h.f.Stats(); st.Instances != 1 || st.Grants != 2 {
		t.Fatalf("stats %+v, want 1 instance (cedar) and the grants of its last two windows", st)
	}
	if _, ok := h.f.Grant(r.Grants[0].GrantID); ok {
		t.Fatal("a forgotten instance's grant is still visible")
	}
	wantErr(t, h.releaseRes(t0+2*minute, "eu", r.Grants[0].GrantID, 1), ErrUnknownGrant)

	// Named again, birch is a new pool.
	again := h.acquire(t0+2*minute+1, "eu", "r5", Want{Quota: "standard/birch", Tokens: 1000})
	if again.Grants[0].Tokens != 1000 {
		t.Fatalf("a new birch: %+v", again.Grants[0])
	}
	if st := h.f.Stats(); st.Instances != 2 {
		t.Fatalf("%d instances, want 2", st.Instances)
	}
}

// TestInstancesCollectedWithoutBeingTouched: the sweep forgets dead
// instances of a template nobody names any more.
func TestInstancesCollectedWithoutBeingTouched(t *testing.T) {
	h := newHarness(t)
	h.publish(t0, standard(), atlas(StrategyDemand))
	for i := range 50 {
		h.acquire(t0, "eu", fmt.Sprint("r", i), Want{Quota: fmt.Sprint("standard/t", i), Tokens: 1})
	}
	if n := h.f.Stats().Instances; n != 50 {
		t.Fatalf("%d instances", n)
	}
	h.acquire(t0+3*minute, "eu", "other", Want{Quota: "atlas", Tokens: 1})
	if st := h.f.Stats(); st.Instances != 0 || st.Grants != 1 {
		t.Fatalf("stats %+v: the dead instances and their grants linger", st)
	}
}

func TestInstanceCap(t *testing.T) {
	h := newHarness(t)
	h.strict = true
	h.publish(t0, standard())
	h.f.s.maxInstances = 3
	h.acquire(t0, "eu", "r1", Want{Quota: "standard/a"}, Want{Quota: "standard/b"})
	res := h.acquireRes(t0, "eu", "r2", Want{Quota: "standard/a"}, Want{Quota: "standard/c"}, Want{Quota: "standard/d"})
	err := wantErr(t, res, ErrResourceExhausted)
	if !strings.Contains(err.Error(), `wants[2].quota "standard/d": template "standard" has 2 live instances, at most 3`) {
		t.Fatalf("error %q does not name the want and the cap", err)
	}
	h.acquire(t0, "eu", "r3", Want{Quota: "standard/a"}, Want{Quota: "standard/c"})
	// Once a and b are dead, their places are free again, even though
	// nothing collected them yet.
	h.acquire(t0+40_000, "eu", "r4", Want{Quota: "standard/c"})
	h.acquire(t0+2*minute+1, "eu", "r5", Want{Quota: "standard/x"}, Want{Quota: "standard/y"})
}

func TestPublishChangesTemplates(t *testing.T) {
	h := newHarness(t)
	h.strict = true
	h.publish(t0, standard(), atlas(StrategyDemand))
	h.acquire(t0, "eu", "r1", Want{Quota: "standard/a", Tokens: 600}, Want{Quota: "standard/b", Tokens: 100})

	// A lower limit applies to every instance's current window.
	lower := standard()
	lower.Limit = 500
	h.publish(t0+1, lower, atlas(StrategyDemand))
	if w := h.f.CurrentWindow("standard/a", t0+1); w.Limit != 500 || w.Remaining != 0 {
		t.Fatalf("a after the limit fell to 500: %+v", w)
	}
	if w := h.f.CurrentWindow("standard/b", t0+1); w.Remaining != 400 {
		t.Fatalf("b after the limit fell to 500: %+v", w)
	}
	// A longer TTL keeps demand reports fresh longer: deaths are
	// recomputed and the list re-sorted; snapshots stay identical.
	longer := lower
	longer.TTLMs, longer.Clamp = minute, true
	h.publish(t0+2, longer, atlas(StrategyDemand))
	roundTrip(t, snapshotBytes(t, h.f)) // after a TTL change
	// A new window length drops the instances whole.
	wider := longer
	wider.WindowMs = 2 * minute
	res := h.publish(t0+3, wider, atlas(StrategyDemand))
	if !slices.Equal(res.WindowsReset, []string{"standard"}) || h.f.Stats().Instances != 0 {
		t.Fatalf("window change: reset %v, %d instances", res.WindowsReset, h.f.Stats().Instances)
	}
	h.acquire(t0+4, "eu", "r2", Want{Quota: "standard/a", Tokens: 1})
	// A template that becomes a single pool loses its instances, and its
	// instances' names become unknown.
	single := wider
	single.TemplateKeys = 0
	res = h.publish(t0+5, single, atlas(StrategyDemand))
	if !slices.Equal(res.WindowsReset, []string{"standard"}) || h.f.Stats().Instances != 0 {
		t.Fatalf("template to pool: reset %v, %d instances", res.WindowsReset, h.f.Stats().Instances)
	}
	wantErr(t, h.acquireRes(t0+6, "eu", "r3", Want{Quota: "standard/a"}), ErrUnknownQuota)
	// A dropped template goes with its instances.
	h.publish(t0+7, wider, atlas(StrategyDemand))
	h.acquire(t0+8, "eu", "r4", Want{Quota: "standard/a", Tokens: 1})
	res = h.publish(t0+9, atlas(StrategyDemand))
	if !slices.Equal(res.Removed, []string{"standard"}) || h.f.Stats().Instances != 0 {
		t.Fatalf("drop: removed %v, %d instances", res.Removed, h.f.Stats().Instances)
	}
}

func TestSpecNamesReserveTheSeparator(t *testing.T) {
	h := newHarness(t)
	p, _ := h.f.Policy()
	bad := atlas(StrategyDemand)
	bad.Name = "a/b"
	res := h.apply(Command{Type: CmdPublishPolicy, NowUnixMs: t0, Publish: &Publish{ExpectedVersion: p.Version + 1, Author: "a", Reason: "r", Quotas: []QuotaSpec{bad}}})
	if err := wantErr(t, res, ErrInvalidArgument); !strings.Contains(err.Error(), `quotas[0].name "a/b"`) {
		t.Fatalf("error %q does not name the field", err)
	}
	bad = standard()
	bad.TemplateKeys = MaxTemplateKeys + 1
	res = h.apply(Command{Type: CmdPublishPolicy, NowUnixMs: t0, Publish: &Publish{ExpectedVersion: p.Version + 1, Author: "a", Reason: "r", Quotas: []QuotaSpec{bad}}})
	if err := wantErr(t, res, ErrInvalidArgument); !strings.Contains(err.Error(), "quotas[0].template_keys 17") {
		t.Fatalf("error %q does not name the field", err)
	}
}

// TestBatchGrantIDsSurviveSnapshot: a batch entry numbers the wants of all
// its Acquires in one sequence, so its grant ids may pass MaxWants; a
// snapshot holding them must restore.
func TestBatchGrantIDsSurviveSnapshot(t *testing.T) {
	h := newHarness(t)
	h.publish(t0, standard())
	const n = MaxWants/2 + 10
	mk := func(region string) Command {
		a := &Acquire{Region: region, RequestID: "r-" + region, Wants: make([]Want, n)}
		for i := range a.Wants {
			a.Wants[i] = Want{Quota: fmt.Sprint("standard/t", i), Tokens: 1}
		}
		return Command{Type: CmdAcquire, Acquire: a}
	}
	res := h.apply(Command{Type: CmdBatch, NowUnixMs: t0, Batch: []Command{mk("eu"), mk("us")}})
	br, ok := res.(*BatchResult)
	if !ok {
		t.Fatalf("batch: %v", res)
	}
	last := br.Results[1].(*AcquireResult).Grants[n-1]
	if want := fmt.Sprint(h.index, "-", 2*n-1); last.GrantID != want {
		t.Fatalf("last grant id %q, want %q", last.GrantID, want)
	}
	roundTrip(t, snapshotBytes(t, h.f))
}

func TestRestoreRejectsBadInstances(t *testing.T) {
	h := newHarness(t)
	h.publish(t0, standard(), atlas(StrategyDemand))
	h.acquire(t0, "eu", "r1", Want{Quota: "standard/a", Tokens: 1}, Want{Quota: "standard/b", Tokens: 1})
	good := string(snapshotBytes(t, h.f))
	tests := []struct{ name, from, to string }{
		{"instance of a single pool", `"name":"standard/a"`, `"name":"atlas/a"`},
		{"instance of an unknown template", `"name":"standard/a"`, `"name":"nope/a"`},
		{"malformed instance", `"name":"standard/a"`, `"name":"standard/a{"`},
		{"out of order", `"name":"standard/b"`, `"name":"standard/0"`},
		{"count too low", `"instances":2`, `"instances":1`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			bad := strings.Replace(good, tt.from, tt.to, 1)
			if bad == good {
				t.Fatalf("%q not in the snapshot:\n%s", tt.from, good)
			}
			f := New()
			if err := restore(f, []byte(bad)); !errors.Is(err, ErrBadSnapshot) {
				t.Fatalf("Restore = %v, want ErrBadSnapshot", err)
			}
		})
	}
}
