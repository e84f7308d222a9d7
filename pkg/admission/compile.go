package admission

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"slices"
	"strconv"
	"time"

	"github.com/allot-dev/allot/pkg/policy"
)

// spec is one rule compiled for the engine.
type spec struct {
	rule   *policy.Rule
	name   string
	scope  policy.Scope
	kind   int
	shadow bool
	fail   policy.FailMode
	// digest identifies the rule's counters: its name, kind, scope, match
	// entries and shadow flag, but not its numbers, so a new policy version
	// that only retunes a limit keeps the counters (a fresh full bucket on
	// every version bump would loosen enforcement during rollouts) while a
	// shadow rule never shares a key with a live one.
	digest string
	// unit is the cost of one hit in the store's unit (millitokens for a
	// bucket, tokens otherwise); ceiling is the largest cost that can ever be
	// admitted.
	unit, ceiling int64
	// a, b, d are the script arguments that do not depend on the request.
	a, b, d int64
	// local marks a global quota spent from a gateway-local chunk.
	local        bool
	gatewayChunk int64
	chunk        *localChunk // set by Engine.Apply
	// poolTag, poolZ, poolH locate a global quota's leased pool; empty for
	// a template, whose instances' pools are located per name (poolKeys).
	poolTag, poolZ, poolH string
	// template marks a global quota template: one pool per instance.
	template bool
	// tenantAt is, for a tenant-scoped template whose tenant entry has no
	// value, the position of the tenant among its instances' values; -1
	// otherwise.
	tenantAt int
	// fallback sizing: the per-gateway share of the rule.
	fbCap, fbRefill, fbLimit, fbWindow int64
	// fbMargin (wall ms) keeps a global quota's fallback share off both
	// ends of its window (Config.PoolFallbackMargin).
	fbMargin int64
	// quota and window (seconds) advertised in RateLimit-Policy; 0 = none.
	quota, window int64
	slotTTL       time.Duration
}

// snapshot is one policy version compiled; it is immutable.
type snapshot struct {
	doc     *policy.Document
	version uint64
	matcher *policy.Matcher
	specs   map[*policy.Rule]*spec
	quotas  map[string]*spec // global_quota rules (single pools and templates) by name
	known   map[string]bool  // descriptor keys the policy uses
	// floored names the fallback rules whose share of the rule (divided by
	// Config.Gateways) was under one request and was raised to one.
	floored []string
	// narrow names the fallback global quotas whose in-process fallback
	// span (the window less Config.PoolFallbackMargin at each end) is under
	// three quarters of their window: outside it they answer 503.
	narrow []string
}

// share is a gateway's fallback share of amount: amount divided by the
// gateways, but at least one request's unit (when amount allows any), since
// a smaller share would deny every request of the outage. It reports
// whether it raised the share.
func share(amount, gateways, unit int64) (int64, bool) {
	v := amount / gateways
	if amount > 0 && v < unit {
		return unit, true
	}
	return v, false
}

func compile(doc *policy.Document, version uint64, cfg *Config) (*snapshot, error) {
	if doc == nil {
		return nil, fmt.Errorf("%w: nil document", ErrInvalidPolicy)
	}
	if err := doc.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrInvalidPolicy, err)
	}
	s := &snapshot{
		doc:     doc,
		version: version,
		matcher: policy.Compile(doc),
		specs:   make(map[*policy.Rule]*spec, len(doc.Rules)),
		quotas:  make(map[string]*spec),
		known:   make(map[string]bool),
	}
	for _, k := range standardDescriptors {
		s.known[k] = true
	}
	for _, k := range cfg.ExtraDescriptors {
		s.known[k] = true
	}
	g := int64(cfg.Gateways)
	for i := range doc.Rules {
		r := &doc.Rules[i]
		raised := false // the fallback share was raised to one request
		for _, m := range r.Match {
			s.known[m.Key] = true
		}
		sp := &spec{
			rule:   r,
			name:   r.Name,
			scope:  r.Scope,
			shadow: r.Shadow,
			fail:   r.FailMode,
			digest: ruleDigest(r),
		}
		switch r.Kind {
		case policy.KindTokenBucket:
			sp.kind = kindBucket
			sp.unit, sp.ceiling = r.Cost*1000, r.Capacity*1000
			sp.a, sp.b = r.Capacity*1000, r.RefillMilliPerSecond
			sp.d = bucketTTL(sp.a, sp.b)
			sp.fbCap, raised = share(sp.a, g, sp.unit)
			sp.fbRefill, _ = share(sp.b, g, 1)
			sp.quota = r.Capacity
			if r.RefillMilliPerSecond > 0 {
				sp.window = ceilDiv(sp.a, r.RefillMilliPerSecond) // seconds to refill fully
			}
		case policy.KindFixedWindow, policy.KindSlidingWindow:
			sp.kind = kindFixed
			if r.Kind == policy.KindSlidingWindow {
				sp.kind = kindSliding
			}
			sp.unit, sp.ceiling = r.Cost, r.Limit
			sp.a, sp.b = r.Limit, r.Window.Milliseconds()
			sp.fbLimit, raised = share(r.Limit, g, r.Cost)
			sp.fbWindow = sp.b
			sp.quota, sp.window = r.Limit, ceilDiv(sp.b, 1000)
		case policy.KindConcurrency:
			sp.kind = kindSlots
			sp.unit, sp.ceiling = 0, 0
			sp.a, sp.b = r.MaxInFlight, r.SlotTTL.Milliseconds()
			sp.fbLimit, raised = share(r.MaxInFlight, g, 1)
			sp.slotTTL = r.SlotTTL
		case policy.KindGlobalQuota:
			sp.kind = kindPool
			sp.unit, sp.ceiling = r.Cost, r.Limit
			sp.tenantAt = -1
			if sp.template = r.IsTemplate(); sp.template {
				if r.Scope == policy.ScopeTenant {
					sp.tenantAt = slices.Index(r.TemplateKeys(), "tenant")
				}
			} else {
				sp.poolTag = poolTag(r)
				sp.poolZ, sp.poolH = poolKeys(cfg.Namespace, sp.poolTag, r.Name)
			}
			if r.Lease != nil {
				sp.fbLimit, raised = share(r.Lease.FallbackPerRegion, g, r.Cost)
				sp.fbWindow = r.Window.Milliseconds()
				sp.fbMargin = (cfg.PoolFallbackMargin.Nanoseconds() + int64(time.Millisecond) - 1) / int64(time.Millisecond)
				if r.FailMode == policy.FailFallback && r.Lease.FallbackPerRegion > 0 && 8*sp.fbMargin > sp.fbWindow {
					s.narrow = append(s.narrow, r.Name)
				}
				if r.Lease.GatewayChunk > 0 {
					sp.local, sp.gatewayChunk = true, r.Lease.GatewayChunk
					sp.ceiling = r.Lease.GatewayChunk
				}
			}
			s.quotas[r.Name] = sp
		default:
			return nil, fmt.Errorf("%w: rules[%d].kind: %q is not supported by this engine", ErrInvalidPolicy, i, r.Kind)
		}
		if raised && r.FailMode == policy.FailFallback {
			s.floored = append(s.floored, r.Name)
		}
		s.specs[r] = sp
	}
	return s, nil
}

// bucketTTL is a bucket's idle TTL: the time to refill from empty plus
// slack, after which an absent key means the same as a full bucket. A bucket
// that never refills keeps its state for a day (policy.MaxWindow).
func bucketTTL(capM, refillM int64) int64 {
	if refillM <= 0 {
		return policy.MaxWindow.Milliseconds()
	}
	return ceilDiv(capM*1000, refillM) + scriptSlack
}

// ruleDigest hashes the identity of a rule's counters (see spec.digest).
func ruleDigest(r *policy.Rule) string {
	h := sha256.New()
	field := func(s string) {
		var n [4]byte
		binary.BigEndian.PutUint32(n[:], uint32(len(s)))
		h.Write(n[:])
		h.Write([]byte(s))
	}
	field(r.Name)
	field(string(r.Kind))
	field(string(r.Scope))
	field(strconv.FormatBool(r.Shadow))
	for _, m := range r.Match {
		field(m.Key)
		field(strconv.FormatBool(m.HasValue))
		field(m.Value)
	}
	return hex.EncodeToString(h.Sum(nil)[:4])
}

// poolKeys returns the keys of the pool named name (a single pool's rule
// name or an instance's name) under hash tag tag.
func poolKeys(ns, tag, name string) (z, h string) {
	base := ns + ":{" + tag + "}:pool:" + name
	return base + ":z", base + ":h"
}

// instanceTag is the hash tag of the pool of instance name of template sp:
// the tenant's tag for a tenant-scoped template, so the pool is decided
// atomically with the tenant's other rules, and a tag of its own ("g:" and
// the instance's name) otherwise. tenant is the instance's tenant when its
// tenant entry has no value ("" when unknown): a hashed name does not carry
// it, so such an instance (values too long to name in full) keeps its pool
// under a tag of its own too, which costs its requests one more store call.
func instanceTag(sp *spec, name, tenant string) string {
	if sp.scope == policy.ScopeTenant {
		for _, m := range sp.rule.Match {
			if m.Key == "tenant" && m.HasValue {
				return tenantTag(m.Value)
			}
		}
		if sp.tenantAt >= 0 && tenant != "" && !hashedInstance(sp.name, name) {
			return tenantTag(tenant)
		}
	}
	return "g:" + name
}

// hashedInstance reports whether name is the hashed form of an instance of
// template tmpl (see policy.InstanceName).
func hashedInstance(tmpl, name string) bool {
	return len(name) > len(tmpl)+1 && name[len(tmpl)+1] == '#'
}

// poolTag is the hash tag of a global quota's pool: the tenant's tag for a
// tenant-scoped quota, so its pool is decided atomically with the tenant's
// other rules, and a tag of its own for a fleet-wide one.
func poolTag(r *policy.Rule) string {
	if r.Scope == policy.ScopeTenant {
		for _, m := range r.Match {
			if m.Key == "tenant" && m.HasValue {
				return tenantTag(m.Value)
			}
		}
	}
	return "g:" + r.Name
}
