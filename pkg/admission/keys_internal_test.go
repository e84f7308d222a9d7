package admission

import (
	"testing"
	"unsafe"
)

// TestCounterKeysStayPut pins counter keys and their hashes: a key that
// changes between builds starts every counter afresh on upgrade (and a
// hash that changes, the negative cache's and the fallback's entries).
// The values were computed by the build before tenantCounter. With a key
// cache (keyCache) they are the same, made (a miss) or found (a hit).
func TestCounterKeysStayPut(t *testing.T) {
	h := hasher{ns: "al", salt: "pepper"}
	cached := h
	cached.cache = newKeyCache(64)
	for _, tt := range []struct {
		parts []string
		key   string
		hash  uint64
	}{
		{[]string{"u-1", "GET /catalog"}, "al:{t:atlas}:0123abcd:6rjAs047mLwkORQt", 13589677084799711467},
		{nil, "al:{t:atlas}:0123abcd:thuw1U5wVOfd395r", 16669071604699896759},
	} {
		key, hash := h.counter("t:atlas", "0123abcd", tt.parts)
		if key != tt.key || hash != tt.hash {
			t.Errorf("counter(%q): %q %d, want %q %d", tt.parts, key, hash, tt.key, tt.hash)
		}
		for _, pass := range []string{"made", "found"} {
			if key, hash, _ := cached.tenantCounter("atlas", "0123abcd", tt.parts); key != tt.key || hash != tt.hash {
				t.Errorf("tenantCounter(%q) with a cache, key %s: %q %d, want %q %d", tt.parts, pass, key, hash, tt.key, tt.hash)
			}
		}
		key, hash, tag := h.tenantCounter("atlas", "0123abcd", tt.parts)
		if key != tt.key || hash != tt.hash || tag != tenantTag("atlas") {
			t.Errorf("tenantCounter(%q): %q %d tag %q, want %q %d tag %q", tt.parts, key, hash, tag, tt.key, tt.hash, tenantTag("atlas"))
		}
		// The tag is the key's own bytes, not a string of its own.
		at := uintptr(unsafe.Pointer(unsafe.StringData(tag))) - uintptr(unsafe.Pointer(unsafe.StringData(key)))
		if at != uintptr(len("al:{")) {
			t.Errorf("the tag is not the key's bytes at %d (offset %d)", len("al:{"), at)
		}
	}
	allocs := testing.AllocsPerRun(100, func() {
		_, _, _ = h.tenantCounter("atlas", "0123abcd", []string{"u-1", "GET /catalog"})
	})
	if allocs != 1 {
		t.Errorf("tenantCounter allocates %v times, want once (the key)", allocs)
	}
}

// TestNewID: decision ids are the engine's prefix and a base-36 sequence,
// made with one allocation.
func TestNewID(t *testing.T) {
	e := &Engine{idPrefix: "d-00ff-"}
	if a, b := e.newID(), e.newID(); a != "d-00ff-1" || b != "d-00ff-2" {
		t.Fatalf("ids %q, %q; want d-00ff-1, d-00ff-2", a, b)
	}
	e.idSeq.Store(36*36 - 2)
	if id := e.newID(); id != "d-00ff-zz" {
		t.Fatalf("id %q, want d-00ff-zz", id)
	}
	if n := testing.AllocsPerRun(100, func() { _ = e.newID() }); n != 1 {
		t.Fatalf("newID allocates %v times, want once", n)
	}
}
