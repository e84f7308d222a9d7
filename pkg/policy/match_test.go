package policy

import (
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/allot-dev/allot/examples"
	"pgregory.net/rapid"
)

type matchResult struct {
	rule  string
	parts string
}

func summarizeMatches(ms []Matched) []matchResult {
	var out []matchResult
	for _, m := range ms {
		out = append(out, matchResult{m.Rule.Name, strings.Join(m.Parts, "|")})
	}
	return out
}

func TestMatchNorthstar(t *testing.T) {
	d := mustParse(t, examples.Northstar)
	m := Compile(d)
	tests := []struct {
		name string
		give []Entry
		want []matchResult
	}{
		{
			name: "Atlas user reads the catalog: global, tenant, user",
			give: []Entry{{"ip", "198.51.100.4"}, {"auth", "token"}, {"tenant", "atlas"}, {"user", "U-17"}, {"route", "GET /catalog"}},
			want: []matchResult{{"p-global", ""}, {"p-tenant-atlas", ""}, {"p-read", "atlas|U-17"}},
		},
		{
			name: "Birch user reads the catalog: its own pool, never Atlas's",
			give: []Entry{{"ip", "203.0.113.9"}, {"auth", "token"}, {"tenant", "birch"}, {"user", "B-1"}, {"route", "GET /catalog"}},
			want: []matchResult{{"p-global", ""}, {"p-tenant-birch", ""}, {"p-read", "birch|B-1"}},
		},
		{
			name: "Atlas export: rate and concurrency per tenant plus the tenant quota",
			give: []Entry{{"tenant", "atlas"}, {"user", "U-17"}, {"route", "POST /reports/export"}, {"auth", "token"}},
			want: []matchResult{{"p-export", "atlas"}, {"p-export-concurrency", "atlas"}, {"p-tenant-atlas", ""}},
		},
		{
			name: "anonymous catalog read: ip first, then global",
			give: []Entry{{"ip", "203.0.113.7"}, {"auth", "anonymous"}, {"route", "GET /catalog"}},
			want: []matchResult{{"p-anon", "203.0.113.7"}, {"p-global", ""}},
		},
		{
			name: "anonymous request elsewhere",
			give: []Entry{{"ip", "203.0.113.7"}, {"auth", "anonymous"}, {"route", "GET /status"}},
			want: []matchResult{{"p-anon", "203.0.113.7"}},
		},
		{
			name: "entry order does not matter",
			give: []Entry{{"route", "GET /catalog"}, {"user", "U-17"}, {"tenant", "atlas"}},
			want: []matchResult{{"p-global", ""}, {"p-tenant-atlas", ""}, {"p-read", "atlas|U-17"}},
		},
		{
			name: "empty user is absent, not one shared counter",
			give: []Entry{{"tenant", "atlas"}, {"user", ""}, {"route", "GET /catalog"}},
			want: []matchResult{{"p-global", ""}, {"p-tenant-atlas", ""}},
		},
		{
			name: "first occurrence of a key wins",
			give: []Entry{{"tenant", "atlas"}, {"tenant", "birch"}, {"route", "GET /status"}},
			want: []matchResult{{"p-tenant-atlas", ""}},
		},
		{
			name: "an empty first occurrence hides later ones",
			give: []Entry{{"tenant", ""}, {"tenant", "birch"}},
			want: nil,
		},
		{
			name: "values are case-sensitive",
			give: []Entry{{"tenant", "Atlas"}, {"route", "get /catalog"}},
			want: nil,
		},
		{name: "no entries", give: nil, want: nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := summarizeMatches(m.Match(tt.give)); !reflect.DeepEqual(got, tt.want) {
				t.Errorf("Matcher.Match = %v, want %v", got, tt.want)
			}
			if got := summarizeMatches(d.Match(tt.give)); !reflect.DeepEqual(got, tt.want) {
				t.Errorf("Document.Match = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestMatcherRulesOrder(t *testing.T) {
	m := Compile(mustParse(t, examples.Northstar))
	var got []string
	for _, r := range m.Rules() {
		got = append(got, string(r.Scope)+":"+r.Name)
	}
	want := []string{"ip:p-anon", "global:p-global", "tenant:p-export", "tenant:p-export-concurrency",
		"tenant:p-tenant-atlas", "tenant:p-tenant-birch", "user:p-read"}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("evaluation order %v, want %v", got, want)
	}
}

func TestAppendMatchReusesBuffer(t *testing.T) {
	m := Compile(mustParse(t, examples.Northstar))
	req := []Entry{{"tenant", "atlas"}, {"user", "U-17"}, {"route", "GET /catalog"}}
	buf := make([]Matched, 0, 8)
	got := m.AppendMatch(buf[:0], req)
	if len(got) != 3 || &got[0] != &buf[:1][0] {
		t.Errorf("AppendMatch did not append into dst: %v", got)
	}
}

// TestMatcherAgreesWithDocument: the index never changes the answer.
func TestMatcherAgreesWithDocument(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		o := smallOpts()
		d := genDocument(o).Draw(t, "doc")
		m := Compile(d)
		for i := range 5 {
			req := genEntries(o).Draw(t, fmt.Sprintf("req%d", i))
			want, got := d.Match(req), m.Match(req)
			if !reflect.DeepEqual(got, want) {
				t.Fatalf("request %v:\nmatcher  %v\ndocument %v", req, summarizeMatches(got), summarizeMatches(want))
			}
			for _, mt := range got {
				if _, ok := matchRule(mt.Rule, req, nil); !ok {
					t.Fatalf("%s matched %v but does not apply", mt.Rule.Name, req)
				}
			}
			// Without parts: the same rules and instances, and each
			// match's PartsIn gives the parts AppendMatch kept.
			rules, parts := m.AppendMatchRules(nil, nil, req)
			if len(rules) != len(got) {
				t.Fatalf("request %v: AppendMatchRules %v, AppendMatch %v", req, summarizeMatches(rules), summarizeMatches(got))
			}
			for j, mt := range rules {
				if mt.Rule != got[j].Rule || mt.Instance != got[j].Instance || mt.Parts != nil {
					t.Fatalf("request %v, match %d: AppendMatchRules %+v, AppendMatch %+v", req, j, mt, got[j])
				}
				if p := mt.PartsIn(parts); !slices.Equal(p, got[j].Parts) {
					t.Fatalf("request %v, rule %s: PartsIn %q, Parts %q", req, mt.Rule.Name, p, got[j].Parts)
				}
			}
		}
	})
}

// TestAppendMatchRulesAllocatesNothing: the admission engine's path.
func TestAppendMatchRulesAllocatesNothing(t *testing.T) {
	m := Compile(mustParse(t, examples.Northstar))
	req := []Entry{{"tenant", "atlas"}, {"user", "U-17"}, {"route", "GET /catalog"}}
	buf := make([]Matched, 0, 8)
	var pbuf [8]string
	if n := testing.AllocsPerRun(100, func() {
		matched, parts := m.AppendMatchRules(buf[:0], pbuf[:0], req)
		for _, mt := range matched {
			_ = mt.PartsIn(parts)
		}
	}); n != 0 {
		t.Errorf("AppendMatchRules and PartsIn: %v allocations per request, want 0", n)
	}
	if n := testing.AllocsPerRun(100, func() { _ = m.AppendMatch(buf[:0], req) }); n == 0 {
		t.Error("AppendMatch allocated nothing: the comparison above no longer shows anything")
	}
}

// manyTenants is Northstar plus n tenant quotas: the shape of a large
// deployment, where the index matters.
func manyTenants(tb testing.TB, n int) *Document {
	d := mustParse(tb, examples.Northstar)
	tmpl := *d.Rule("p-tenant-birch")
	for i := range n {
		r := tmpl
		r.Name = fmt.Sprintf("tenant-%05d", i)
		r.Match = []Match{{Key: "tenant", Value: fmt.Sprintf("t%05d", i), HasValue: true}}
		d.Rules = append(d.Rules, r)
	}
	if err := d.Validate(); err != nil {
		tb.Fatal(err)
	}
	return d
}

func BenchmarkMatch(b *testing.B) {
	req := []Entry{{"ip", "198.51.100.4"}, {"auth", "token"}, {"tenant", "t00042"}, {"user", "U-17"}, {"route", "GET /catalog"}}
	for _, n := range []int{0, 2_000 - 7} { // 2,000 rules: a document within MaxDocumentBytes (1 MiB)
		d := manyTenants(b, n)
		m := Compile(d)
		b.Run(fmt.Sprintf("rules=%d/matcher", len(d.Rules)), func(b *testing.B) {
			b.ReportAllocs()
			var buf []Matched
			for b.Loop() {
				buf = m.AppendMatch(buf[:0], req)
			}
		})
		b.Run(fmt.Sprintf("rules=%d/scan", len(d.Rules)), func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				d.Match(req)
			}
		})
	}
}
