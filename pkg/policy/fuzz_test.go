package policy

import (
	"bytes"
	"errors"
	"reflect"
	"testing"

	"github.com/allot-dev/allot/examples"
)

// FuzzParse: Parse never panics, fails only with ErrInvalid, and whatever it
// accepts survives the canonical round trip.
func FuzzParse(f *testing.F) {
	f.Add(examples.Northstar)
	f.Add([]byte(`{"name":"j","rules":[{"name":"r","scope":"ip","match":[{"key":"ip"}],"kind":"fixed_window","limit":1,"window":"1s"}]}`))
	f.Add([]byte("name: t\nrules:\n  - {name: r, scope: user, match: [{key: tenant}, {key: user}], kind: token_bucket, capacity: 2, refill_per_second: 0.001}\n"))
	f.Add([]byte("a: &a [x]\nb: *a\n<<: *a\n"))
	f.Add([]byte("name: !!binary aGVsbG8=\n"))
	f.Add([]byte("---\n...\n---\n"))
	f.Add([]byte(""))
	// Non-characters the YAML reader refuses once the canonical form writes
	// them raw.
	f.Add([]byte("name: t\ndescription: \"a\\uFFFEb\"\nrules:\n  - {name: r, scope: ip, match: [{key: ip}], kind: fixed_window, limit: 1, window: 1s}\n"))
	f.Add([]byte(`{"name":"t","rules":[{"name":"r","description":"\uffff","scope":"ip","match":[{"key":"ip"}],"kind":"fixed_window","limit":1,"window":"1s"}]}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		d, err := Parse(data)
		if err != nil {
			if !errors.Is(err, ErrInvalid) {
				t.Fatalf("error does not wrap ErrInvalid: %v", err)
			}
			return
		}
		c, err := Canonical(d)
		if err != nil {
			t.Fatalf("Canonical of a parsed document: %v", err)
		}
		back, err := Parse(c)
		if err != nil {
			t.Fatalf("Parse(Canonical(d)): %v\n%s", err, c)
		}
		if !reflect.DeepEqual(back, d) {
			t.Fatalf("round trip changed the document:\n%+v\n%+v", d, back)
		}
		if c2, _ := Canonical(back); !bytes.Equal(c, c2) {
			t.Fatalf("canonical form is not a fixed point")
		}
		Compile(d).Match([]Entry{{"tenant", "atlas"}, {"ip", "1"}, {"user", "u"}, {"route", "GET /catalog"}})
		d.GlobalQuotas()
		Diff(d, back)
	})
}
