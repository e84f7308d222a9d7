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
