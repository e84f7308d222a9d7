package policy

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"

	"github.com/allot-dev/allot/examples"
	"pgregory.net/rapid"
)

func TestCanonicalGolden(t *testing.T) {
	d := mustParse(t, []byte(`
# Formatting, comments, order and defaults do not matter.
rules:
  - kind: token_bucket
    name: read
    match: [{key: route, value: "GET /catalog?a<b&c"}, {key: tenant}, {key: user}]
    scope: user
    refill_per_second: 0.5
    capacity: 20
  - {name: atlas, scope: tenant, match: [{key: tenant, value: atlas}], kind: global_quota,
     limit: 1000, window: 60s, lease: {chunk: 100, ttl: 15000ms, clamp: false}}
regions: [us, eu]
name: mini
`))
	got, err := Canonical(d)
	if err != nil {
		t.Fatal(err)
	}
	want := `{"name":"mini","regions":["eu","us"],"rules":[` +
		`{"name":"atlas","scope":"tenant","match":[{"key":"tenant","value":"atlas"}],"kind":"global_quota","limit":1000,"window":"1m","cost":1,` +
		`"lease":{"chunk":100,"ttl":"15s","clamp":false,"strategy":"demand","fallback_per_region":0,"gateway_chunk":0},"fail_mode":"closed"},` +
		`{"name":"read","scope":"user","match":[{"key":"route","value":"GET /catalog?a<b&c"},{"key":"tenant"},{"key":"user"}],"kind":"token_bucket",` +
		`"cost":1,"capacity":20,"refill_per_second":0.5,"fail_mode":"closed"}]}`
	if string(got) != want {
		t.Errorf("Canonical:\ngot  %s\nwant %s", got, want)
	}
	if !json.Valid(got) {
		t.Error("canonical form is not valid JSON")
	}
}

// TestMaxHeldPerRegion: lease.max_held_per_region is parsed, reaches the
// global quotas (a template's instances included), is written in the
// canonical form only when set (so documents without it keep their bytes
// and digest), and round-trips.
func TestMaxHeldPerRegion(t *testing.T) {
	src := `
name: mini
regions: [eu, us]
rules:
  - {name: atlas, scope: tenant, match: [{key: tenant, value: atlas}], kind: global_quota,
     limit: 1000, window: 1m, lease: {chunk: 100, ttl: 15s, clamp: false, max_held_per_region: 100}}
  - {name: plan, scope: tenant, match: [{key: tenant}], kind: global_quota,
     limit: 500, window: 1m, lease: {chunk: 50, ttl: 15s, max_held_per_region: 200}}
`
	d := mustParse(t, []byte(src))
	if got := d.Rule("atlas").Lease.MaxHeldPerRegion; got != 100 {
		t.Fatalf("Lease.MaxHeldPerRegion = %d, want 100", got)
	}
	qs := d.GlobalQuotas()
	if len(qs) != 2 || qs[0].MaxHeldPerRegion != 100 || qs[1].MaxHeldPerRegion != 200 {
		t.Fatalf("GlobalQuotas = %+v, want caps 100 and 200", qs)
	}
	if q, ok := d.Quota("plan/birch"); !ok || q.MaxHeldPerRegion != 200 {
		t.Fatalf("Quota(plan/birch) = %+v, %v: want the template's cap 200", q, ok)
	}
	c, err := Canonical(d)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		`"lease":{"chunk":100,"ttl":"15s","clamp":false,"strategy":"demand","fallback_per_region":0,"max_held_per_region":100,"gateway_chunk":0}`,
		`"lease":{"chunk":50,"ttl":"15s","clamp":true,"strategy":"demand","fallback_per_region":0,"max_held_per_region":200,"gateway_chunk":0}`,
	} {
		if !strings.Contains(string(c), want) {
			t.Errorf("canonical form lacks %s:\n%s", want, c)
		}
	}
	back := mustParse(t, c)
	if !reflect.DeepEqual(back, d) {
		t.Fatalf("Parse(Canonical(d)) != d\n%+v\n%+v", back, d)
	}
	// Without a cap the field is not written at all: the canonical bytes,
	// and so the digest, of a document older than the field are unchanged.
	none := d.Clone()
	none.Rule("atlas").Lease.MaxHeldPerRegion = 0
	none.Rule("plan").Lease.MaxHeldPerRegion = 0
	c0, err := Canonical(none)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(c0), "max_held_per_region") {
		t.Errorf("an uncapped lease writes the field:\n%s", c0)
	}
	if Digest(none) == Digest(d) {
		t.Error("the digest ignores the cap")
	}
}

func TestCanonicalNorthstarRoundTrip(t *testing.T) {
	d := mustParse(t, examples.Northstar)
	c1, err := Canonical(d)
	if err != nil {
		t.Fatal(err)
	}
	d2 := mustParse(t, c1)
	if !reflect.DeepEqual(d, d2) {
		t.Fatalf("Parse(Canonical(d)) != d\n%+v\n%+v", d, d2)
	}
	c2, _ := Canonical(d2)
	if !bytes.Equal(c1, c2) {
		t.Errorf("canonical form is not a fixed point:\n%s\n%s", c1, c2)
	}
	// Reordering rules and regions does not change the digest.
	r := d.Clone()
	slices.Reverse(r.Rules)
	slices.Reverse(r.Regions)
	if Digest(r) != Digest(d) {
		t.Error("digest depends on rule order")
	}
	// Any change does.
	r.Rule("p-tenant-atlas").Limit++
	if Digest(r) == Digest(d) {
		t.Error("digest ignores a changed limit")
	}
	if len(Digest(d)) != 64 {
		t.Errorf("Digest = %q, want 64 hex digits", Digest(d))
	}
}

func TestCanonicalDoesNotModify(t *testing.T) {
	d := mustParse(t, examples.Northstar)
	slices.Reverse(d.Rules)
	before := d.Clone()
	if _, err := Canonical(d); err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(d, before) {
		t.Error("Canonical reordered its argument")
	}
}

// TestCanonicalRoundTripProperty: for every valid document d, Parse of its
// canonical form gives d back, and canonical encoding is a fixed point.
func TestCanonicalRoundTripProperty(t *testing.T) {
	rapid.Check(t, func(t *rapid.T) {
		d := genDocument(wideOpts()).Draw(t, "doc")
		if err := d.Validate(); err != nil {
			t.Fatalf("generator made an invalid document: %v", err)
		}
		c, err := Canonical(d)
		if err != nil {
			t.Fatal(err)
		}
		back, err := Parse(c)
		if err != nil {
			t.Fatalf("Parse(Canonical(d)): %v\n%s", err, c)
		}
		if !reflect.DeepEqual(back, d) {
			t.Fatalf("Parse(Canonical(d)) != d\ngot  %+v\nwant %+v\n%s", back, d, c)
		}
		c2, _ := Canonical(back)
		if !bytes.Equal(c, c2) {
			t.Fatalf("not a fixed point:\n%s\n%s", c, c2)
		}
		// The digest ignores source order.
		shuffled := d.Clone()
		shuffled.Rules = rapid.Permutation(shuffled.Rules).Draw(t, "order")
		if Digest(shuffled) != Digest(d) {
			t.Fatal("digest depends on rule order")
		}
	})
}

// TestCanonicalRoundTripText: whatever text Validate accepts in a
// description survives the canonical round trip. The canonical form writes
// non-ASCII as is, so a character the YAML reader refuses (U+FFFE, U+FFFF)
// would make a committed policy unreadable by every agent. Every code point
// of the Basic Multilingual Plane is tried, and the edges and non-characters
// of the other planes, in descriptions of a few hundred code points each.
func TestCanonicalRoundTripText(t *testing.T) {
	base := mustParse(t, []byte("name: t\nrules:\n  - {name: r, scope: ip, match: [{key: ip}], kind: fixed_window, limit: 1, window: 1s}\n"))
	roundTrip := func(text string) error {
		d := base.Clone()
		d.Description = text
		c, err := Canonical(d)
		if err != nil {
			return err
		}
		back, err := Parse(c)
		if err != nil {
			return err
		}
		if back.Description != text {
			return fmt.Errorf("description %q came back as %q", text, back.Description)
		}
		return nil
	}
	var runes []rune
	for r := rune(0); r < 0x10000; r++ {
		runes = append(runes, r)
	}
	for plane := rune(1); plane <= 16; plane++ {
		runes = append(runes, plane<<16, plane<<16|0xFFFD, plane<<16|0xFFFE, plane<<16|0xFFFF)
	}
	var batch []rune
	flush := func() {
		if err := roundTrip(string(batch)); err != nil {
			for _, r := range batch { // name the culprit
				if err := roundTrip("a" + string(r) + "b"); err != nil {
					t.Errorf("%U: Validate accepts it, but the canonical round trip fails: %v", r, err)
				}
			}
		}
		batch = batch[:0]
	}
	accepted := 0
	for _, r := range runes {
		if !utf8.ValidRune(r) {
			continue // surrogates cannot occur in valid UTF-8
		}
		var c collector
		if checkText(&c, "description", "a"+string(r)+"b"); len(c.errs) > 0 {
			continue
		}
		accepted++
		batch = append(batch, r)
		if len(string(batch)) > MaxDescriptionLen-8 {
			flush()
		}
	}
	flush()
	if accepted < 60000 {
		t.Errorf("only %d code points accepted in a description", accepted)
	}
}

// TestParseRejectsNonCharacter: a document whose description escapes
// U+FFFE parses as YAML, but Parse refuses it, naming the field.
func TestParseRejectsNonCharacter(t *testing.T) {
	for _, esc := range []string{`\uFFFE`, `\uFFFF`} {
		_, err := Parse([]byte("name: t\ndescription: \"a" + esc + "b\"\nrules:\n  - {name: r, scope: ip, match: [{key: ip}], kind: fixed_window, limit: 1, window: 1s}\n"))
		var fe *FieldError
		if !errors.As(err, &fe) || fe.Path != "description" || !strings.Contains(fe.Msg, "non-character") {
			t.Errorf("%s: Parse error %v; want description: contains non-character", esc, err)
		}
	}
}
