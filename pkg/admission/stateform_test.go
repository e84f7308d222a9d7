package admission_test

import (
	"context"
	"encoding/binary"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap/zaptest"

	"github.com/allot-dev/allot/pkg/admission"
)

const formsPolicy = `
name: forms
rules:
  - {name: fixed, scope: tenant, match: [{key: tenant}], kind: fixed_window, limit: 8, window: 10s}
  - {name: bucket, scope: user, match: [{key: tenant}, {key: user}], kind: token_bucket, capacity: 9, refill_per_second: 1, fail_mode: closed}
  - {name: sliding, scope: route, match: [{key: tenant}, {key: route}], kind: sliding_window, limit: 7, window: 10s}
`

// formEngine returns an engine on client writing counter state in form,
// in namespace ns, on clock.
func formEngine(t *testing.T, client redis.UniversalClient, form, ns string, clock *fakeClock) *admission.Engine {
	t.Helper()
	rcfg := admission.DefaultRedisConfig()
	rcfg.StateForm = form
	store, err := admission.NewRedisStore(client, rcfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { store.Close() })
	cfg := admission.DefaultConfig()
	cfg.NegativeCacheTTL = 0
	cfg.Namespace = ns
	cfg.StoreTimeout = 2 * time.Second
	e, err := admission.New(cfg, store, parse(t, formsPolicy), 1, admission.WithClock(clock), admission.WithLogger(zaptest.NewLogger(t)))
	if err != nil {
		t.Fatal(err)
	}
	admission.UseStoreClock(e)
	t.Cleanup(func() { e.Close() })
	return e
}

// TestStateForms runs a fleet in the middle of a rolling upgrade: gateways
// writing counter state as text (as older builds did, and as new ones do
// while StateForm is text) and gateways writing it in the binary form share
// one Redis. Every decision must see every earlier debit, whichever form it
// was written in, for a token bucket, a fixed window and a sliding window.
func TestStateForms(t *testing.T) {
	for _, b := range backends()[1:] {
		t.Run(b.name, func(t *testing.T) {
			ctx := context.Background()
			client := b.redis(t)
			clock := newFakeClock(t0)
			ns := namespace()
			engines := map[string]*admission.Engine{
				admission.StateBinary: formEngine(t, client, admission.StateBinary, ns, clock),
				admission.StateText:   formEngine(t, client, admission.StateText, ns, clock),
			}
			req := func() *admission.Request {
				return &admission.Request{Descriptors: entries("tenant", "atlas", "user", "u1", "route", "GET /catalog")}
			}
			calls, err := engines[admission.StateText].ScriptCalls(req())
			if err != nil {
				t.Fatal(err)
			}
			var keys []string // the three string-state keys
			for _, c := range calls {
				keys = append(keys, c.Keys[1:]...)
			}
			if len(keys) != 3 {
				t.Fatalf("state keys %v, want 3", keys)
			}
			forms := []string{admission.StateText, admission.StateBinary, admission.StateBinary, admission.StateText,
				admission.StateText, admission.StateBinary, admission.StateText}
			for i, form := range forms {
				k := int64(i + 1)
				d, err := engines[form].Decide(ctx, req())
				if err != nil {
					t.Fatal(err)
				}
				wantAllowed(t, d, form+" decision "+itoa(i+1))
				for name, want := range map[string]int64{"fixed": 8 - k, "bucket": 9 - k, "sliding": 7 - k} {
					if got := rule(t, d, name).Remaining; got != want {
						t.Fatalf("decision %d (%s): %s remaining %d, want %d: an earlier debit was lost", i+1, form, name, got, want)
					}
				}
				for _, key := range keys {
					v, err := client.Get(ctx, key).Result()
					if err != nil {
						t.Fatal(err)
					}
					if got := stateForm(v); got != form {
						t.Fatalf("after a %s write, %s holds %q (%s)", form, key, v, got)
					}
				}
			}
			// The sliding window (limit 7) is spent: both deny it.
			for form, e := range engines {
				d, err := e.Decide(ctx, req())
				if err != nil {
					t.Fatal(err)
				}
				if d.Allowed() || d.Rule != "sliding" {
					t.Fatalf("%s: %s by %q after 7 requests; want a deny by sliding", form, d.Outcome, d.Rule)
				}
			}
			// Two windows later both windows start over and the bucket is full.
			clock.Advance(20 * time.Second)
			d, err := engines[admission.StateBinary].Decide(ctx, req())
			if err != nil {
				t.Fatal(err)
			}
			wantAllowed(t, d, "two windows later")
			if r := rule(t, d, "bucket").Remaining; r != 8 {
				t.Fatalf("bucket remaining %d after the refill, want 8", r)
			}

			// A binary value that does not decode to numbers is corrupt:
			// the fail modes decide and nothing is debited.
			var bucketKey string
			for _, key := range keys {
				if v, _ := client.Get(ctx, key).Result(); len(v) == 25 && v[0] == 2 {
					bucketKey = key
				}
			}
			if bucketKey == "" {
				t.Fatalf("no binary bucket among %v", keys)
			}
			garbage := []byte{2}
			for range 3 {
				garbage = binary.LittleEndian.AppendUint64(garbage, math.Float64bits(math.NaN()))
			}
			if err := client.Set(ctx, bucketKey, garbage, time.Minute).Err(); err != nil {
				t.Fatal(err)
			}
			before, err := client.MGet(ctx, keys...).Result()
			if err != nil {
				t.Fatal(err)
			}
			for form, e := range engines {
				d, err := e.Decide(ctx, req())
				if err != nil {
					t.Fatal(err)
				}
				// The script fails as a whole, so each rule of the call is
				// unavailable; the first fail-closed one is reported.
				if d.Outcome != admission.Unavailable {
					t.Fatalf("%s on a corrupt bucket: %s by %q; want unavailable", form, d.Outcome, d.Rule)
				}
			}
			after, err := client.MGet(ctx, keys...).Result()
			if err != nil {
				t.Fatal(err)
			}
			for i := range keys {
				if before[i] != after[i] {
					t.Fatalf("%s changed from %q to %q by calls that failed", keys[i], before[i], after[i])
				}
			}
		})
	}
}

// stateForm says which form a bucket's or a window's Redis value is in.
func stateForm(v string) string {
	switch {
	case len(v) == 25 && (v[0] == 2 || v[0] == 3):
		return admission.StateBinary
	case strings.Count(v, ":") >= 1 && strings.Trim(v, "0123456789:-") == "":
		return admission.StateText
	}
	return "neither form"
}

// decodeBucket returns the tokens (millitokens), stamp and expiry (ms) of
// a bucket in the binary form.
func decodeBucket(t *testing.T, v string) (tokens, stamp, expiry float64) {
	t.Helper()
	if len(v) != 25 || v[0] != 2 {
		t.Fatalf("bucket value %q: want a tag 2 and three numbers", v)
	}
	f := func(i int) float64 { return math.Float64frombits(binary.LittleEndian.Uint64([]byte(v[1+8*i:]))) }
	return f(0), f(1), f(2)
}
