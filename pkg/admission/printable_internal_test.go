package admission

import (
	"testing"
	"unicode"
	"unicode/utf8"

	"pgregory.net/rapid"
)

// printableSlow is printable without its ASCII path: the definition.
func printableSlow(s string) bool {
	if !utf8.ValidString(s) {
		return false
	}
	for _, r := range s {
		if !unicode.IsPrint(r) && r != ' ' {
			return false
		}
	}
	return true
}

// TestPrintable: the ASCII path agrees with the definition, on chosen
// strings and on random bytes.
func TestPrintable(t *testing.T) {
	for s, want := range map[string]bool{
		"": true, "GET /catalog": true, "tenant-7 ~!": true, "atlas\x7f": false, "a\tb": false,
		"\x00": false, "Zürich": true, "\xff": false, "a\u200bb": false, "東京": true,
	} {
		if got := printable(s); got != want {
			t.Errorf("printable(%q) = %v, want %v", s, got, want)
		}
	}
	rapid.Check(t, func(t *rapid.T) {
		s := string(rapid.SliceOf(rapid.Byte()).Draw(t, "bytes"))
		if got, want := printable(s), printableSlow(s); got != want {
			t.Fatalf("printable(%q) = %v, the definition says %v", s, got, want)
		}
	})
}
