package policy

import (
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"

	"pgregory.net/rapid"

	"github.com/allot-dev/allot/examples"
)

func TestInstanceName(t *testing.T) {
	long := strings.Repeat("x", 126)
	tests := []struct {
		name   string
		tmpl   string
		values []string
		want   string
	}{
		{"plain tenant", "p-tenant-standard", []string{"birch"}, "p-tenant-standard/birch"},
		{"two values in match order", "p-route", []string{"atlas", "GET /catalog"}, "p-route/atlas/GET %2Fcatalog"},
		{"escaped bytes", "q", []string{"a%b/c#d{e}"}, "q/a%25b%2Fc%23d%7Be%7D"},
		{"other bytes as is", "q", []string{"ünï:cøde @x"}, "q/ünï:cøde @x"},
		{"too long: hashed", "q", []string{long, "y"}, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := InstanceName(tt.tmpl, tt.values)
			if tt.want == "" {
				if !strings.HasPrefix(got, tt.tmpl+"/#") || len(got) != len(tt.tmpl)+2+instanceHashHex {
					t.Fatalf("InstanceName = %q, want the hashed form", got)
				}
			} else if got != tt.want {
				t.Fatalf("InstanceName = %q, want %q", got, tt.want)
			}
			in, err := ParseInstanceName(got)
			if err != nil {
				t.Fatalf("ParseInstanceName(%q): %v", got, err)
			}
			if in.Template != tt.tmpl || in.Hashed != (tt.want == "") {
				t.Fatalf("ParseInstanceName(%q) = %+v", got, in)
			}
			if !in.Hashed && !reflect.DeepEqual(in.Values, tt.values) {
				t.Fatalf("values %q, want %q", in.Values, tt.values)
			}
		})
	}
}

func TestParseInstanceNameRejects(t *testing.T) {
	tests := []struct{ give, want string }{
		{"p-tenant", `no '/'`},
		{"/birch", `template "" is not a rule name`},
		{"P-Tenant/birch", `template "P-Tenant" is not a rule name`},
		{"q/", "value 1: empty"},
		{"q/a//b", "value 2: empty"},
		{"q/a%2fb", `escape "%2f": want %XX in uppercase hex`},
		{"q/a%41b", `escape "%41": 'A' is written as is`},
		{"q/a%2", "truncated escape"},
		{"q/a{b", "unescaped"},
		{"q/a#b", "unescaped"},
		{"q/#abc", "hashed instance"},
		{"q/#" + strings.Repeat("A", 32), "hashed instance"},
		{"q/" + strings.Repeat("x", MaxInstanceNameBytes), "at most 128"},
	}
	for _, tt := range tests {
		t.Run(tt.give, func(t *testing.T) {
			_, err := ParseInstanceName(tt.give)
			if err == nil || !errors.Is(err, ErrInstanceName) || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("ParseInstanceName(%q) = %v, want an error containing %q", tt.give, err, tt.want)
			}
		})
	}
}

// TestInstanceNameProperty: every name fits, parses back to its template
// and values, and different values never share a name. The other values b
// are derived from a (one value replaced, a boundary between two values
// moved, a value split in two, a value added or dropped), so a name that
// ignored some value, or where its values begin and end, would collide;
// long values make many names hashed, where only the digest can tell.
func TestInstanceNameProperty(t *testing.T) {
	value := rapid.StringOfN(rapid.RuneFrom([]rune{'%', '/', '#', '{', '}', ' ', 'a'}, unicode.L, unicode.P, unicode.S), 1, 80, MaxValueLen)
	escapedOnly := rapid.StringOfN(rapid.RuneFrom([]rune{'%', '/', '#', '{', '}'}), MaxInstanceNameBytes/3+1, 2*MaxInstanceNameBytes/3, -1)
	rapid.Check(t, func(t *rapid.T) {
		tmpl := genName.Draw(t, "template")
		a := rapid.SliceOfN(value, 1, 4).Draw(t, "a")
		if rapid.Bool().Draw(t, "hashed") {
			// A first value of 43 or more escaped bytes (3 bytes each in
			// the name) makes the name hashed whatever the others are.
			a = append([]string{escapedOnly.Draw(t, "long")}, a...)
		}
		b := deriveValues(t, value, a)
		if reflect.DeepEqual(a, b) {
			t.Fatalf("derived %q equals %q", b, a) // a bug in the derivation
		}
		na, nb := InstanceName(tmpl, a), InstanceName(tmpl, b)
		if len(na) > MaxInstanceNameBytes || strings.ContainsAny(na, "{}") {
			t.Fatalf("name %q: over %d bytes or with a brace", na, MaxInstanceNameBytes)
		}
		in, err := ParseInstanceName(na)
		if err != nil {
			t.Fatalf("ParseInstanceName(%q): %v", na, err)
		}
		if in.Template != tmpl || (!in.Hashed && !reflect.DeepEqual(in.Values, a)) {
			t.Fatalf("ParseInstanceName(%q) = %+v, want %s %q", na, in, tmpl, a)
		}
		if na == nb {
			t.Fatalf("%q and %q share the name %q", a, b, na)
		}
	})
}

// deriveValues returns values that differ from a but are made from it.
func deriveValues(t *rapid.T, value *rapid.Generator[string], a []string) []string {
	b := slices.Clone(a)
	switch how := rapid.IntRange(0, 3).Draw(t, "derive"); {
	case how == 1 && len(a) >= 2: // the boundary between two adjacent values moved
		j := rapid.IntRange(0, len(a)-2).Draw(t, "boundary")
		joined, at := []rune(a[j]+a[j+1]), utf8.RuneCountInString(a[j])
		if len(joined) < 3 { // no other cut leaves both non-empty: merge them
			return slices.Concat(a[:j], []string{string(joined)}, a[j+2:])
		}
		cut := rapid.IntRange(1, len(joined)-2).Draw(t, "cut")
		if cut >= at {
			cut++
		}
		b[j], b[j+1] = string(joined[:cut]), string(joined[cut:])
	case how == 2 && utf8.RuneCountInString(a[len(a)-1]) >= 2: // the last value split in two
		r := []rune(a[len(a)-1])
		cut := rapid.IntRange(1, len(r)-1).Draw(t, "split")
		b = append(b[:len(b)-1], string(r[:cut]), string(r[cut:]))
	case how == 3 && len(a) >= 2: // the last value dropped
		b = b[:len(b)-1]
	case how >= 2: // a value added
		b = append(b, value.Draw(t, "added"))
	default: // one value replaced, the others kept
		j := rapid.IntRange(0, len(a)-1).Draw(t, "replaced")
		b[j] = value.Filter(func(v string) bool { return v != a[j] }).Draw(t, "replacement")
	}
	return b
}

func TestTemplateMatchesAndQuota(t *testing.T) {
	d := mustParse(t, examples.Plans)
	m := Compile(d)
	req := []Entry{{"tenant", "atlas"}, {"route", "POST /reports/export"}}
	var got []string
	for _, mt := range m.Match(req) {
		got = append(got, mt.Rule.Name+"="+mt.Instance)
	}
	want := []string{"p-tenant-atlas=", "p-tenant-exports=p-tenant-exports/atlas", "p-tenant-standard=p-tenant-standard/atlas"}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("matches %v, want %v (Atlas is charged to its own pool and to both templates)", got, want)
	}

	q, ok := d.Quota("p-tenant-standard/birch")
	if !ok || q.Name != "p-tenant-standard/birch" || q.Limit != 1000 || len(q.TemplateKeys) != 0 {
		t.Fatalf("Quota(instance) = %+v, %v", q, ok)
	}
	if q, ok := d.Quota("p-tenant-standard"); !ok || !reflect.DeepEqual(q.TemplateKeys, []string{"tenant"}) {
		t.Fatalf("Quota(template) = %+v, %v", q, ok)
	}
	for _, bad := range []string{"p-tenant-atlas/x", "p-tenant-standard/a/b", "nope/x", "nope", "p-tenant-standard/"} {
		if q, ok := d.Quota(bad); ok {
			t.Errorf("Quota(%q) = %+v, want none", bad, q)
		}
	}
	if _, ok := d.Quota(InstanceName("p-tenant-standard", []string{strings.Repeat("z", 200)})); !ok {
		t.Error("a hashed instance of a template is not resolved")
	}
}

func TestTemplateValidates(t *testing.T) {
	d := mustParse(t, examples.Northstar)
	r := d.Rule("p-tenant-birch")
	r.Match = []Match{{Key: "tenant"}}
	if err := d.Validate(); err != nil {
		t.Fatalf("a per-tenant template: %v", err)
	}
	if !r.IsTemplate() || !reflect.DeepEqual(r.TemplateKeys(), []string{"tenant"}) {
		t.Fatalf("IsTemplate %v, TemplateKeys %v", r.IsTemplate(), r.TemplateKeys())
	}
	if g := d.Rule("p-global"); g.IsTemplate() || g.TemplateKeys() != nil {
		t.Fatal("a single pool taken for a template")
	}
	if rd := d.Rule("p-read"); rd.IsTemplate() {
		t.Fatal("a token bucket taken for a template")
	}
}

func ExampleInstanceName() {
	fmt.Println(InstanceName("p-tenant-standard", []string{"birch"}))
	fmt.Println(InstanceName("p-route", []string{"atlas", "GET /catalog"}))
	// Output:
	// p-tenant-standard/birch
	// p-route/atlas/GET %2Fcatalog
}
