package policy

import (
	"fmt"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"
)

// Validate reports every problem in d as Errors (wrapping ErrInvalid), or
// nil. It checks what the schema cannot express: positive and bounded
// amounts, cost within capacity or limit, a refill of 0 only with a reason,
// known kinds, scopes, fail modes and strategies, unique names, well-formed
// match lists that carry the keys their scope needs, and lease specs that keep
// the overshoot bound finite (TTL within the window, chunk within the limit,
// fallback allowances within the limit and of at least one request's cost,
// no fail-open global quota, no gateway-local chunks for a template), free
// text the canonical form can carry, and that the canonical encoding fits in
// MaxDocumentBytes. A global_quota whose match has entries without a value
// is a template of pools (see InstanceName), not an error, unless such an
// entry is keyed by user or ip.
func (d *Document) Validate() error {
	var c collector
	d.validate(&c)
	return c.err()
}

func (d *Document) validate(c *collector) {
	checkName(c, "name", d.Name)
	checkText(c, "description", d.Description)

	if len(d.Regions) > MaxRegions {
		c.add("regions", 0, "%d regions; the limit is %d", len(d.Regions), MaxRegions)
	}
	seenRegion := make(map[string]int, len(d.Regions))
	for i, r := range d.Regions {
		p := fmt.Sprintf("regions[%d]", i)
		if !isRegion(r) {
			c.add(p, 0, "%q is not a region name: 1-%d of [a-z0-9-], starting with a letter or digit", truncate(r), MaxRegionLen)
		}
		if j, dup := seenRegion[r]; dup {
			c.add(p, 0, "duplicate region %q (also regions[%d])", truncate(r), j)
		}
		seenRegion[r] = i
	}

	switch {
	case len(d.Rules) == 0:
		c.add("rules", 0, "at least one rule is required: an empty policy would admit everything")
	case len(d.Rules) > MaxRules:
		c.add("rules", 0, "%d rules; the limit is %d", len(d.Rules), MaxRules)
		return
	}
	seenRule := make(map[string]int, len(d.Rules))
	hasGlobal := false
	for i := range d.Rules {
		if c.full() {
			c.truncated = true
			return
		}
		r := &d.Rules[i]
		p := fmt.Sprintf("rules[%d]", i)
		if j, dup := seenRule[r.Name]; dup && r.Name != "" {
			c.add(p+".name", 0, "duplicate rule name %q (also rules[%d])", truncate(r.Name), j)
		} else {
			seenRule[r.Name] = i
		}
		if r.Kind == KindGlobalQuota {
			hasGlobal = true
		}
		r.validate(c, p, len(d.Regions))
	}
	if hasGlobal && len(d.Regions) == 0 {
		c.add("regions", 0, "required: global_quota rules are leased to regions")
	}
	// The canonical form is what travels through Raft and to every agent,
	// and what Parse must accept again, so it obeys the input limit too.
	if len(c.errs) == 0 {
		if n := len(encodeCanonical(d)); n > MaxDocumentBytes {
			c.add("", 0, "canonical form is %d bytes; the limit is %d", n, MaxDocumentBytes)
		}
	}
}

func (r *Rule) validate(c *collector, p string, regions int) {
	checkName(c, p+".name", r.Name)
	checkText(c, p+".description", r.Description)
	if !r.Scope.Valid() {
		c.add(p+".scope", 0, "unknown scope %q; want one of %s", truncate(string(r.Scope)), list(Scopes()))
	}
	if !r.Kind.Valid() {
		c.add(p+".kind", 0, "unknown kind %q; want one of %s", truncate(string(r.Kind)), list(Kinds()))
	}
	if !r.FailMode.Valid() {
		c.add(p+".fail_mode", 0, "unknown fail mode %q; want one of %s", truncate(string(r.FailMode)), list(FailModes()))
	}
	r.validateMatch(c, p)

	// Fields that do not apply to the kind must be unset, so that a typo in
	// the kind cannot silently drop a limit the author wrote down.
	uses := func(ks ...Kind) bool {
		for _, k := range ks {
			if r.Kind == k {
				return true
			}
		}
		return !r.Kind.Valid() // an unknown kind is reported once, above
	}
	unused := func(field string, set bool, ks ...Kind) {
		if set && !uses(ks...) {
			c.add(p+"."+field, 0, "not used by kind %s", r.Kind)
		}
	}
	windowed := []Kind{KindFixedWindow, KindSlidingWindow, KindGlobalQuota}
	unused("limit", r.Limit != 0, windowed...)
	unused("window", r.Window != 0, windowed...)
	unused("cost", r.Cost != 0, KindFixedWindow, KindSlidingWindow, KindTokenBucket, KindGlobalQuota)
	unused("capacity", r.Capacity != 0, KindTokenBucket)
	unused("refill_per_second", r.RefillMilliPerSecond != 0, KindTokenBucket)
	unused("zero_refill_reason", r.ZeroRefillReason != "", KindTokenBucket)
	unused("max_in_flight", r.MaxInFlight != 0, KindConcurrency)
	unused("slot_ttl", r.SlotTTL != 0, KindConcurrency)
	unused("lease", r.Lease != nil, KindGlobalQuota)

	switch r.Kind {
	case KindFixedWindow, KindSlidingWindow:
		checkAmount(c, p+".limit", r.Limit)
		checkDuration(c, p+".window", r.Window)
		checkCost(c, p, r.Cost, r.Limit, "limit")
	case KindTokenBucket:
		checkAmount(c, p+".capacity", r.Capacity)
		checkCost(c, p, r.Cost, r.Capacity, "capacity")
		switch {
		case r.RefillMilliPerSecond < 0:
			c.add(p+".refill_per_second", 0, "must not be negative, got %s", formatMilli(r.RefillMilliPerSecond))
		case r.RefillMilliPerSecond > MaxAmount*1000:
			c.add(p+".refill_per_second", 0, "%s exceeds the maximum %d", formatMilli(r.RefillMilliPerSecond), int64(MaxAmount))
		case r.RefillMilliPerSecond == 0 && strings.TrimSpace(r.ZeroRefillReason) == "":
			c.add(p+".refill_per_second", 0, "0 never refills; set zero_refill_reason to say why, or use a positive rate")
		case r.RefillMilliPerSecond > 0 && r.ZeroRefillReason != "":
			c.add(p+".zero_refill_reason", 0, "only allowed when refill_per_second is 0")
		}
		checkText(c, p+".zero_refill_reason", r.ZeroRefillReason)
	case KindConcurrency:
		checkAmount(c, p+".max_in_flight", r.MaxInFlight)
		checkDuration(c, p+".slot_ttl", r.SlotTTL)
	case KindGlobalQuota:
		checkAmount(c, p+".limit", r.Limit)
		checkDuration(c, p+".window", r.Window)
		checkCost(c, p, r.Cost, r.Limit, "limit")
		r.validateGlobal(c, p, regions)
	}

	if r.Scope == ScopeGlobal && r.Kind.Valid() && r.Kind != KindGlobalQuota {
		c.add(p+".scope", 0, "scope global requires kind global_quota: only a leased pool is coordinated across regions")
	}
}

func (r *Rule) validateGlobal(c *collector, p string, regions int) {
	if r.Scope.Valid() && r.Scope != ScopeGlobal && r.Scope != ScopeTenant {
		c.add(p+".scope", 0, "a global_quota is one pool; scope must be global or tenant, got %s", r.Scope)
	}
	// Match entries without a value make the rule a template: one pool per
	// distinct tuple of values (see InstanceName).
	template := r.IsTemplate()
	for i, m := range r.Match {
		if !m.HasValue {
			if why, ok := privateTemplateKeys[m.Key]; ok {
				c.add(fmt.Sprintf("%s.match[%d].key", p, i), 0, "a global_quota template cannot be keyed by %q: instance names carry values in clear, so the allocator's state would hold %s and grow by one pool per client; give the entry a value, or use another kind",
					m.Key, why)
			}
		}
	}
	if r.Shadow {
		c.add(p+".shadow", 0, "a shadow global_quota is not supported: its pool would need leases of its own")
	}
	if r.FailMode == FailOpen {
		c.add(p+".fail_mode", 0, "open has no overshoot bound for a global quota; use closed, or fallback with lease.fallback_per_region")
	}
	l := r.Lease
	if l == nil {
		c.add(p+".lease", 0, "required for kind global_quota")
		return
	}
	lp := p + ".lease"
	if checkAmount(c, lp+".chunk", l.Chunk) {
		if r.Limit > 0 && l.Chunk > r.Limit {
			c.add(lp+".chunk", 0, "%d exceeds limit %d", l.Chunk, r.Limit)
		}
		if r.Cost > l.Chunk {
			c.add(p+".cost", 0, "%d exceeds lease.chunk %d", r.Cost, l.Chunk)
		}
	}
	if checkDuration(c, lp+".ttl", l.TTL) && r.Window > 0 && l.TTL > r.Window {
		// With clamp a longer TTL is cut to the window end anyway, so it only
		// misleads; without clamp a grant could span two boundaries, which
		// the carry_over term of the bound does not cover.
		c.add(lp+".ttl", 0, "%s exceeds window %s", formatDuration(l.TTL), formatDuration(r.Window))
	}
	if !l.Strategy.Valid() {
		c.add(lp+".strategy", 0, "unknown strategy %q; want one of %s", truncate(string(l.Strategy)), list(Strategies()))
	}
	switch {
	case l.FallbackPerRegion < 0:
		c.add(lp+".fallback_per_region", 0, "must not be negative, got %d", l.FallbackPerRegion)
	case l.FallbackPerRegion > MaxAmount:
		c.add(lp+".fallback_per_region", 0, "%d exceeds the maximum %d", l.FallbackPerRegion, int64(MaxAmount))
	case l.FallbackPerRegion > 0 && r.FailMode.Valid() && r.FailMode != FailFallback:
		c.add(lp+".fallback_per_region", 0, "%d needs fail_mode fallback (fail_mode is %s)", l.FallbackPerRegion, r.FailMode)
	case l.FallbackPerRegion == 0 && r.FailMode == FailFallback:
		c.add(lp+".fallback_per_region", 0, "required with fail_mode fallback: the allowance a cut-off region may admit per window")
	case l.FallbackPerRegion > 0 && r.Cost > 0 && l.FallbackPerRegion < r.Cost:
		// Less than one request would deny every request of an outage, so
		// the gateways raise their share of it to one request each: the
		// region would then admit more than the bound's fallback term.
		c.add(lp+".fallback_per_region", 0, "%d is less than cost %d: a cut-off region must be able to admit one request", l.FallbackPerRegion, r.Cost)
	case l.FallbackPerRegion > 0 && r.Limit > 0 && l.FallbackPerRegion*int64(regions) > r.Limit:
		c.add(lp+".fallback_per_region", 0, "%d x %d regions = %d exceeds limit %d",
			l.FallbackPerRegion, regions, l.FallbackPerRegion*int64(regions), r.Limit)
	}
	switch {
	case l.MaxHeldPerRegion < 0:
		c.add(lp+".max_held_per_region", 0, "must not be negative, got %d", l.MaxHeldPerRegion)
	case l.MaxHeldPerRegion == 0: // no cap
	case l.MaxHeldPerRegion > MaxAmount:
		c.add(lp+".max_held_per_region", 0, "%d exceeds the maximum %d", l.MaxHeldPerRegion, int64(MaxAmount))
	case r.Limit > 0 && l.MaxHeldPerRegion > r.Limit:
		c.add(lp+".max_held_per_region", 0, "%d exceeds limit %d", l.MaxHeldPerRegion, r.Limit)
	case l.Chunk > 0 && l.MaxHeldPerRegion < l.Chunk:
		c.add(lp+".max_held_per_region", 0, "%d is less than chunk %d: a region at the cap could never be granted a full chunk", l.MaxHeldPerRegion, l.Chunk)
	}
	switch {
	case l.GatewayChunk < 0:
		c.add(lp+".gateway_chunk", 0, "must not be negative, got %d", l.GatewayChunk)
	case l.GatewayChunk > 0 && template:
		c.add(lp+".gateway_chunk", 0, "not supported by a template (a match entry without a value): every instance would need gateway-local chunks of its own")
	case l.GatewayChunk > 0 && l.Chunk > 0 && l.GatewayChunk > l.Chunk:
		c.add(lp+".gateway_chunk", 0, "%d exceeds chunk %d", l.GatewayChunk, l.Chunk)
	case l.GatewayChunk > 0 && r.Cost > l.GatewayChunk:
		c.add(p+".cost", 0, "%d exceeds lease.gateway_chunk %d", r.Cost, l.GatewayChunk)
	}
}

// privateTemplateKeys are the descriptor keys a global_quota template must
// not leave without a value, with what their values are: one pool per
// client, named in clear in the allocator's state, snapshots and views. The
// list holds this project's principal keys and the usual names of client
// addresses (Envoy's remote_address action), credentials and user
// identities; a key outside it is taken to name something of the service's
// own (a tenant, a plan, a route). docs/allocator.md says to key templates by
// tenant or plan.
var privateTemplateKeys = map[string]string{
	"ip":             "client addresses",
	"remote_address": "client addresses",
	"client_ip":      "client addresses",
	"user":           "user ids",
	"user_id":        "user ids",
	"email":          "email addresses",
	"api_key":        "API keys (credentials)",
	"apikey":         "API keys (credentials)",
	"token":          "credentials",
	"authorization":  "credentials",
	"client_id":      "client ids",
	"session":        "session ids",
	"session_id":     "session ids",
}

func (r *Rule) validateMatch(c *collector, p string) {
	mp := p + ".match"
	switch {
	case len(r.Match) == 0:
		c.add(mp, 0, "at least one entry is required")
		return
	case len(r.Match) > MaxMatchEntries:
		c.add(mp, 0, "%d entries; the limit is %d", len(r.Match), MaxMatchEntries)
		return
	}
	seen := make(map[string]int, len(r.Match))
	for i, m := range r.Match {
		ep := fmt.Sprintf("%s[%d]", mp, i)
		if !isKey(m.Key) {
			c.add(ep+".key", 0, "%q is not a descriptor key: 1-%d of [A-Za-z0-9_.-]", truncate(m.Key), MaxNameLen)
		}
		if j, dup := seen[m.Key]; dup {
			c.add(ep+".key", 0, "duplicate key %q (also match[%d])", truncate(m.Key), j)
		}
		seen[m.Key] = i
		switch {
		case m.HasValue && m.Value == "":
			c.add(ep+".value", 0, "must not be empty; omit value to match any value")
		case !m.HasValue && m.Value != "":
			c.add(ep+".value", 0, "set without HasValue")
		case m.HasValue && !isValue(m.Value):
			c.add(ep+".value", 0, "must be at most %d bytes of printable UTF-8", MaxValueLen)
		}
	}
	for _, k := range r.Scope.requiredKeys() {
		if _, ok := seen[k]; !ok {
			c.add(mp, 0, "scope %s needs a %q entry", r.Scope, k)
		}
	}
}

// checkAmount reports a non-positive or oversized amount; it returns whether
// v is acceptable.
func checkAmount(c *collector, path string, v int64) bool {
	switch {
	case v == 0:
		c.add(path, 0, "required: a positive integer")
	case v < 0:
		c.add(path, 0, "must be positive, got %d", v)
	case v > MaxAmount:
		c.add(path, 0, "%d exceeds the maximum %d", v, int64(MaxAmount))
	default:
		return true
	}
	return false
}

// checkCost reports a cost that is not in [1, ceiling].
func checkCost(c *collector, p string, cost, ceiling int64, ceilingName string) {
	switch {
	case cost <= 0:
		c.add(p+".cost", 0, "must be positive, got %d", cost)
	case ceiling > 0 && cost > ceiling:
		c.add(p+".cost", 0, "%d exceeds %s %d", cost, ceilingName, ceiling)
	}
}

// checkDuration reports a duration that is not positive, not a whole number
// of DurationUnit, or longer than MaxWindow; it returns whether d is
// acceptable.
func checkDuration(c *collector, path string, d time.Duration) bool {
	switch {
	case d == 0:
		c.add(path, 0, "required: a positive duration such as 10s")
	case d < 0:
		c.add(path, 0, "must be positive, got %s", d)
	case d%DurationUnit != 0:
		c.add(path, 0, "%s is not a whole number of milliseconds", d)
	case d > MaxWindow:
		c.add(path, 0, "%s exceeds the maximum %s", formatDuration(d), formatDuration(MaxWindow))
	default:
		return true
	}
	return false
}

func checkName(c *collector, path, s string) {
	if !isName(s) {
		if s == "" {
			c.add(path, 0, "required")
			return
		}
		c.add(path, 0, "%q is not a name: 1-%d of [a-z0-9._-], starting with a letter or digit", truncate(s), MaxNameLen)
	}
}

// checkText reports free text that is too long, not UTF-8, or holds a
// control character other than newline and tab, or U+FFFE or U+FFFF: the
// canonical form writes non-ASCII as is, and the YAML reader refuses these
// two non-characters (the others it accepts), so Parse could not read the
// canonical form back.
func checkText(c *collector, path, s string) {
	if len(s) > MaxDescriptionLen {
		c.add(path, 0, "%d bytes; the limit is %d", len(s), MaxDescriptionLen)
		return
	}
	if !utf8.ValidString(s) {
		c.add(path, 0, "not valid UTF-8")
		return
	}
	for _, r := range s {
		switch {
		case unicode.IsControl(r) && r != '\n' && r != '\t':
			c.add(path, 0, "contains control character %U", r)
			return
		case r == 0xFFFE || r == 0xFFFF:
			c.add(path, 0, "contains non-character %U, which YAML does not allow", r)
			return
		}
	}
}

func isAlnumLower(b byte) bool { return b >= 'a' && b <= 'z' || b >= '0' && b <= '9' }

func isName(s string) bool {
	if len(s) == 0 || len(s) > MaxNameLen || !isAlnumLower(s[0]) {
		return false
	}
	for i := 1; i < len(s); i++ {
		if b := s[i]; !isAlnumLower(b) && b != '-' && b != '_' && b != '.' {
			return false
		}
	}
	return true
}

func isRegion(s string) bool {
	if len(s) == 0 || len(s) > MaxRegionLen || !isAlnumLower(s[0]) {
		return false
	}
	for i := 1; i < len(s); i++ {
		if b := s[i]; !isAlnumLower(b) && b != '-' {
			return false
		}
	}
	return true
}

func isKey(s string) bool {
	if len(s) == 0 || len(s) > MaxNameLen {
		return false
	}
	for i := 0; i < len(s); i++ {
		b := s[i]
		if !isAlnumLower(b) && !(b >= 'A' && b <= 'Z') && b != '_' && b != '-' && b != '.' {
			return false
		}
	}
	return true
}

func isValue(s string) bool {
	if len(s) == 0 || len(s) > MaxValueLen || !utf8.ValidString(s) {
		return false
	}
	for _, r := range s {
		if !unicode.IsPrint(r) && r != ' ' {
			return false
		}
	}
	return true
}

func list[T ~string](vs []T) string {
	s := make([]string, len(vs))
	for i, v := range vs {
		s[i] = string(v)
	}
	return strings.Join(s, ", ")
}
