package bound

import (
	"math"
	"reflect"
	"testing"

	"pgregory.net/rapid"
)

func TestReconcile(t *testing.T) {
	// Atlas with a fallback of 100 per region, in the agent and again in the
	// gateways: G 1,000, ceiling 1,400.
	c := atlas()
	c.FallbackPerRegion = 100
	b := Calculate(c)

	r := Reconcile(b, []Observation{
		{WindowIndex: 7, Admitted: map[string]int64{"eu": 1300, "us": 150}, Unspent: map[string]int64{"us": 0}},
		{WindowIndex: 5, Admitted: map[string]int64{"eu": 900, "us": 100}, Granted: map[string]int64{"eu": 900, "us": 300}, Unspent: map[string]int64{"us": 200}},
		{WindowIndex: 6, Admitted: map[string]int64{"eu": 1000}},
		{WindowIndex: 6, Admitted: map[string]int64{"us": 190}}, // reported separately, summed
	})
	if r.Limit != 1000 || r.Ceiling != 1400 {
		t.Fatalf("Limit %d Ceiling %d", r.Limit, r.Ceiling)
	}
	want := []WindowReport{
		{WindowIndex: 5, Admitted: 1000, Regions: []RegionLedger{{"eu", 900, 900, 0}, {"us", 100, 300, 200}},
			StrandedKnown: true, Stranded: 200, StrandedPercent: 20},
		{WindowIndex: 6, Admitted: 1190, Overshoot: 190, Regions: []RegionLedger{{"eu", 1000, 0, 0}, {"us", 190, 0, 0}}},
		{WindowIndex: 7, Admitted: 1450, Overshoot: 450, Violation: true, Regions: []RegionLedger{{"eu", 1300, 0, 0}, {"us", 150, 0, 0}},
			StrandedKnown: true},
	}
	if !reflect.DeepEqual(r.Windows, want) {
		t.Errorf("Windows:\ngot  %+v\nwant %+v", r.Windows, want)
	}
	if len(r.Violations) != 1 || r.Violations[0].WindowIndex != 7 || r.OK() {
		t.Errorf("Violations = %+v", r.Violations)
	}
	if r.MaxOvershoot != 450 {
		t.Errorf("MaxOvershoot = %d", r.MaxOvershoot)
	}

	// The same admissions under the strict bound: every window over G is a
	// violation.
	strict := Reconcile(Calculate(atlas()), []Observation{{WindowIndex: 1, Admitted: map[string]int64{"eu": 1001}}})
	if strict.OK() || strict.Ceiling != 1000 {
		t.Errorf("strict: %+v", strict)
	}
	if empty := Reconcile(b, nil); !empty.OK() || len(empty.Windows) != 0 {
		t.Errorf("empty: %+v", empty)
	}
}

// TestReconcileProperty: a window is a violation exactly when its total
// exceeds G + Total, and totals are the sums of the regions' reports.
func TestReconcileProperty(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		b := Calculate(genConfig(t))
		regions := []string{"eu", "us", "ap"}
		obs := rapid.SliceOf(rapid.Custom(func(t *rapid.T) Observation {
			o := Observation{WindowIndex: rapid.Int64Range(0, 5).Draw(t, "w"), Admitted: map[string]int64{}}
			for _, r := range regions {
				if rapid.Bool().Draw(t, "has") {
					o.Admitted[r] = rapid.Int64Range(0, 2*b.Limit).Draw(t, "n")
				}
			}
			return o
		})).Draw(t, "obs")
		sums := map[int64]int64{}
		for _, o := range obs {
			sums[o.WindowIndex] += 0 // a window reported with no admissions is still a window
			for _, v := range o.Admitted {
				sums[o.WindowIndex] += v
			}
		}
		rep := Reconcile(b, obs)
		if len(rep.Windows) != len(sums) {
			t.Fatalf("%d windows, want %d", len(rep.Windows), len(sums))
		}
		violations := 0
		for i, w := range rep.Windows {
			if i > 0 && rep.Windows[i-1].WindowIndex >= w.WindowIndex {
				t.Fatal("windows out of order")
			}
			if w.Admitted != sums[w.WindowIndex] {
				t.Fatalf("window %d admitted %d, want %d", w.WindowIndex, w.Admitted, sums[w.WindowIndex])
			}
			if w.Violation != (w.Admitted > b.Limit+b.Total) {
				t.Fatalf("window %d: violation %v with %d admitted, ceiling %d", w.WindowIndex, w.Violation, w.Admitted, b.Ceiling())
			}
			if w.Violation {
				violations++
			}
		}
		if violations != len(rep.Violations) {
			t.Fatalf("%d violations listed, %d found", len(rep.Violations), violations)
		}
	})
}

// TestReconcileBadCounts: a huge count saturates instead of wrapping
// negative (and hiding the violation), and a negative count is flagged and
// left out of the sums instead of cancelling another region's admissions.
func TestReconcileBadCounts(t *testing.T) {
	b := Calculate(atlas()) // G 1,000, ceiling 1,000
	tests := []struct {
		name          string
		give          Observation
		wantAdmitted  int64
		wantViolation bool
		wantInvalid   []InvalidCount
	}{
		{
			name:          "sum saturates",
			give:          Observation{WindowIndex: 3, Admitted: map[string]int64{"eu": math.MaxInt64, "us": 5000}},
			wantAdmitted:  math.MaxInt64,
			wantViolation: true,
		},
		{
			name:          "negative count does not offset",
			give:          Observation{WindowIndex: 3, Admitted: map[string]int64{"eu": 5000, "us": -4500}},
			wantAdmitted:  5000,
			wantViolation: true,
			wantInvalid:   []InvalidCount{{WindowIndex: 3, Region: "us", Field: "admitted", Value: -4500}},
		},
		{
			name: "negative counts under the ceiling still fail",
			give: Observation{WindowIndex: 4, Admitted: map[string]int64{"eu": 500, "us": -1},
				Granted: map[string]int64{"eu": -2}, Unspent: map[string]int64{"eu": -3, "us": 7}},
			wantAdmitted: 500,
			wantInvalid: []InvalidCount{
				{WindowIndex: 4, Region: "eu", Field: "granted", Value: -2},
				{WindowIndex: 4, Region: "eu", Field: "unspent", Value: -3},
				{WindowIndex: 4, Region: "us", Field: "admitted", Value: -1},
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := Reconcile(b, []Observation{tt.give})
			if len(r.Windows) != 1 {
				t.Fatalf("%d windows, want 1", len(r.Windows))
			}
			w := r.Windows[0]
			if w.Admitted != tt.wantAdmitted || w.Violation != tt.wantViolation {
				t.Errorf("admitted %d violation %v, want %d %v", w.Admitted, w.Violation, tt.wantAdmitted, tt.wantViolation)
			}
			if !reflect.DeepEqual(r.Invalid, tt.wantInvalid) {
				t.Errorf("Invalid = %+v, want %+v", r.Invalid, tt.wantInvalid)
			}
			if r.OK() {
				t.Errorf("OK() = true for %+v", r)
			}
			for _, l := range w.Regions {
				if l.Admitted < 0 || l.Granted < 0 || l.Unspent < 0 {
					t.Errorf("ledger %+v has a negative count", l)
				}
			}
		})
	}
}
