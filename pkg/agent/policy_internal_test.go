package agent

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/allot-dev/allot/pkg/policy"
)

// lkgPolicy is a policy whose canonical JSON holds description, which the
// tests below fill with characters encoding/json escapes by default.
const lkgPolicy = `
name: lkg
description: DESCRIPTION
rules:
  - name: r
    scope: tenant
    match: [{key: tenant}]
    kind: fixed_window
    limit: 10
    window: 1m
`

// lkgRecord is the checked record of lkgPolicy with description, as the
// allocator publishes it (canonical JSON).
func lkgRecord(t *testing.T, version uint64, description string) *record {
	t.Helper()
	doc, err := policy.Parse([]byte(strings.ReplaceAll(lkgPolicy, "DESCRIPTION", `"`+description+`"`)))
	if err != nil {
		t.Fatal(err)
	}
	b, err := policy.Canonical(doc)
	if err != nil {
		t.Fatal(err)
	}
	rec, err := checkRecord(version, policy.Digest(doc), b)
	if err != nil {
		t.Fatalf("checkRecord: %v", err)
	}
	return rec
}

// TestLastKnownGoodRoundTrip: the policy saved is the policy loaded, byte
// for byte, whatever its document holds: a description with <, > and &
// (which encoding/json escapes) used to be saved re-escaped, failing its
// own digest on reload, so a restarted agent cut off from the allocator had
// no policy. Files in the earlier form (the document's JSON itself) still
// load, those the escaping damaged included.
func TestLastKnownGoodRoundTrip(t *testing.T) {
	const html = "reads < 100/s & writes > 10/s"
	// earlier is a file as builds before base64 documents wrote it.
	earlier := func(t *testing.T, rec *record) []byte {
		t.Helper()
		b, err := json.Marshal(lkg{Version: rec.version, Digest: rec.digest, Document: rec.raw, SavedMs: 1})
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	tests := []struct {
		name        string
		description string
		write       func(t *testing.T, dir string, rec *record) // nil: saveLKG
	}{
		{"saved, plain", "reads under 100/s", nil},
		{"saved, with characters JSON escapes", html, nil},
		{"earlier form, plain", "reads under 100/s", func(t *testing.T, dir string, rec *record) {
			if err := os.WriteFile(filepath.Join(dir, lkgFile), earlier(t, rec), 0o644); err != nil {
				t.Fatal(err)
			}
		}},
		{"earlier form, re-escaped", html, func(t *testing.T, dir string, rec *record) {
			b := earlier(t, rec)
			if !strings.Contains(string(b), `\u003c`) {
				t.Fatalf("earlier form %s: want < escaped, as it was written", b)
			}
			if err := os.WriteFile(filepath.Join(dir, lkgFile), b, 0o644); err != nil {
				t.Fatal(err)
			}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rec := lkgRecord(t, 7, tt.description)
			dir := t.TempDir()
			if tt.write == nil {
				if err := saveLKG(dir, rec, time.Now()); err != nil {
					t.Fatalf("saveLKG: %v", err)
				}
			} else {
				tt.write(t, dir, rec)
			}
			got, err := loadLKG(dir)
			if err != nil {
				t.Fatalf("loadLKG: %v", err)
			}
			if got == nil || got.version != 7 || got.digest != rec.digest || string(got.raw) != string(rec.raw) {
				t.Fatalf("loaded %+v, want version 7 with the document saved", got)
			}
			if got.doc.Description != tt.description {
				t.Fatalf("loaded description %q, want %q", got.doc.Description, tt.description)
			}
		})
	}
}

// TestSaveLastKnownGoodRefusesWhatWouldNotLoad: saveLKG checks what it
// wrote before renaming it into place: a record whose document does not
// match its digest is refused, and the file in place stays.
func TestSaveLastKnownGoodRefusesWhatWouldNotLoad(t *testing.T) {
	dir := t.TempDir()
	good := lkgRecord(t, 7, "good")
	if err := saveLKG(dir, good, time.Now()); err != nil {
		t.Fatal(err)
	}
	bad := *lkgRecord(t, 8, "bad")
	bad.digest = good.digest
	if err := saveLKG(dir, &bad, time.Now()); err == nil || !strings.Contains(err.Error(), "digest") {
		t.Fatalf("saveLKG of a record failing its digest: %v, want a digest error", err)
	}
	got, err := loadLKG(dir)
	if err != nil || got == nil || got.version != 7 {
		t.Fatalf("after the refused save: %+v %v, want version 7 still in place", got, err)
	}
	if left, _ := filepath.Glob(filepath.Join(dir, lkgFile+".*")); len(left) > 0 {
		t.Fatalf("temporary files left: %v", left)
	}
}

// TestLastKnownGoodVersionIsChecked: the version of a last-known-good file
// is covered by its sum, so a damaged version byte is refused (the agent
// then waits for the allocator) instead of loading the record as another
// version: 7 read as 6, 5 or 3 put it in force under a number it was never
// published as, and a higher number would reject the allocator's next
// versions as older. A file of an earlier build (no sum) still loads.
func TestLastKnownGoodVersionIsChecked(t *testing.T) {
	rec := lkgRecord(t, 7, "good")
	dir := t.TempDir()
	if err := saveLKG(dir, rec, time.Now()); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, lkgFile)
	good, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	at := strings.Index(string(good), `"version":7`) + len(`"version":`)
	if at < len(`"version":`) {
		t.Fatalf("no version 7 in %s", good)
	}
	for bit := range 8 {
		b := []byte(string(good))
		b[at] ^= 1 << bit
		if err := os.WriteFile(path, b, 0o644); err != nil {
			t.Fatal(err)
		}
		if got, err := loadLKG(dir); err == nil {
			t.Errorf("version byte %q (bit %d flipped) loaded as version %d, want the file refused", b[at], bit, got.version)
		}
	}

	// An earlier build's file: the document in base64, no sum.
	doc, err := json.Marshal(rec.raw)
	if err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(lkg{Version: rec.version, Digest: rec.digest, Document: doc, SavedMs: 1})
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(b), `"sum"`) {
		t.Fatalf("earlier form %s has a sum", b)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	if got, err := loadLKG(dir); err != nil || got == nil || got.version != 7 || got.digest != rec.digest {
		t.Fatalf("earlier build's file: %+v %v, want version 7 loaded", got, err)
	}
}
