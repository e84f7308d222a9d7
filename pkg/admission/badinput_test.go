package admission_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/policy"
)

// TestBadInput: unknown descriptors, negative or huge costs, a cost above
// capacity, oversized requests and a missing tenant are clear errors naming
// the field; nothing is debited and nothing panics.
func TestBadInput(t *testing.T) {
	h := newHarness(t, memoryBackend(), northstar(t), nil)
	long := strings.Repeat("x", 300)
	many := make([]string, 0, 2*40)
	for i := 0; i < 40; i++ {
		many = append(many, "k"+itoa(i), "v")
	}
	tests := []struct {
		name      string
		give      *admission.Request
		want      error
		wantField string
	}{
		{"nil request", nil, admission.ErrInvalidRequest, "request"},
		{"unknown descriptor", &admission.Request{Descriptors: entries(append(export("cedar"), "colour", "blue")...)},
			admission.ErrUnknownDescriptor, "descriptors[3].key"},
		{"empty key", &admission.Request{Descriptors: entries("", "x")}, admission.ErrBadDescriptor, "descriptors[0].key"},
		{"bad key", &admission.Request{Descriptors: entries("ten ant", "x")}, admission.ErrBadDescriptor, "descriptors[0].key"},
		{"duplicate key", &admission.Request{Descriptors: entries("tenant", "a", "tenant", "b")}, admission.ErrBadDescriptor, "descriptors[1].key"},
		{"control character", &admission.Request{Descriptors: entries("tenant", "a\x00b")}, admission.ErrBadDescriptor, "descriptors[0].value"},
		{"invalid utf-8", &admission.Request{Descriptors: entries("tenant", "a\xffb")}, admission.ErrBadDescriptor, "descriptors[0].value"},
		{"oversized value", &admission.Request{Descriptors: entries("tenant", long)}, admission.ErrTooLarge, "descriptors[0].value"},
		{"oversized key", &admission.Request{Descriptors: entries(long, "x")}, admission.ErrTooLarge, "descriptors[0].key"},
		{"too many descriptors", &admission.Request{Descriptors: entries(many...)}, admission.ErrTooLarge, "descriptors"},
		{"oversized request id", &admission.Request{Descriptors: entries(export("cedar")...), RequestID: long}, admission.ErrTooLarge, "request_id"},
		{"negative hits", &admission.Request{Descriptors: entries(export("cedar")...), Hits: -1}, admission.ErrBadCost, "hits"},
		{"huge hits", &admission.Request{Descriptors: entries(export("cedar")...), Hits: 1 << 62}, admission.ErrBadCost, "hits"},
		{"cost above capacity", &admission.Request{Descriptors: entries(export("cedar")...), Hits: 3}, admission.ErrBadCost, "p-export"},
		{"user without tenant", &admission.Request{Descriptors: entries("route", "GET /catalog", "user", "U-17")},
			admission.ErrMissingTenant, "tenant"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d, err := h.e.Decide(context.Background(), tt.give)
			if !errors.Is(err, tt.want) || !errors.Is(err, admission.ErrInvalidRequest) {
				t.Fatalf("Decide = %v, %v; want %v (an ErrInvalidRequest)", d, err, tt.want)
			}
			if !strings.Contains(err.Error(), tt.wantField) {
				t.Fatalf("error %q does not name %q", err, tt.wantField)
			}
			// A descriptor's error says which one, for callers that built
			// them from several sources.
			var de *admission.DescriptorError
			if got, want := errors.As(err, &de), strings.HasPrefix(tt.wantField, "descriptors["); got != want {
				t.Fatalf("error %q: a DescriptorError %v, want %v", err, got, want)
			} else if got && !strings.HasPrefix(tt.wantField, "descriptors["+itoa(de.Index)+"]") {
				t.Fatalf("error %q: DescriptorError index %d, want the one of %s", err, de.Index, tt.wantField)
			}
		})
	}
	// Nothing was debited: the first export sees a full bucket.
	d := h.decide(export("cedar")...)
	if got := rule(t, d, "p-export").Remaining; got != 10 {
		t.Fatalf("after bad requests, remaining %d, want 10", got)
	}
	// Two hits of an export (20 units) fit the capacity exactly.
	h.clock.Advance(time.Minute)
	d = h.decideReq(&admission.Request{Descriptors: entries(export("cedar")...), Hits: 2})
	wantAllowed(t, d, "two hits")
	if got := rule(t, d, "p-export").Remaining; got != 0 {
		t.Fatalf("two hits left %d, want 0", got)
	}
	// A request no rule matches is allowed, with no store call.
	d = h.decide("tenant", "cedar")
	if !d.Allowed() || d.Source != admission.SourceNone || len(d.Rules) != 0 {
		t.Fatalf("unmatched request: %+v", d)
	}
}

func TestExtraDescriptors(t *testing.T) {
	h := newHarness(t, memoryBackend(), northstar(t), func(c *admission.Config) { c.ExtraDescriptors = []string{"plan"} })
	wantAllowed(t, h.decide(append(export("cedar"), "plan", "gold")...), "extra descriptor")
}

// TestStandardDescriptorsAreKnown: the standard keys (which httpmw sends
// with every request) are accepted by a policy that uses none of them, and
// any other unused key is still refused.
func TestStandardDescriptorsAreKnown(t *testing.T) {
	h := newHarness(t, memoryBackend(), parse(t, `
name: routes-only
rules:
  - name: per-route
    scope: route
    match: [{key: tenant}, {key: route}]
    kind: token_bucket
    capacity: 5
    refill_per_second: 1
`), nil)
	d := h.decide("ip", "203.0.113.7", "auth", "token", "tenant", "atlas", "user", "U-1", "route", "GET /catalog")
	wantAllowed(t, d, "all five standard keys")
	if got := rule(t, d, "per-route").Remaining; got != 4 {
		t.Fatalf("per-route remaining %d, want 4", got)
	}
	_, err := h.e.Decide(context.Background(), &admission.Request{Descriptors: entries("tenant", "atlas", "colour", "blue")})
	if !errors.Is(err, admission.ErrUnknownDescriptor) {
		t.Fatalf("unused non-standard key: %v, want ErrUnknownDescriptor", err)
	}
}

func TestConfigValidate(t *testing.T) {
	tests := []struct {
		name   string
		mutate func(*admission.Config)
		want   string
	}{
		{"default", func(*admission.Config) {}, ""},
		{"timeout", func(c *admission.Config) { c.StoreTimeout = 0 }, "StoreTimeout"},
		{"gateways", func(c *admission.Config) { c.Gateways = 0 }, "Gateways"},
		{"negative cache", func(c *admission.Config) { c.NegativeCacheTTL = -1 }, "NegativeCacheTTL"},
		{"cache size", func(c *admission.Config) { c.NegativeCacheSize = 0 }, "NegativeCacheSize"},
		{"key cache size", func(c *admission.Config) { c.KeyCacheSize = -1 }, "KeyCacheSize"},
		{"no key cache", func(c *admission.Config) { c.KeyCacheSize = 0 }, ""},
		{"idempotency", func(c *admission.Config) { c.IdempotencyTTL = 2 * time.Hour }, "IdempotencyTTL"},
		{"breaker", func(c *admission.Config) { c.BreakerFailures = 0 }, "BreakerFailures"},
		{"cooldown", func(c *admission.Config) { c.BreakerCooldown = 0 }, "BreakerCooldown"},
		{"namespace", func(c *admission.Config) { c.Namespace = "A{b}" }, "Namespace"},
		{"extra", func(c *admission.Config) { c.ExtraDescriptors = []string{"a b"} }, "ExtraDescriptors[0]"},
		{"negative pool fallback margin", func(c *admission.Config) { c.PoolFallbackMargin = -time.Millisecond }, "PoolFallbackMargin must be in [0, 1m], got -1ms"},
		{"pool fallback margin over a minute", func(c *admission.Config) { c.PoolFallbackMargin = time.Hour }, "PoolFallbackMargin"},
		{"no pool fallback margin", func(c *admission.Config) { c.PoolFallbackMargin = 0 }, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := admission.DefaultConfig()
			tt.mutate(&c)
			err := c.Validate()
			if tt.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("Validate = %v, want an error naming %s", err, tt.want)
			}
		})
	}
	store, _ := admission.NewMemoryStore(admission.DefaultMemoryConfig(), nil)
	if _, err := admission.New(admission.DefaultConfig(), store, nil, 1); !errors.Is(err, admission.ErrInvalidPolicy) {
		t.Fatalf("New with a nil policy: %v", err)
	}
	bad := northstar(t)
	bad.Rules[0].Kind = "leaky"
	if _, err := admission.New(admission.DefaultConfig(), store, bad, 1); !errors.Is(err, policy.ErrInvalid) {
		t.Fatalf("New with an invalid policy: %v", err)
	}
	if err := (admission.RedisConfig{}).Validate(); err == nil {
		t.Fatal("zero RedisConfig validated")
	}
	if err := admission.DefaultRedisConfig().Validate(); err != nil {
		t.Fatal(err)
	}
	rc := admission.DefaultRedisConfig()
	rc.StateForm = "json"
	if err := rc.Validate(); err == nil || !strings.Contains(err.Error(), `StateForm must be "binary" or "text", got "json"`) {
		t.Fatalf("StateForm json: %v", err)
	}
}

// FuzzDecide: arbitrary descriptors never panic; they either decide or fail
// with ErrInvalidRequest.
func FuzzDecide(f *testing.F) {
	f.Add("route", "GET /catalog", "tenant", "atlas", int64(1), "id")
	f.Add("tenant", "a}{b", "user", "\x00", int64(-3), "")
	f.Add("ip", "203.0.113.7", "auth", "anonymous", int64(1<<40), "x")
	doc := northstar(f)
	store, _ := admission.NewMemoryStore(admission.DefaultMemoryConfig(), nil)
	e, err := admission.New(admission.DefaultConfig(), store, doc, 1)
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, k1, v1, k2, v2 string, hits int64, id string) {
		d, err := e.Decide(context.Background(), &admission.Request{
			Descriptors: []policy.Entry{{Key: k1, Value: v1}, {Key: k2, Value: v2}},
			Hits:        hits,
			RequestID:   id,
		})
		if err != nil && !errors.Is(err, admission.ErrInvalidRequest) {
			t.Fatalf("error %v is not an ErrInvalidRequest", err)
		}
		if err == nil && d == nil {
			t.Fatal("nil decision without error")
		}
	})
}
