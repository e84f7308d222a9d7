package policy

import (
	"reflect"
	"slices"
	"testing"
	"time"

	"github.com/allot-dev/allot/examples"
)

func TestDiff(t *testing.T) {
	a := mustParse(t, examples.Northstar)

	if got := Diff(a, a.Clone()); len(got) != 0 {
		t.Errorf("Diff of equal documents = %v", got)
	}
	reordered := a.Clone()
	slices.Reverse(reordered.Rules)
	if got := Diff(a, reordered); len(got) != 0 {
		t.Errorf("Diff ignores order, got %v", got)
	}

	b := a.Clone()
	b.Regions = []string{"ap", "eu", "us"}
	atlas := b.Rule("p-tenant-atlas")
	atlas.Limit = 1200
	atlas.Lease.TTL = 10 * time.Second
	atlas.Lease.MaxHeldPerRegion = 200
	read := b.Rule("p-read")
	read.RefillMilliPerSecond = 500
	read.Shadow = true
	b.Rules = slices.DeleteFunc(b.Rules, func(r Rule) bool { return r.Name == "p-anon" })
	b.Rules = append(b.Rules, Rule{
		Name: "p-login", Scope: ScopeIP, Kind: KindFixedWindow, Limit: 5, Window: time.Minute, Cost: 1, FailMode: FailClosed,
		Match: []Match{{Key: "route", Value: "POST /login", HasValue: true}, {Key: "ip"}},
	})
	if err := b.Validate(); err != nil {
		t.Fatal(err)
	}

	var got []string
	for _, c := range Diff(a, b) {
		got = append(got, c.String())
	}
	want := []string{
		"~ regions: eu,us -> ap,eu,us",
		"- rule p-anon: fixed_window scope=ip match=[auth=anonymous, ip=*] limit=20/10s cost=1 fail_mode=fallback",
		"+ rule p-login: fixed_window scope=ip match=[route=POST /login, ip=*] limit=5/1m cost=1 fail_mode=closed",
		"~ rule p-read: refill_per_second 2 -> 0.5",
		"~ rule p-read: shadow false -> true",
		"~ rule p-tenant-atlas: limit 1000 -> 1200",
		"~ rule p-tenant-atlas: lease.ttl 15s -> 10s",
		"~ rule p-tenant-atlas: lease.max_held_per_region 0 -> 200",
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("Diff:\ngot  %q\nwant %q", got, want)
	}
}

func TestDiffKindChange(t *testing.T) {
	a := mustParse(t, examples.Northstar)
	b := a.Clone()
	r := b.Rule("p-anon")
	r.Kind = KindTokenBucket
	r.Limit, r.Window = 0, 0
	r.Capacity, r.RefillMilliPerSecond = 20, 2000
	if err := b.Validate(); err != nil {
		t.Fatal(err)
	}
	want := []Change{
		{Op: OpChanged, Rule: "p-anon", Field: "kind", Old: "fixed_window", New: "token_bucket"},
		{Op: OpChanged, Rule: "p-anon", Field: "limit", Old: "20"},
		{Op: OpChanged, Rule: "p-anon", Field: "window", Old: "10s"},
		{Op: OpChanged, Rule: "p-anon", Field: "capacity", New: "20"},
		{Op: OpChanged, Rule: "p-anon", Field: "refill_per_second", New: "2"},
	}
	if got := Diff(a, b); !reflect.DeepEqual(got, want) {
		t.Errorf("Diff:\ngot  %+v\nwant %+v", got, want)
	}
	if s := want[1].String(); s != "~ rule p-anon: limit 20 -> (unset)" {
		t.Errorf("String = %q", s)
	}
}

// TestDiffMatch: a change of match list is reported whenever the digest
// changes, even when the old text form of the lists was the same: a
// wildcard against the value "*", and values that contain ", key=".
func TestDiffMatch(t *testing.T) {
	base := mustParse(t, examples.Northstar)
	tests := []struct {
		name     string
		old, new []Match
	}{
		{"wildcard and the value *",
			[]Match{{Key: "tenant"}},
			[]Match{{Key: "tenant", Value: "*", HasValue: true}}},
		{"a value that reads as two entries",
			[]Match{{Key: "tenant", Value: "atlas", HasValue: true}, {Key: "route", Value: "GET /x", HasValue: true}},
			[]Match{{Key: "tenant", Value: "atlas, route=GET /x", HasValue: true}}},
		{"a separator moved between values",
			[]Match{{Key: "route", Value: "a, tenant=b", HasValue: true}, {Key: "tenant"}},
			[]Match{{Key: "route", Value: "a", HasValue: true}, {Key: "tenant", Value: "b, tenant=*", HasValue: true}}},
		{"a quote and a bracket",
			[]Match{{Key: "tenant", Value: `"x"`, HasValue: true}},
			[]Match{{Key: "tenant", Value: "x", HasValue: true}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a, b := base.Clone(), base.Clone()
			a.Rule("p-tenant-atlas").Match = tt.old
			b.Rule("p-tenant-atlas").Match = tt.new
			for _, d := range []*Document{a, b} {
				if err := d.Validate(); err != nil {
					t.Fatal(err)
				}
			}
			if Digest(a) == Digest(b) {
				t.Fatal("the test documents have equal digests")
			}
			got := Diff(a, b)
			if len(got) != 1 || got[0].Field != "match" || got[0].Old == got[0].New {
				t.Fatalf("Diff = %+v; want one match change with distinct values", got)
			}
			if back := Diff(b, a); len(back) != 1 || back[0].Old != got[0].New || back[0].New != got[0].Old {
				t.Errorf("Diff(b, a) = %+v, not the reverse of %+v", back, got)
			}
		})
	}
	// Plain values stay readable.
	m := []Match{{Key: "route", Value: "GET /catalog", HasValue: true}, {Key: "tenant"}, {Key: "tenant", Value: "*", HasValue: true}}
	if got, want := formatMatch(m), `[route=GET /catalog, tenant=*, tenant="*"]`; got != want {
		t.Errorf("formatMatch = %s, want %s", got, want)
	}
}

// TestFormatMatchInjective: two match lists have the same text form only if
// they are equal. Every list of up to two entries is tried, with values made
// of the form's own punctuation.
func TestFormatMatchInjective(t *testing.T) {
	tokens := []string{"x", "*", ",", " ", ", ", "=", "a=", ", a=", ", b=*", `"`, `\`, "[", "]"}
	var values []string
	for _, a := range tokens {
		values = append(values, a)
		for _, b := range tokens {
			values = append(values, a+b)
		}
	}
	slices.Sort(values)
	values = slices.Compact(values)
	var entries []Match
	for _, k := range []string{"a", "b"} {
		entries = append(entries, Match{Key: k})
		for _, v := range values {
			entries = append(entries, Match{Key: k, Value: v, HasValue: true})
		}
	}
	seen := make(map[string][]Match)
	check := func(ms []Match) {
		s := formatMatch(ms)
		if prev, dup := seen[s]; dup {
			t.Fatalf("%#v and %#v are both written %s", prev, ms, s)
		}
		seen[s] = ms
	}
	for _, e := range entries {
		check([]Match{e})
		for _, f := range entries {
			check([]Match{e, f})
		}
	}
}

// TestDiffSummaryNamesMaxHeld: an added global quota's summary shows its
// per-region cap when it has one.
func TestDiffSummaryNamesMaxHeld(t *testing.T) {
	a := mustParse(t, examples.Northstar)
	b := a.Clone()
	b.Rules = slices.DeleteFunc(b.Rules, func(r Rule) bool { return r.Name == "p-tenant-atlas" })
	c := a.Clone()
	c.Rule("p-tenant-atlas").Lease.MaxHeldPerRegion = 100
	for _, tt := range []struct {
		to   *Document
		want string
	}{
		{a, "+ rule p-tenant-atlas: global_quota scope=tenant match=[tenant=atlas] limit=1000/1m cost=1 chunk=100 ttl=15s clamp=true fail_mode=closed"},
		{c, "+ rule p-tenant-atlas: global_quota scope=tenant match=[tenant=atlas] limit=1000/1m cost=1 chunk=100 ttl=15s clamp=true max_held_per_region=100 fail_mode=closed"},
	} {
		got := Diff(b, tt.to)
		if len(got) != 1 || got[0].String() != tt.want {
			t.Errorf("Diff = %v, want [%s]", got, tt.want)
		}
	}
}
