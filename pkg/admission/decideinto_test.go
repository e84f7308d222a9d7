package admission_test

import (
	"context"
	"errors"
	"testing"

	"github.com/allot-dev/allot/pkg/admission"
)

// TestDecideIntoMatchesDecide: on every store, the same sequence of
// requests decided with Decide on one engine and with DecideInto into one
// reused Decision on another gives the same decisions (ids aside), and the
// reused Decision keeps its Rules array when it has room.
func TestDecideIntoMatchesDecide(t *testing.T) {
	for _, b := range backends() {
		t.Run(b.name, func(t *testing.T) {
			doc := northstar(t)
			fresh, reused := newHarness(t, b, doc, nil), newHarness(t, b, doc, nil)
			var d admission.Decision
			seq := [][]string{
				catalog("cedar", "U-1"), // three rules
				export("cedar"),         // concurrency slots and a daily window
				{"tenant", "nobody", "route", "GET /nowhere"},
				anon("203.0.113.9"),
			}
			for i := 0; i < 25; i++ { // U-1 is denied after 20
				seq = append(seq, catalog("cedar", "U-1"))
			}
			var first *admission.RuleResult
			for i, kv := range seq {
				want := fresh.decide(kv...)
				if d.HasSlots() {
					if err := reused.e.Release(context.Background(), &d); err != nil {
						t.Fatal(err)
					}
				}
				if err := reused.e.DecideInto(context.Background(), &admission.Request{Descriptors: entries(kv...)}, &d); err != nil {
					t.Fatalf("request %d: DecideInto: %v", i, err)
				}
				if d.ID == "" || d.Outcome != want.Outcome || d.Rule != want.Rule || d.Scope != want.Scope || d.RetryAfter != want.RetryAfter ||
					d.Remaining != want.Remaining || d.Source != want.Source || d.HasSlots() != want.HasSlots() || len(d.Rules) != len(want.Rules) {
					t.Fatalf("request %d (%v): DecideInto gave %+v, Decide %+v", i, kv, d, *want)
				}
				for j := range d.Rules {
					if d.Rules[j] != want.Rules[j] {
						t.Fatalf("request %d: rule %d: %+v, Decide gave %+v", i, j, d.Rules[j], want.Rules[j])
					}
				}
				if len(d.Rules) == 3 {
					if first == nil {
						first = &d.Rules[0]
					} else if &d.Rules[0] != first {
						t.Fatalf("request %d: a new Rules array although the reused one had room", i)
					}
				}
			}
			if d.Allowed() {
				t.Fatalf("U-1's 25th catalog request after 20 allowed: %+v", d)
			}
			if err := reused.e.DecideInto(context.Background(), &admission.Request{Descriptors: entries(catalog("cedar", "U-2")...)}, nil); !errors.Is(err, admission.ErrInvalidRequest) {
				t.Fatalf("DecideInto(nil): %v, want ErrInvalidRequest", err)
			}
		})
	}
}
