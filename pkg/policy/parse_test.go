package policy

import (
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/allot-dev/allot/examples"
)

func mustParse(t testing.TB, data []byte) *Document {
	t.Helper()
	d, err := Parse(data)
	if err != nil {
		t.Fatalf("Parse: %v", err)
	}
	return d
}

func TestParseNorthstar(t *testing.T) {
	d := mustParse(t, examples.Northstar)
	if d.Name != "northstar" {
		t.Errorf("Name = %q", d.Name)
	}
	if want := []string{"eu", "us"}; !reflect.DeepEqual(d.Regions, want) {
		t.Errorf("Regions = %v, want %v", d.Regions, want)
	}
	var names []string
	for _, r := range d.Rules {
		names = append(names, r.Name)
	}
	wantNames := []string{"p-anon", "p-export", "p-export-concurrency", "p-global", "p-read", "p-tenant-atlas", "p-tenant-birch"}
	if !reflect.DeepEqual(names, wantNames) {
		t.Errorf("rules = %v, want %v (sorted by name)", names, wantNames)
	}

	tests := []struct {
		name string
		want Rule
	}{
		{"p-anon", Rule{Scope: ScopeIP, Kind: KindFixedWindow, Limit: 20, Window: 10 * time.Second, Cost: 1, FailMode: FailFallback,
			Match: []Match{{Key: "auth", Value: "anonymous", HasValue: true}, {Key: "ip"}}}},
		{"p-read", Rule{Scope: ScopeUser, Kind: KindTokenBucket, Capacity: 20, RefillMilliPerSecond: 2000, Cost: 1, FailMode: FailFallback,
			Match: []Match{{Key: "route", Value: "GET /catalog", HasValue: true}, {Key: "tenant"}, {Key: "user"}}}},
		{"p-export", Rule{Scope: ScopeTenant, Kind: KindTokenBucket, Capacity: 20, RefillMilliPerSecond: 2000, Cost: 10, FailMode: FailClosed,
			Match: []Match{{Key: "route", Value: "POST /reports/export", HasValue: true}, {Key: "tenant"}}}},
		{"p-export-concurrency", Rule{Scope: ScopeTenant, Kind: KindConcurrency, MaxInFlight: 3, SlotTTL: 10 * time.Minute, FailMode: FailClosed,
			Match: []Match{{Key: "route", Value: "POST /reports/export", HasValue: true}, {Key: "tenant"}}}},
		{"p-tenant-atlas", Rule{Scope: ScopeTenant, Kind: KindGlobalQuota, Limit: 1000, Window: time.Minute, Cost: 1, FailMode: FailClosed,
			Match: []Match{{Key: "tenant", Value: "atlas", HasValue: true}},
			Lease: &Lease{Chunk: 100, TTL: 15 * time.Second, Clamp: true, Strategy: StrategyDemand}}},
		{"p-global", Rule{Scope: ScopeGlobal, Kind: KindGlobalQuota, Limit: 40000, Window: time.Second, Cost: 1, FailMode: FailFallback,
			Match: []Match{{Key: "route", Value: "GET /catalog", HasValue: true}},
			Lease: &Lease{Chunk: 4000, TTL: time.Second, Clamp: true, Strategy: StrategyDemand, FallbackPerRegion: 2000, GatewayChunk: 100}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := d.Rule(tt.name)
			if got == nil {
				t.Fatal("missing")
			}
			g := *got
			g.Name, g.Description = "", ""
			if !reflect.DeepEqual(g, tt.want) {
				t.Errorf("got  %+v\nwant %+v", g, tt.want)
			}
		})
	}
}

func TestNorthstarGlobalQuotas(t *testing.T) {
	d := mustParse(t, examples.Northstar)
	regions := []string{"eu", "us"}
	want := []GlobalQuota{
		{Name: "p-global", Scope: ScopeGlobal, Match: []Match{{Key: "route", Value: "GET /catalog", HasValue: true}},
			Limit: 40000, Window: time.Second, Chunk: 4000, TTL: time.Second, Clamp: true, Strategy: StrategyDemand,
			FallbackPerRegion: 2000, GatewayChunk: 100, FailMode: FailFallback, Regions: regions},
		{Name: "p-tenant-atlas", Scope: ScopeTenant, Match: []Match{{Key: "tenant", Value: "atlas", HasValue: true}},
			Limit: 1000, Window: time.Minute, Chunk: 100, TTL: 15 * time.Second, Clamp: true, Strategy: StrategyDemand,
			FailMode: FailClosed, Regions: regions},
		{Name: "p-tenant-birch", Scope: ScopeTenant, Match: []Match{{Key: "tenant", Value: "birch", HasValue: true}},
			Limit: 20000, Window: time.Minute, Chunk: 1000, TTL: 15 * time.Second, Clamp: true, Strategy: StrategyDemand,
			FailMode: FailClosed, Regions: regions},
	}
	got := d.GlobalQuotas()
	if !reflect.DeepEqual(got, want) {
		t.Errorf("GlobalQuotas:\ngot  %+v\nwant %+v", got, want)
	}
	// Birch at 300 req/s for a minute fits its plan.
	if birch := got[2]; 300*60 > birch.Limit {
		t.Errorf("Birch plan %d/min cannot carry 300 req/s", birch.Limit)
	}
	// The result is a copy.
	got[0].Regions[0] = "xx"
	if d.Regions[0] != "eu" {
		t.Error("GlobalQuotas shares Regions with the document")
	}
}

func TestParseDefaultsAndNormalization(t *testing.T) {
	d := mustParse(t, []byte(`
name: mini
regions: [us, eu]
rules:
  - name: z-quota
    scope: tenant
    match: [{key: tenant, value: atlas}]
    kind: global_quota
    limit: 1_000
    window: 1m
    lease: {chunk: 100, ttl: 15s}
  - name: a-window
    scope: ip
    match: [{key: ip}]
    kind: fixed_window
    limit: 20
    window: 10s
  - name: m-slots
    scope: tenant
    match: [{key: tenant}]
    kind: concurrency
    max_in_flight: 3
    slot_ttl: 2m
  - name: b-bucket
    scope: user
    match: [{key: tenant}, {key: user}]
    kind: token_bucket
    capacity: 5
    refill_per_second: 0.25
`))
	want := &Document{
		Name:    "mini",
		Regions: []string{"eu", "us"},
		Rules: []Rule{
			{Name: "a-window", Scope: ScopeIP, Match: []Match{{Key: "ip"}}, Kind: KindFixedWindow, Limit: 20, Window: 10 * time.Second, Cost: 1, FailMode: FailClosed},
			{Name: "b-bucket", Scope: ScopeUser, Match: []Match{{Key: "tenant"}, {Key: "user"}}, Kind: KindTokenBucket, Capacity: 5, RefillMilliPerSecond: 250, Cost: 1, FailMode: FailClosed},
			{Name: "m-slots", Scope: ScopeTenant, Match: []Match{{Key: "tenant"}}, Kind: KindConcurrency, MaxInFlight: 3, SlotTTL: 2 * time.Minute, FailMode: FailClosed},
			{Name: "z-quota", Scope: ScopeTenant, Match: []Match{{Key: "tenant", Value: "atlas", HasValue: true}}, Kind: KindGlobalQuota, Limit: 1000, Window: time.Minute, Cost: 1, FailMode: FailClosed,
				Lease: &Lease{Chunk: 100, TTL: 15 * time.Second, Clamp: true, Strategy: StrategyDemand}},
		},
	}
	if !reflect.DeepEqual(d, want) {
		t.Errorf("got  %+v\nwant %+v", d, want)
	}
}

func TestParseJSON(t *testing.T) {
	d := mustParse(t, []byte(`{"name": "j", "rules": [{"name": "r", "scope": "ip", "match": [{"key": "ip"}],
		"kind": "sliding_window", "limit": 10, "window": "1s", "fail_mode": "open"}]}`))
	if r := d.Rules[0]; r.Kind != KindSlidingWindow || r.FailMode != FailOpen || r.Limit != 10 {
		t.Errorf("got %+v", r)
	}
}

// rule wraps one rule's YAML body into a document.
func rule(body string) string {
	return "name: t\nregions: [eu, us]\nrules:\n  - name: r\n" + indent(body, "    ")
}

func indent(s, pre string) string {
	lines := strings.Split(strings.Trim(s, "\n"), "\n")
	for i, l := range lines {
		lines[i] = pre + strings.TrimLeft(l, "\t")
	}
	return strings.Join(lines, "\n") + "\n"
}

const bucket = `
scope: ip
match: [{key: ip}]
kind: token_bucket
capacity: 20
`

func TestParseRejects(t *testing.T) {
	tests := []struct {
		name string
		give string
		want []string // substrings of the error
	}{
		{"empty", "", []string{"empty document"}},
		{"comment only", "# nothing\n", []string{"empty document"}},
		{"syntax", "name: [unclosed\n", []string{"yaml:"}},
		{"not a mapping", "- a\n- b\n", []string{"expected a mapping, got a sequence"}},
		{"two documents", "name: a\n---\nname: b\n", []string{"more than one YAML document"}},
		{"unknown top-level field", "name: t\nversion: 3\nrules: []\n", []string{"version: unknown field"}},
		{"unknown rule field with suggestion", rule(bucket + "refill_per_second: 2\ncapacty: 3\n"),
			[]string{`rules[0].capacty: unknown field; did you mean "capacity"?`}},
		{"unknown lease field", rule(`
			scope: tenant
			match: [{key: tenant, value: atlas}]
			kind: global_quota
			limit: 10
			window: 1m
			lease: {chunk: 1, ttl: 1s, clamped: true}`), []string{`rules[0].lease.clamped: unknown field; did you mean "clamp"?`}},
		{"max held not an integer", rule(`
			scope: tenant
			match: [{key: tenant, value: atlas}]
			kind: global_quota
			limit: 10
			window: 1m
			lease: {chunk: 1, ttl: 1s, max_held_per_region: lots}`), []string{`rules[0].lease.max_held_per_region: expected an integer, got string "lots"`}},
		{"max held under chunk, with line", "name: t\nregions: [eu]\nrules:\n  - name: r\n    scope: tenant\n    match: [{key: tenant, value: atlas}]\n" +
			"    kind: global_quota\n    limit: 10\n    window: 1m\n    lease:\n      chunk: 5\n      ttl: 1s\n      max_held_per_region: 4\n",
			[]string{"rules[0].lease.max_held_per_region: 4 is less than chunk 5: a region at the cap could never be granted a full chunk (line 13)"}},
		{"unknown match field", rule("scope: ip\nmatch: [{key: ip, val: x}]\nkind: fixed_window\nlimit: 1\nwindow: 1s\n"),
			[]string{`rules[0].match[0].val: unknown field; did you mean "value"?`}},
		{"match key missing", rule("scope: ip\nmatch: [{value: x}]\nkind: fixed_window\nlimit: 1\nwindow: 1s\n"),
			[]string{"rules[0].match[0].key: required"}},
		{"duplicate key", "name: t\nname: u\n", []string{"name: duplicate key"}},
		{"merge key", "base: &b {name: t}\n<<: *b\n", []string{"merge keys are not supported"}},
		{"quoted integer", rule(bucket + `refill_per_second: 2` + "\ncost: \"3\"\n"), []string{`rules[0].cost: expected an integer, got string "3"`}},
		{"fractional integer", rule(bucket + "refill_per_second: 2\ncost: 1.5\n"), []string{"rules[0].cost: expected an integer, got float 1.5"}},
		{"hex integer", rule(bucket + "refill_per_second: 2\ncost: 0x10\n"), []string{`rules[0].cost: "0x10" is not a decimal integer`}},
		{"integer overflow", rule(bucket + "refill_per_second: 2\ncost: 99999999999999999999\n"), []string{"rules[0].cost:"}},
		{"duration without unit", rule("scope: ip\nmatch: [{key: ip}]\nkind: fixed_window\nlimit: 1\nwindow: 10\n"),
			[]string{"rules[0].window: expected a duration with a unit"}},
		{"bad duration", rule("scope: ip\nmatch: [{key: ip}]\nkind: fixed_window\nlimit: 1\nwindow: 10 seconds\n"),
			[]string{`rules[0].window: "10 seconds" is not a duration`}},
		{"null value", rule("scope: ip\nmatch: [{key: ip, value: null}]\nkind: fixed_window\nlimit: 1\nwindow: 1s\n"),
			[]string{"rules[0].match[0].value: expected a string, got null"}},
		{"empty value field", "name:\nrules: []\n", []string{"name: expected a string, got null"}},
		{"bool as string", rule(bucket + "refill_per_second: 2\nshadow: yes\n"), []string{"rules[0].shadow: expected true or false"}},
		{"custom tag", "name: !secret t\n", []string{"name: expected a string, got tagged value !secret"}},
		{"refill too precise", rule(bucket + "refill_per_second: 0.0001\n"), []string{"rules[0].refill_per_second:", "at most 3 digits"}},
		{"refill negative", rule(bucket + "refill_per_second: -1\n"), []string{"rules[0].refill_per_second:", "non-negative decimal"}},
		{"refill exponent", rule(bucket + "refill_per_second: 1e3\n"), []string{"rules[0].refill_per_second:"}},
		{"regions not a list", "name: t\nregions: eu\nrules: []\n", []string{"regions: expected a sequence, got string"}},
		{"rule not a mapping", "name: t\nrules: [p-anon]\n", []string{"rules[0]: expected a mapping"}},
		{"size", "name: t\ndescription: \"" + strings.Repeat("x", MaxDocumentBytes) + "\"\n", []string{"the limit is 1048576"}},
		{"too many rules", "name: t\nrules:\n" + strings.Repeat("  - {}\n", MaxRules+1), []string{"rules: 10001 rules; the limit is 10000"}},
		{"deep nesting", "name: " + strings.Repeat("[", 100_000), []string{"yaml:"}},
		{"deep mapping nesting", strings.Repeat("a: {", 50_000), []string{"yaml:"}},
		{"alias bomb", aliasBomb(), []string{"rules[0]: expected a mapping, got a sequence"}},
		// Validation errors found after decoding carry the source line.
		{"validation with line", "name: t\nrules:\n  - name: r\n    scope: ip\n    match: [{key: ip}]\n    kind: fixed_window\n    limit: 5\n    window: 1s\n    cost: 6\n",
			[]string{"rules[0].cost: 6 exceeds limit 5 (line 9)"}},
		{"reference example", `
name: t
rules:
  - {name: a, scope: ip, match: [{key: ip}], kind: fixed_window, limit: 20, window: 10s}
  - {name: b, scope: ip, match: [{key: ip}], kind: fixed_window, limit: 20, window: 10s}
  - name: c
    scope: user
    match: [{key: tenant}, {key: user}]
    kind: token_bucket
    capacity: 20
    refill_per_second: 2
    cost: 30
`, []string{"rules[2].cost: 30 exceeds capacity 20"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Parse([]byte(tt.give))
			if err == nil {
				t.Fatal("Parse succeeded")
			}
			if !errors.Is(err, ErrInvalid) {
				t.Errorf("error does not wrap ErrInvalid: %v", err)
			}
			var fe *FieldError
			if !errors.As(err, &fe) {
				t.Errorf("error has no *FieldError: %v", err)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q\ndoes not contain %q", err, w)
				}
			}
		})
	}
}

// aliasBomb is a "billion laughs" document: ten levels of ten aliases. The
// walker only descends where the schema expects structure, so it stops at the
// first level.
func aliasBomb() string {
	var b strings.Builder
	b.WriteString("a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n")
	for i := 1; i < 10; i++ {
		fmt.Fprintf(&b, "a%d: &a%d [", i, i)
		for j := 0; j < 10; j++ {
			if j > 0 {
				b.WriteString(", ")
			}
			fmt.Fprintf(&b, "*a%d", i-1)
		}
		b.WriteString("]\n")
	}
	b.WriteString("name: t\nrules: *a9\n")
	return b.String()
}

func TestParseErrorsListEveryProblem(t *testing.T) {
	_, err := Parse([]byte(`
name: BAD NAME
rules:
  - name: r1
    scope: planet
    match: []
    kind: leaky
    fail_mode: maybe
`))
	var es Errors
	if !errors.As(err, &es) {
		t.Fatalf("want Errors, got %T %v", err, err)
	}
	for _, w := range []string{"name:", "rules[0].scope: unknown scope", "rules[0].kind: unknown kind", "rules[0].fail_mode: unknown fail mode", "rules[0].match: at least one entry"} {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("%q missing from %v", w, err)
		}
	}
}

func TestParseAliasesAllowed(t *testing.T) {
	d := mustParse(t, []byte(`
name: t
regions: [eu, us]
rules:
  - name: a
    scope: tenant
    match: [{key: tenant, value: atlas}]
    kind: global_quota
    limit: 1000
    window: 1m
    lease: &std {chunk: 100, ttl: 15s}
  - name: b
    scope: tenant
    match: [{key: tenant, value: birch}]
    kind: global_quota
    limit: 1000
    window: 1m
    lease: *std
`))
	if d.Rules[1].Lease == d.Rules[0].Lease || !reflect.DeepEqual(d.Rules[1].Lease, d.Rules[0].Lease) {
		t.Errorf("aliased leases: %+v %+v", d.Rules[0].Lease, d.Rules[1].Lease)
	}
}

func TestMilli(t *testing.T) {
	tests := []struct {
		give    string
		want    int64
		wantErr bool
	}{
		{"2", 2000, false}, {"0.5", 500, false}, {"0.001", 1, false}, {"1_000.25", 1000250, false}, {"0", 0, false},
		{"0.0001", 0, true}, {"-1", 0, true}, {".5", 0, true}, {"5.", 0, true}, {"1e3", 0, true}, {"", 0, true},
		{"1000000000001", 0, true},
	}
	for _, tt := range tests {
		got, err := parseMilli(tt.give)
		if (err != nil) != tt.wantErr || got != tt.want {
			t.Errorf("parseMilli(%q) = %d, %v; want %d, err %v", tt.give, got, err, tt.want, tt.wantErr)
		}
		if err == nil {
			if back, _ := parseMilli(formatMilli(got)); back != got {
				t.Errorf("formatMilli(%d) = %q does not round-trip", got, formatMilli(got))
			}
		}
	}
}

// TestErrorsQuoteBoundedInput: an error quotes a scalar of the document,
// or names an unknown field, by a bounded prefix cut at a rune boundary
// (the allocator answers PublishPolicy with these errors, and a 1 MiB
// name made a 1 MiB answer).
func TestErrorsQuoteBoundedInput(t *testing.T) {
	big := "a" + strings.Repeat("é", 200_000) // a cut at an even byte splits a rune
	quota := func(lease string) string {
		return rule("scope: tenant\nmatch: [{key: tenant, value: v}]\nkind: global_quota\nlimit: 10\nwindow: 1m\nlease: " + lease + "\n")
	}
	tests := []struct {
		name, give, path string
	}{
		{"name", "name: " + big + "\nregions: [eu]\nrules: []\n", "name"},
		{"unknown field", rule(bucket + "refill_per_second: 2\n? " + big + "\n: 1\n"), "rules[0]." + truncate(big)},
		{"region", "name: t\nregions: [" + big + "]\n" + strings.TrimPrefix(rule(bucket+"refill_per_second: 2\n"), "name: t\nregions: [eu, us]\n"), "regions[0]"},
		{"rule name", strings.Replace(rule(bucket+"refill_per_second: 2\n"), "name: r", "name: "+big, 1), "rules[0].name"},
		{"scope", rule("scope: " + big + "\nmatch: [{key: ip}]\nkind: token_bucket\ncapacity: 20\nrefill_per_second: 2\n"), "rules[0].scope"},
		{"kind", rule("scope: ip\nmatch: [{key: ip}]\nkind: " + big + "\ncapacity: 20\nrefill_per_second: 2\n"), "rules[0].kind"},
		{"fail mode", rule(bucket + "refill_per_second: 2\nfail_mode: " + big + "\n"), "rules[0].fail_mode"},
		{"match key", rule("scope: ip\nmatch: [{key: ip}, {key: " + big + "}]\nkind: token_bucket\ncapacity: 20\nrefill_per_second: 2\n"), "rules[0].match[1].key"},
		{"duration", quota("{chunk: 1, ttl: " + big + "}"), "rules[0].lease.ttl"},
		{"strategy", quota("{chunk: 1, ttl: 1s, strategy: " + big + "}"), "rules[0].lease.strategy"},
		{"decimal", rule(bucket + "refill_per_second: 0." + strings.Repeat("0", 400_000) + "1\n"), "rules[0].refill_per_second"},
		{"integer", rule(bucket + "refill_per_second: 2\ncost: 0o" + strings.Repeat("0", 400_000) + "17\n"), "rules[0].cost"},
		{"string for an integer", rule(bucket + "refill_per_second: 2\ncost: " + big + "\n"), "rules[0].cost"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if len(tt.give) > MaxDocumentBytes {
				t.Fatalf("a document of %d bytes", len(tt.give))
			}
			_, err := Parse([]byte(tt.give))
			if err == nil {
				t.Fatal("Parse accepted the document")
			}
			msg := err.Error()
			if len(msg) > 1024 || !utf8.ValidString(msg) {
				t.Fatalf("a message of %d bytes (valid UTF-8: %v): %.300q", len(msg), utf8.ValidString(msg), msg)
			}
			if !strings.Contains(msg, tt.path+": ") || !strings.Contains(msg, "...") {
				t.Errorf("%q does not name %s with a shortened value", msg, tt.path)
			}
		})
	}
}

// TestParseUnknownFieldWithOtherProblems: an unknown field is listed with
// the document's other problems, in document order with their lines, not
// instead of them. What validation would say of the field it misspells
// (absent: refill_per_second 0) is left to its "did you mean".
func TestParseUnknownFieldWithOtherProblems(t *testing.T) {
	const doc = `name: t
regions: [eu]
rules:
  - name: read
    scope: user
    match: [{key: tenant}, {key: user}]
    kind: token_bucket
    capacity: 20
    refil_per_second: 2
  - name: anon
    scope: ip
    match: [{key: ip}]
    kind: fixed_windw
    limit: 20
    window: 10s
  - name: tenant
    scope: tenant
    match: [{key: tenant, value: atlas}]
    kind: global_quota
    limit: 1000
    window: 1m
    lease: {chunk: 100, ttl: 2m}
`
	_, err := Parse([]byte(doc))
	var es Errors
	if !errors.As(err, &es) {
		t.Fatalf("want Errors, got %T %v", err, err)
	}
	want := []string{
		`rules[0].refil_per_second: unknown field; did you mean "refill_per_second"? (line 9)`,
		`rules[1].kind: unknown kind "fixed_windw"; want one of fixed_window, sliding_window, token_bucket, concurrency, global_quota (line 13)`,
		"rules[2].lease.ttl: 2m exceeds window 1m (line 22)",
	}
	if len(es) != len(want) {
		t.Errorf("%d problems, want %d: %v", len(es), len(want), err)
	}
	for i, w := range want {
		if i < len(es) && es[i].Error() != w {
			t.Errorf("problem %d: %q, want %q", i, es[i], w)
		}
	}
	// Without the misspelt field, its absence is a problem of its own.
	_, err = Parse([]byte(strings.Replace(doc, "    refil_per_second: 2\n", "", 1)))
	if !errors.As(err, &es) || len(es) != 3 || !strings.HasPrefix(es[0].Error(), "rules[0].refill_per_second: 0 never refills") {
		t.Errorf("without the unknown field: %v, want refill_per_second's and the 2 other problems", err)
	}
}

// TestParseUnknownFieldsCapped: unknown fields count towards the cap of
// reported problems, validation's problems after them.
func TestParseUnknownFieldsCapped(t *testing.T) {
	var b strings.Builder
	b.WriteString("name: t\nregions: [eu]\nrules:\n")
	for i := range maxReportedErrors {
		fmt.Fprintf(&b, "  - {name: r%d, scope: ip, match: [{key: ip}], kind: fixed_window, limit: 5, window: 1s, cost: 6, colour: red}\n", i)
	}
	_, err := Parse([]byte(b.String()))
	var es Errors
	if !errors.As(err, &es) {
		t.Fatalf("want Errors, got %T %v", err, err)
	}
	if len(es) != maxReportedErrors+1 || es[len(es)-1].Msg != "further problems not listed" {
		t.Errorf("%d problems, last %v: want %d and the truncation note", len(es), es[len(es)-1], maxReportedErrors)
	}
	_, err = Parse([]byte("name: t\nregions: [eu]\nrules:\n  - {name: r, scope: ip, match: [{key: ip}], kind: fixed_window, limit: 5, window: 1s, cost: 6, colour: red}\n"))
	if !errors.As(err, &es) || len(es) != 2 || !strings.Contains(es[0].Error(), "colour: unknown field (line 4)") || !strings.Contains(es[1].Error(), "cost: 6 exceeds limit 5 (line 4)") {
		t.Errorf("one rule, unknown field and cost: %v", err)
	}
}
