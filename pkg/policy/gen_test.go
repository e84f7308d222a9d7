package policy

import (
	"fmt"
	"time"
	"unicode"

	"pgregory.net/rapid"
)

// genOpts shapes generated documents: wide values exercise encoding, a small
// universe of keys and values makes matches likely.
type genOpts struct {
	values *rapid.Generator[string]
	keys   []string
}

func wideOpts() genOpts {
	return genOpts{
		values: rapid.StringOfN(rapid.RuneFrom([]rune{' ', '"', '\\', '<', '&', ':', '#', '\''}, unicode.L, unicode.N, unicode.P, unicode.S), 1, 24, MaxValueLen),
		keys:   []string{"auth", "route", "plan", "method", "x-tier", "k.1", "K_2"},
	}
}

func smallOpts() genOpts {
	return genOpts{
		values: rapid.SampledFrom([]string{"a", "b", "atlas", "GET /catalog"}),
		keys:   []string{"auth", "route", "plan"},
	}
}

var (
	genName   = rapid.StringMatching(`[a-z0-9][a-z0-9._-]{0,12}`)
	genRegion = rapid.StringMatching(`[a-z0-9][a-z0-9-]{0,6}`)
	genText   = rapid.StringOfN(rapid.RuneFrom([]rune{'\n', '\t', '"', '\\', '<', '&', ' '}, unicode.L, unicode.N, unicode.P, unicode.S, unicode.Zs), 0, 40, MaxDescriptionLen)
	genReason = rapid.StringMatching(`[a-z][a-z ]{0,20}`)
)

func genAmount(t *rapid.T, label string, hi int64) int64 {
	if rapid.Bool().Draw(t, label+"-small") {
		return rapid.Int64Range(1, min(hi, 100)).Draw(t, label)
	}
	return rapid.Int64Range(1, hi).Draw(t, label)
}

func genDuration(t *rapid.T, label string, hi time.Duration) time.Duration {
	ms := rapid.Int64Range(1, int64(hi/time.Millisecond)).Draw(t, label)
	return time.Duration(ms) * time.Millisecond
}

// genDocument generates a valid, normalized Document.
func genDocument(o genOpts) *rapid.Generator[*Document] {
	return rapid.Custom(func(t *rapid.T) *Document {
		d := &Document{
			Name:        genName.Draw(t, "name"),
			Description: genText.Draw(t, "description"),
			Regions:     rapid.SliceOfNDistinct(genRegion, 1, 4, func(s string) string { return s }).Draw(t, "regions"),
		}
		names := rapid.SliceOfNDistinct(genName, 1, 8, func(s string) string { return s }).Draw(t, "rules")
		for i, n := range names {
			d.Rules = append(d.Rules, genRule(t, o, fmt.Sprintf("rule%d", i), n, len(d.Regions)))
		}
		d.normalize()
		return d
	})
}

func genRule(t *rapid.T, o genOpts, l, name string, regions int) Rule {
	r := Rule{
		Name:        name,
		Description: genText.Draw(t, l+"-description"),
		Kind:        rapid.SampledFrom(Kinds()).Draw(t, l+"-kind"),
		FailMode:    rapid.SampledFrom(FailModes()).Draw(t, l+"-fail"),
		Shadow:      rapid.Bool().Draw(t, l+"-shadow"),
	}
	if r.Kind == KindGlobalQuota {
		r.Scope = rapid.SampledFrom([]Scope{ScopeGlobal, ScopeTenant}).Draw(t, l+"-scope")
		r.Shadow = false
	} else {
		r.Scope = rapid.SampledFrom([]Scope{ScopeIP, ScopeTenant, ScopeUser, ScopeRoute}).Draw(t, l+"-scope")
	}
	// A global quota is a single pool or, when an entry has no value, a
	// template of pools.
	r.Match = genMatch(t, o, l, r.Scope, r.Kind == KindGlobalQuota && rapid.Bool().Draw(t, l+"-single"))

	switch r.Kind {
	case KindFixedWindow, KindSlidingWindow:
		r.Limit = genAmount(t, l+"-limit", MaxAmount)
		r.Window = genDuration(t, l+"-window", MaxWindow)
		r.Cost = genAmount(t, l+"-cost", r.Limit)
	case KindTokenBucket:
		r.Capacity = genAmount(t, l+"-capacity", MaxAmount)
		r.Cost = genAmount(t, l+"-cost", r.Capacity)
		r.RefillMilliPerSecond = rapid.Int64Range(0, MaxAmount*1000).Draw(t, l+"-refill")
		if r.RefillMilliPerSecond == 0 || rapid.Bool().Draw(t, l+"-zero") {
			r.RefillMilliPerSecond = 0
			r.ZeroRefillReason = genReason.Draw(t, l+"-reason")
		}
	case KindConcurrency:
		r.MaxInFlight = genAmount(t, l+"-inflight", MaxAmount)
		r.SlotTTL = genDuration(t, l+"-slot", MaxWindow)
	case KindGlobalQuota:
		r.Limit = genAmount(t, l+"-limit", MaxAmount)
		r.Window = genDuration(t, l+"-window", MaxWindow)
		le := &Lease{
			Chunk:    genAmount(t, l+"-chunk", r.Limit),
			TTL:      genDuration(t, l+"-ttl", r.Window),
			Clamp:    rapid.Bool().Draw(t, l+"-clamp"),
			Strategy: rapid.SampledFrom(Strategies()).Draw(t, l+"-strategy"),
		}
		if !r.IsTemplate() && rapid.Bool().Draw(t, l+"-gw") {
			le.GatewayChunk = genAmount(t, l+"-gwchunk", le.Chunk)
		}
		ceiling := le.Chunk
		if le.GatewayChunk > 0 {
			ceiling = le.GatewayChunk
		}
		r.Cost = genAmount(t, l+"-cost", ceiling)
		// A fallback allowance admits at least one request per region, and
		// all regions' allowances fit in the limit.
		if r.FailMode == FailOpen || r.Limit/int64(regions) < r.Cost {
			r.FailMode = FailClosed
		}
		if r.FailMode == FailFallback {
			le.FallbackPerRegion = r.Cost - 1 + genAmount(t, l+"-fallback", r.Limit/int64(regions)-r.Cost+1)
		}
		// A per-region cap, when set, is at least a chunk and at most the limit.
		if rapid.Bool().Draw(t, l+"-held") {
			le.MaxHeldPerRegion = le.Chunk - 1 + genAmount(t, l+"-maxheld", r.Limit-le.Chunk+1)
		}
		r.Lease = le
	}
	return r
}

func genMatch(t *rapid.T, o genOpts, l string, s Scope, allFixed bool) []Match {
	keys := s.requiredKeys()
	extra := rapid.SliceOfNDistinct(rapid.SampledFrom(o.keys), 0, 3, func(s string) string { return s }).Draw(t, l+"-keys")
	for _, k := range extra {
		if !contains(keys, k) {
			keys = append(keys, k)
		}
	}
	if len(keys) == 0 {
		keys = append(keys, o.keys[0])
	}
	keys = rapid.Permutation(keys).Draw(t, l+"-order")
	ms := make([]Match, len(keys))
	for i, k := range keys {
		ms[i].Key = k
		if allFixed || rapid.Bool().Draw(t, fmt.Sprintf("%s-fixed%d", l, i)) {
			ms[i].Value = o.values.Draw(t, fmt.Sprintf("%s-value%d", l, i))
			ms[i].HasValue = true
		}
	}
	return ms
}

// genEntries generates a request descriptor over the small universe, with
// duplicate keys and empty values now and then.
func genEntries(o genOpts) *rapid.Generator[[]Entry] {
	keys := append([]string{"ip", "tenant", "user", "route"}, o.keys...)
	return rapid.Custom(func(t *rapid.T) []Entry {
		n := rapid.IntRange(0, 8).Draw(t, "n")
		es := make([]Entry, n)
		for i := range es {
			es[i].Key = rapid.SampledFrom(keys).Draw(t, "key")
			if rapid.IntRange(0, 9).Draw(t, "empty") != 0 {
				es[i].Value = o.values.Draw(t, "value")
			}
		}
		return es
	})
}
