package policy

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/allot-dev/allot/examples"
)

func TestValidateNorthstar(t *testing.T) {
	if err := mustParse(t, examples.Northstar).Validate(); err != nil {
		t.Fatal(err)
	}
}

func TestValidateRejects(t *testing.T) {
	base := mustParse(t, examples.Northstar)
	idx := func(name string) int {
		for i, r := range base.Rules {
			if r.Name == name {
				return i
			}
		}
		t.Fatalf("no rule %s", name)
		return -1
	}
	anon, read, export, slots, global, atlas := idx("p-anon"), idx("p-read"), idx("p-export"), idx("p-export-concurrency"), idx("p-global"), idx("p-tenant-atlas")
	at := func(i int, field string) string { return fmt.Sprintf("rules[%d].%s", i, field) }

	tests := []struct {
		name   string
		mutate func(d *Document)
		want   string // "path: message" substring
	}{
		// Costs.
		{"cost exceeds capacity", func(d *Document) { d.Rules[read].Cost = 30 }, at(read, "cost") + ": 30 exceeds capacity 20"},
		{"cost exceeds limit", func(d *Document) { d.Rules[anon].Cost = 21 }, at(anon, "cost") + ": 21 exceeds limit 20"},
		{"cost exceeds global limit", func(d *Document) { d.Rules[atlas].Cost = 1001 }, at(atlas, "cost") + ": 1001 exceeds limit 1000"},
		{"cost exceeds chunk", func(d *Document) { d.Rules[atlas].Cost = 101 }, at(atlas, "cost") + ": 101 exceeds lease.chunk 100"},
		{"cost exceeds gateway chunk", func(d *Document) { d.Rules[global].Cost = 101 }, at(global, "cost") + ": 101 exceeds lease.gateway_chunk 100"},
		{"zero cost", func(d *Document) { d.Rules[export].Cost = 0 }, at(export, "cost") + ": must be positive, got 0"},
		{"negative cost", func(d *Document) { d.Rules[export].Cost = -10 }, at(export, "cost") + ": must be positive, got -10"},
		{"cost on concurrency", func(d *Document) { d.Rules[slots].Cost = 1 }, at(slots, "cost") + ": not used by kind concurrency"},

		// Token bucket refill.
		{"zero refill without reason", func(d *Document) { d.Rules[read].RefillMilliPerSecond = 0 }, at(read, "refill_per_second") + ": 0 never refills; set zero_refill_reason"},
		{"blank reason", func(d *Document) { d.Rules[read].RefillMilliPerSecond = 0; d.Rules[read].ZeroRefillReason = "  " }, at(read, "refill_per_second") + ": 0 never refills"},
		{"reason with refill", func(d *Document) { d.Rules[read].ZeroRefillReason = "one-off" }, at(read, "zero_refill_reason") + ": only allowed when refill_per_second is 0"},
		{"negative refill", func(d *Document) { d.Rules[read].RefillMilliPerSecond = -500 }, at(read, "refill_per_second") + ": must not be negative, got -0.5"},
		{"zero capacity", func(d *Document) { d.Rules[read].Capacity = 0 }, at(read, "capacity") + ": required"},
		{"negative capacity", func(d *Document) { d.Rules[read].Capacity = -1 }, at(read, "capacity") + ": must be positive, got -1"},
		{"huge capacity", func(d *Document) { d.Rules[read].Capacity = MaxAmount + 1 }, at(read, "capacity") + ": 1000000000001 exceeds the maximum"},

		// Unknown enums.
		{"unknown kind", func(d *Document) { d.Rules[anon].Kind = "leaky_bucket" }, at(anon, "kind") + `: unknown kind "leaky_bucket"; want one of fixed_window, sliding_window, token_bucket, concurrency, global_quota`},
		{"unknown scope", func(d *Document) { d.Rules[anon].Scope = "planet" }, at(anon, "scope") + `: unknown scope "planet"`},
		{"unknown fail mode", func(d *Document) { d.Rules[anon].FailMode = "maybe" }, at(anon, "fail_mode") + `: unknown fail mode "maybe"`},
		{"empty fail mode", func(d *Document) { d.Rules[anon].FailMode = "" }, at(anon, "fail_mode") + `: unknown fail mode ""`},
		{"unknown strategy", func(d *Document) { d.Rules[atlas].Lease.Strategy = "lottery" }, at(atlas, "lease.strategy") + `: unknown strategy "lottery"`},

		// Windows, limits, durations.
		{"zero limit", func(d *Document) { d.Rules[anon].Limit = 0 }, at(anon, "limit") + ": required"},
		{"negative window", func(d *Document) { d.Rules[anon].Window = -time.Second }, at(anon, "window") + ": must be positive, got -1s"},
		{"zero window", func(d *Document) { d.Rules[atlas].Window = 0 }, at(atlas, "window") + ": required"},
		{"sub-millisecond window", func(d *Document) { d.Rules[anon].Window = 1500 * time.Microsecond }, at(anon, "window") + ": 1.5ms is not a whole number of milliseconds"},
		{"window too long", func(d *Document) { d.Rules[anon].Window = 48 * time.Hour }, at(anon, "window") + ": 48h exceeds the maximum 24h"},
		{"zero in flight", func(d *Document) { d.Rules[slots].MaxInFlight = 0 }, at(slots, "max_in_flight") + ": required"},
		{"zero slot ttl", func(d *Document) { d.Rules[slots].SlotTTL = 0 }, at(slots, "slot_ttl") + ": required"},

		// Fields the kind does not use.
		{"capacity on fixed window", func(d *Document) { d.Rules[anon].Capacity = 5 }, at(anon, "capacity") + ": not used by kind fixed_window"},
		{"limit on token bucket", func(d *Document) { d.Rules[read].Limit = 5 }, at(read, "limit") + ": not used by kind token_bucket"},
		{"lease on token bucket", func(d *Document) { d.Rules[read].Lease = &Lease{Chunk: 1} }, at(read, "lease") + ": not used by kind token_bucket"},
		{"slot ttl on window", func(d *Document) { d.Rules[anon].SlotTTL = time.Second }, at(anon, "slot_ttl") + ": not used by kind fixed_window"},

		// Leases.
		{"missing lease", func(d *Document) { d.Rules[atlas].Lease = nil }, at(atlas, "lease") + ": required for kind global_quota"},
		{"zero chunk", func(d *Document) { d.Rules[atlas].Lease.Chunk = 0 }, at(atlas, "lease.chunk") + ": required"},
		{"negative chunk", func(d *Document) { d.Rules[atlas].Lease.Chunk = -5 }, at(atlas, "lease.chunk") + ": must be positive, got -5"},
		{"chunk exceeds limit", func(d *Document) { d.Rules[atlas].Lease.Chunk = 1001 }, at(atlas, "lease.chunk") + ": 1001 exceeds limit 1000"},
		{"zero ttl", func(d *Document) { d.Rules[atlas].Lease.TTL = 0 }, at(atlas, "lease.ttl") + ": required"},
		{"ttl exceeds window with clamp", func(d *Document) { d.Rules[atlas].Lease.TTL = 2 * time.Minute }, at(atlas, "lease.ttl") + ": 2m exceeds window 1m"},
		{"ttl exceeds window without clamp", func(d *Document) {
			d.Rules[atlas].Lease.TTL = 2 * time.Minute
			d.Rules[atlas].Lease.Clamp = false
		}, at(atlas, "lease.ttl") + ": 2m exceeds window 1m"},
		{"negative fallback", func(d *Document) { d.Rules[global].Lease.FallbackPerRegion = -1 }, at(global, "lease.fallback_per_region") + ": must not be negative"},
		{"fallback under cost", func(d *Document) {
			d.Rules[global].Cost = 10
			d.Rules[global].Lease.FallbackPerRegion = 5
		}, at(global, "lease.fallback_per_region") + ": 5 is less than cost 10"},
		{"fallback exceeds limit", func(d *Document) { d.Rules[global].Lease.FallbackPerRegion = 20001 }, at(global, "lease.fallback_per_region") + ": 20001 x 2 regions = 40002 exceeds limit 40000"},
		{"fallback with fail closed", func(d *Document) { d.Rules[atlas].Lease.FallbackPerRegion = 100 }, at(atlas, "lease.fallback_per_region") + ": 100 needs fail_mode fallback (fail_mode is closed)"},
		{"fail fallback without allowance", func(d *Document) { d.Rules[atlas].FailMode = FailFallback }, at(atlas, "lease.fallback_per_region") + ": required with fail_mode fallback"},
		{"negative max held", func(d *Document) { d.Rules[atlas].Lease.MaxHeldPerRegion = -1 }, at(atlas, "lease.max_held_per_region") + ": must not be negative, got -1"},
		{"max held under chunk", func(d *Document) { d.Rules[atlas].Lease.MaxHeldPerRegion = 99 }, at(atlas, "lease.max_held_per_region") + ": 99 is less than chunk 100: a region at the cap could never be granted a full chunk"},
		{"max held over limit", func(d *Document) { d.Rules[atlas].Lease.MaxHeldPerRegion = 1001 }, at(atlas, "lease.max_held_per_region") + ": 1001 exceeds limit 1000"},
		{"huge max held", func(d *Document) { d.Rules[atlas].Lease.MaxHeldPerRegion = MaxAmount + 1 }, at(atlas, "lease.max_held_per_region") + ": 1000000000001 exceeds the maximum"},
		{"fail open global quota", func(d *Document) { d.Rules[atlas].FailMode = FailOpen }, at(atlas, "fail_mode") + ": open has no overshoot bound"},
		{"shadow global quota", func(d *Document) { d.Rules[atlas].Shadow = true }, at(atlas, "shadow") + ": a shadow global_quota is not supported"},
		{"gateway chunk exceeds chunk", func(d *Document) { d.Rules[global].Lease.GatewayChunk = 4001 }, at(global, "lease.gateway_chunk") + ": 4001 exceeds chunk 4000"},
		{"negative gateway chunk", func(d *Document) { d.Rules[global].Lease.GatewayChunk = -1 }, at(global, "lease.gateway_chunk") + ": must not be negative"},
		{"gateway chunk in a template", func(d *Document) { d.Rules[global].Match[0] = Match{Key: "route"} }, at(global, "lease.gateway_chunk") + ": not supported by a template"},
		{"template keyed by ip", func(d *Document) {
			d.Rules[atlas].Scope = ScopeGlobal
			d.Rules[atlas].Match = []Match{{Key: "route", Value: "GET /catalog", HasValue: true}, {Key: "ip"}}
		}, at(atlas, "match[1].key") + `: a global_quota template cannot be keyed by "ip"`},
		{"template keyed by user", func(d *Document) {
			d.Rules[atlas].Match = []Match{{Key: "tenant"}, {Key: "user"}}
		}, at(atlas, "match[1].key") + `: a global_quota template cannot be keyed by "user"`},
		{"template keyed by a fixed tenant and user", func(d *Document) {
			d.Rules[atlas].Match = append(d.Rules[atlas].Match, Match{Key: "user"})
		}, at(atlas, "match[1].key") + `: a global_quota template cannot be keyed by "user"`},
		{"template keyed by an API key", func(d *Document) {
			d.Rules[atlas].Match = []Match{{Key: "tenant"}, {Key: "api_key"}}
		}, at(atlas, "match[1].key") + `: a global_quota template cannot be keyed by "api_key": instance names carry values in clear, so the allocator's state would hold API keys (credentials)`},
		{"template keyed by Envoy's client address", func(d *Document) {
			d.Rules[atlas].Match = []Match{{Key: "tenant"}, {Key: "remote_address"}}
		}, at(atlas, "match[1].key") + `: a global_quota template cannot be keyed by "remote_address"`},
		{"shadow template", func(d *Document) { d.Rules[atlas].Match[0] = Match{Key: "tenant"}; d.Rules[atlas].Shadow = true }, at(atlas, "shadow") + ": a shadow global_quota is not supported"},
		{"global quota per user", func(d *Document) {
			d.Rules[atlas].Scope = ScopeUser
			d.Rules[atlas].Match = append(d.Rules[atlas].Match, Match{Key: "user", Value: "u", HasValue: true})
		}, at(atlas, "scope") + ": a global_quota is one pool; scope must be global or tenant, got user"},
		{"no regions", func(d *Document) { d.Regions = nil }, "regions: required: global_quota rules are leased to regions"},

		// Match lists and scopes.
		{"empty match", func(d *Document) { d.Rules[anon].Match = nil }, at(anon, "match") + ": at least one entry is required"},
		{"duplicate match key", func(d *Document) { d.Rules[anon].Match = append(d.Rules[anon].Match, Match{Key: "ip"}) }, at(anon, "match[2].key") + `: duplicate key "ip" (also match[1])`},
		{"empty value", func(d *Document) { d.Rules[anon].Match[0].Value = "" }, at(anon, "match[0].value") + ": must not be empty; omit value"},
		{"value without HasValue", func(d *Document) { d.Rules[anon].Match[1].Value = "x" }, at(anon, "match[1].value") + ": set without HasValue"},
		{"control character in value", func(d *Document) { d.Rules[anon].Match[0].Value = "a\x00b" }, at(anon, "match[0].value") + ": must be at most 256 bytes of printable UTF-8"},
		{"bad key", func(d *Document) { d.Rules[anon].Match[1].Key = "client ip" }, at(anon, "match[1].key") + `: "client ip" is not a descriptor key`},
		{"too many entries", func(d *Document) {
			for i := range MaxMatchEntries {
				d.Rules[anon].Match = append(d.Rules[anon].Match, Match{Key: fmt.Sprintf("k%d", i)})
			}
		}, at(anon, "match") + ": 18 entries; the limit is 16"},
		{"ip scope without ip", func(d *Document) { d.Rules[anon].Match = d.Rules[anon].Match[:1] }, at(anon, "match") + `: scope ip needs a "ip" entry`},
		{"user scope without tenant", func(d *Document) { d.Rules[read].Match = []Match{{Key: "user"}} }, at(read, "match") + `: scope user needs a "tenant" entry`},
		{"global scope window", func(d *Document) {
			d.Rules[anon].Scope = ScopeGlobal
		}, at(anon, "scope") + ": scope global requires kind global_quota"},

		// Names.
		{"duplicate rule name", func(d *Document) { d.Rules[read].Name = "p-anon" }, at(read, "name") + fmt.Sprintf(`: duplicate rule name "p-anon" (also rules[%d])`, anon)},
		{"bad rule name", func(d *Document) { d.Rules[anon].Name = "P_Anon" }, at(anon, "name") + `: "P_Anon" is not a name`},
		{"long rule name", func(d *Document) { d.Rules[anon].Name = strings.Repeat("a", 65) }, at(anon, "name") + ": "},
		{"empty rule name", func(d *Document) { d.Rules[anon].Name = "" }, at(anon, "name") + ": required"},
		{"missing document name", func(d *Document) { d.Name = "" }, "name: required"},
		{"bad region", func(d *Document) { d.Regions = []string{"eu", "US-East"} }, `regions[1]: "US-East" is not a region name`},
		{"duplicate region", func(d *Document) { d.Regions = []string{"eu", "eu"} }, `regions[1]: duplicate region "eu" (also regions[0])`},
		{"control character in description", func(d *Document) { d.Rules[anon].Description = "bell\a" }, at(anon, "description") + ": contains control character U+0007"},
		{"non-character U+FFFE in description", func(d *Document) { d.Description = "a\uFFFEb" }, "description: contains non-character U+FFFE"},
		{"non-character U+FFFF in rule description", func(d *Document) { d.Rules[anon].Description = "a\uFFFF" }, at(anon, "description") + ": contains non-character U+FFFF"},
		{"non-character in zero refill reason", func(d *Document) {
			d.Rules[read].RefillMilliPerSecond = 0
			d.Rules[read].ZeroRefillReason = "trial \uFFFE"
		}, at(read, "zero_refill_reason") + ": contains non-character U+FFFE"},
		{"DEL in description", func(d *Document) { d.Description = "a\x7fb" }, "description: contains control character U+007F"},
		{"C1 control in description", func(d *Document) { d.Description = "a\u0085b" }, "description: contains control character U+0085"},
		{"no rules", func(d *Document) { d.Rules = nil }, "rules: at least one rule is required"},
		{"canonical form too large", func(d *Document) {
			for i := range 4000 {
				r := *d.Rule("p-anon")
				r.Name = fmt.Sprintf("anon-%d", i)
				r.Description = strings.Repeat("x", 200)
				d.Rules = append(d.Rules, r)
			}
		}, "canonical form is"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := base.Clone()
			tt.mutate(d)
			err := d.Validate()
			if err == nil {
				t.Fatalf("Validate accepted the document; want %q", tt.want)
			}
			if !errors.Is(err, ErrInvalid) {
				t.Errorf("error does not wrap ErrInvalid: %v", err)
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %q\ndoes not contain %q", err, tt.want)
			}
			if _, err := Canonical(d); !errors.Is(err, ErrInvalid) {
				t.Errorf("Canonical accepted an invalid document: %v", err)
			}
		})
	}
}

func TestValidateAccepts(t *testing.T) {
	base := mustParse(t, examples.Northstar)
	tests := []struct {
		name   string
		mutate func(d *Document)
	}{
		{"zero refill with reason", func(d *Document) {
			r := d.Rule("p-read")
			r.RefillMilliPerSecond = 0
			r.ZeroRefillReason = "one-time trial allowance of 20 reads"
		}},
		{"cost equals capacity", func(d *Document) { d.Rule("p-export").Cost = 20 }},
		{"ttl equals window", func(d *Document) { d.Rule("p-tenant-atlas").Lease.TTL = time.Minute }},
		{"chunk equals limit", func(d *Document) { d.Rule("p-tenant-atlas").Lease.Chunk = 1000 }},
		{"fallback equals cost", func(d *Document) {
			d.Rule("p-global").Cost = 10
			d.Rule("p-global").Lease.FallbackPerRegion = 10
		}},
		{"template keyed by tenant and route", func(d *Document) {
			d.Rule("p-tenant-atlas").Match = []Match{{Key: "tenant"}, {Key: "route"}}
		}},
		{"template keyed by plan and auth", func(d *Document) {
			r := d.Rule("p-global")
			r.Match = []Match{{Key: "plan"}, {Key: "auth"}}
			r.Lease.GatewayChunk = 0
		}},
		{"global quota for a fixed user and address", func(d *Document) {
			r := d.Rule("p-tenant-atlas")
			r.Match = append(r.Match, Match{Key: "user", Value: "U-17", HasValue: true}, Match{Key: "ip", Value: "192.0.2.1", HasValue: true})
		}},
		{"other non-characters and specials in text", func(d *Document) { d.Description = "\uFDD0 \U0001FFFE \uFEFF \uFFFD \U0010FFFD" }},
		{"fallback fills the limit", func(d *Document) { d.Rule("p-global").Lease.FallbackPerRegion = 20000 }},
		{"clamp off", func(d *Document) { d.Rule("p-tenant-atlas").Lease.Clamp = false }},
		{"max held equals chunk", func(d *Document) { d.Rule("p-tenant-atlas").Lease.MaxHeldPerRegion = 100 }},
		{"max held equals limit", func(d *Document) { d.Rule("p-tenant-atlas").Lease.MaxHeldPerRegion = 1000 }},
		{"max held in a template", func(d *Document) {
			r := d.Rule("p-tenant-atlas")
			r.Match = []Match{{Key: "tenant"}}
			r.Lease.MaxHeldPerRegion = 300
		}},
		{"fair share", func(d *Document) { d.Rule("p-tenant-atlas").Lease.Strategy = StrategyFairShare }},
		{"shadow rule", func(d *Document) { d.Rule("p-read").Shadow = true }},
		{"fail open bucket", func(d *Document) { d.Rule("p-read").FailMode = FailOpen }},
		{"fixed user override", func(d *Document) { d.Rule("p-read").Match[2] = Match{Key: "user", Value: "U-17", HasValue: true} }},
		{"no regions without global quotas", func(d *Document) {
			d.Regions = nil
			var rules []Rule
			for _, r := range d.Rules {
				if r.Kind != KindGlobalQuota {
					rules = append(rules, r)
				}
			}
			d.Rules = rules
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := base.Clone()
			tt.mutate(d)
			if err := d.Validate(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestValidateCapsErrorList(t *testing.T) {
	d := mustParse(t, examples.Northstar)
	for i := range 200 {
		d.Rules = append(d.Rules, Rule{Name: fmt.Sprintf("bad-%d", i)})
	}
	var es Errors
	if err := d.Validate(); !errors.As(err, &es) {
		t.Fatalf("want Errors, got %v", err)
	}
	if len(es) != maxReportedErrors+1 || es[len(es)-1].Msg != "further problems not listed" {
		t.Errorf("got %d errors, last %v", len(es), es[len(es)-1])
	}
}
