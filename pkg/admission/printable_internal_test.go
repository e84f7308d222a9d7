package admission

import (
	"testing"

	"pgregory.net/rapid"
)

// TestPrintable: the ASCII path agrees with the definition (printableRunes), on chosen
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
		if got, want := printable(s), printableRunes(s); got != want {
			t.Fatalf("printable(%q) = %v, the definition says %v", s, got, want)
		}
	})
}
