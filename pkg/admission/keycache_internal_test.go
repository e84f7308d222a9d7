package admission

import (
	"fmt"
	"strings"
	"sync"
	"testing"

	"pgregory.net/rapid"
)

// TestKeyCacheGivesTheKeysItWouldMake: with a cache, counterOf answers every
// input exactly as without one, whether the key is cached, evicted or never
// kept (inputs over maxCachedInput), in a cache small enough that most
// calls evict.
func TestKeyCacheGivesTheKeysItWouldMake(t *testing.T) {
	plain := hasher{ns: "al", salt: "pepper"}
	rapid.Check(t, func(t *rapid.T) {
		cached := plain
		cached.cache = newKeyCache(rapid.IntRange(1, 256).Draw(t, "size"))
		value := rapid.OneOf(
			rapid.SampledFrom([]string{"", "u-1", "u-2", "GET /catalog", "{x}", "a:b"}),
			rapid.StringN(0, 40, -1),
			rapid.Just(strings.Repeat("long-principal/", 20)), // over maxCachedInput
		)
		for i, n := 0, rapid.IntRange(1, 200).Draw(t, "calls"); i < n; i++ {
			tenant := rapid.SampledFrom([]string{"atlas", "birch", "t:#ab12"}).Draw(t, "tenant")
			digest := rapid.SampledFrom([]string{"0123abcd", "feedbeef"}).Draw(t, "digest")
			parts := rapid.SliceOfN(value, 0, 3).Draw(t, "parts")
			wantKey, wantHash := plain.counter(tenant, digest, parts)
			if key, hash := cached.counter(tenant, digest, parts); key != wantKey || hash != wantHash {
				t.Fatalf("counter(%q, %q, %q) with a cache: %q %d, without: %q %d", tenant, digest, parts, key, hash, wantKey, wantHash)
			}
			wantKey, wantHash, wantTag := plain.tenantCounter(tenant, digest, parts)
			if key, hash, tag := cached.tenantCounter(tenant, digest, parts); key != wantKey || hash != wantHash || tag != wantTag {
				t.Fatalf("tenantCounter(%q, %q, %q) with a cache: %q %d %q, without: %q %d %q", tenant, digest, parts, key, hash, tag, wantKey, wantHash, wantTag)
			}
		}
	})
}

// TestKeyCacheComparesInputs: an entry is a hit only for the inputs it was
// made from, whatever the hash says (two inputs of one 64-bit hash).
func TestKeyCacheComparesInputs(t *testing.T) {
	c := newKeyCache(64)
	const h = 42
	if got := c.put(h, []byte("in-a"), []byte("key-a"), 7); got != "key-a" {
		t.Fatalf("put returned %q, want key-a", got)
	}
	if key, _, ok := c.get(h, []byte("in-b")); ok {
		t.Fatalf("another input of the same hash got %q", key)
	}
	if key, hash, ok := c.get(h, []byte("in-a")); !ok || key != "key-a" || hash != 7 {
		t.Fatalf("get = %q %d %v, want key-a 7 true", key, hash, ok)
	}
	c.put(h, []byte("in-b"), []byte("key-b"), 8) // replaces the entry of its hash
	if key, hash, ok := c.get(h, []byte("in-b")); !ok || key != "key-b" || hash != 8 {
		t.Fatalf("get = %q %d %v, want key-b 8 true", key, hash, ok)
	}
	if _, _, ok := c.get(h, []byte("in-a")); ok {
		t.Fatal("the replaced entry is still found")
	}
	if newKeyCache(0) != nil {
		t.Fatal("a cache of size 0 is not nil (disabled)")
	}
}

// TestKeyCacheIsBounded: however many keys pass, the cache holds at most
// its size, and keeps answering.
func TestKeyCacheIsBounded(t *testing.T) {
	h := hasher{ns: "al", salt: "pepper", cache: newKeyCache(128)}
	for i := range 20_000 {
		h.counter("t:atlas", "0123abcd", []string{fmt.Sprint("u-", i)})
	}
	if n := h.cache.len(); n > 128 || n < 64 {
		t.Fatalf("the cache holds %d keys, want at most 128 (and, full, at least half)", n)
	}
}

// TestKeyCacheHitAllocatesNothing: a key seen before costs no allocation.
func TestKeyCacheHitAllocatesNothing(t *testing.T) {
	h := hasher{ns: "al", salt: "pepper", cache: newKeyCache(1024)}
	parts := []string{"u-1", "GET /catalog"}
	first, _, _ := h.tenantCounter("atlas", "0123abcd", parts)
	if n := testing.AllocsPerRun(100, func() {
		if key, _, _ := h.tenantCounter("atlas", "0123abcd", parts); key != first {
			t.Fatalf("key %q, want %q", key, first)
		}
	}); n != 0 {
		t.Fatalf("a cached key allocates %v times, want 0", n)
	}
}

// TestKeyCacheConcurrent: goroutines making overlapping keys through one
// small cache each get the key an uncached hasher makes (run with -race by
// scripts/test.sh).
func TestKeyCacheConcurrent(t *testing.T) {
	plain := hasher{ns: "al", salt: "pepper"}
	cached := plain
	cached.cache = newKeyCache(64)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Go(func() {
			for i := range 2000 {
				parts := []string{fmt.Sprint("u-", (i*7+g)%300)}
				want, wantHash := plain.counter("t:birch", "feedbeef", parts)
				if got, hash := cached.counter("t:birch", "feedbeef", parts); got != want || hash != wantHash {
					t.Errorf("goroutine %d: %q %d, want %q %d", g, got, hash, want, wantHash)
					return
				}
			}
		})
	}
	wg.Wait()
}
