package policy

import (
	"fmt"
	"strconv"
	"strings"
)

// Op is the kind of a Change.
type Op string

// The change operations.
const (
	// OpAdded is a rule that only the new document has.
	OpAdded Op = "added"
	// OpRemoved is a rule that only the old document has.
	OpRemoved Op = "removed"
	// OpChanged is a field whose value differs.
	OpChanged Op = "changed"
)

// Change is one difference between two policies, at rule and field level,
// for `allotctl policy diff`.
type Change struct {
	// Op says whether a rule was added or removed, or a field changed.
	Op Op `json:"op"`
	// Rule is the rule's name; "" for a document-level field.
	Rule string `json:"rule,omitempty"`
	// Field is the canonical field name (e.g. "limit", "lease.ttl"); "" when
	// a whole rule was added or removed.
	Field string `json:"field,omitempty"`
	// Old is the canonical old value ("" when absent); for a removed rule, a
	// summary of the rule.
	Old string `json:"old,omitempty"`
	// New is the canonical new value ("" when absent); for an added rule, a
	// summary of the rule.
	New string `json:"new,omitempty"`
}

// String formats the change for humans:
//
//   - rule p-new: token_bucket scope=user match=[tenant=*, user=*]
//   - rule p-old: ...
//     ~ rule p-tenant-atlas: limit 1000 -> 1200
//     ~ regions: eu,us -> ap,eu,us
func (c Change) String() string {
	show := func(s string) string {
		if s == "" {
			return "(unset)"
		}
		return s
	}
	switch {
	case c.Op == OpAdded:
		return fmt.Sprintf("+ rule %s: %s", c.Rule, c.New)
	case c.Op == OpRemoved:
		return fmt.Sprintf("- rule %s: %s", c.Rule, c.Old)
	case c.Rule == "":
		return fmt.Sprintf("~ %s: %s -> %s", c.Field, show(c.Old), show(c.New))
	default:
		return fmt.Sprintf("~ rule %s: %s %s -> %s", c.Rule, c.Field, show(c.Old), show(c.New))
	}
}

// Diff returns the changes from a to b: document-level fields first, then
// rules by name, fields in canonical order. Rules are identified by name, so
// a rename is a removal and an addition. Equal policies give no changes.
func Diff(a, b *Document) []Change {
	var out []Change
	da, db := docFields(a), docFields(b)
	out = appendFieldChanges(out, "", da, db)

	ra, rb := a.Clone(), b.Clone()
	ra.normalize()
	rb.normalize()
	i, j := 0, 0
	for i < len(ra.Rules) || j < len(rb.Rules) {
		switch {
		case j == len(rb.Rules) || i < len(ra.Rules) && ra.Rules[i].Name < rb.Rules[j].Name:
			out = append(out, Change{Op: OpRemoved, Rule: ra.Rules[i].Name, Old: summarize(&ra.Rules[i])})
			i++
		case i == len(ra.Rules) || rb.Rules[j].Name < ra.Rules[i].Name:
			out = append(out, Change{Op: OpAdded, Rule: rb.Rules[j].Name, New: summarize(&rb.Rules[j])})
			j++
		default:
			out = appendFieldChanges(out, ra.Rules[i].Name, ruleFields(&ra.Rules[i]), ruleFields(&rb.Rules[j]))
			i++
			j++
		}
	}
	return out
}

// field is one canonical (name, value) pair.
type field struct{ name, value string }

func appendFieldChanges(out []Change, rule string, a, b []field) []Change {
	get := func(fs []field, name string) string {
		for _, f := range fs {
			if f.name == name {
				return f.value
			}
		}
		return ""
	}
	// Walk the fields in canonical order; both lists are subsequences of it.
	for _, name := range fieldOrder {
		va, vb := get(a, name), get(b, name)
		if va != vb {
			out = append(out, Change{Op: OpChanged, Rule: rule, Field: name, Old: va, New: vb})
		}
	}
	return out
}

// fieldOrder is the canonical order of every field name Diff reports.
var fieldOrder = []string{
	"name", "description", "regions", "scope", "match", "kind", "limit", "window", "cost",
	"capacity", "refill_per_second", "zero_refill_reason", "max_in_flight", "slot_ttl",
	"lease.chunk", "lease.ttl", "lease.clamp", "lease.strategy", "lease.fallback_per_region",
	"lease.max_held_per_region", "lease.gateway_chunk", "fail_mode", "shadow",
}

func docFields(d *Document) []field {
	return []field{
		{"name", d.Name},
		{"description", d.Description},
		{"regions", strings.Join(sortedCopy(d.Regions), ",")},
	}
}

func ruleFields(r *Rule) []field {
	cr := canonicalRule(r)
	fs := []field{
		{"description", cr.Description},
		{"scope", string(cr.Scope)},
		{"match", formatMatch(r.Match)},
		{"kind", string(cr.Kind)},
	}
	num := func(name string, v int64) {
		if v != 0 {
			fs = append(fs, field{name, strconv.FormatInt(v, 10)})
		}
	}
	num("limit", cr.Limit)
	fs = append(fs, field{"window", cr.Window})
	num("cost", cr.Cost)
	num("capacity", cr.Capacity)
	fs = append(fs, field{"refill_per_second", string(cr.RefillPerSecond)}, field{"zero_refill_reason", cr.ZeroRefillReason})
	num("max_in_flight", cr.MaxInFlight)
	fs = append(fs, field{"slot_ttl", cr.SlotTTL})
	if l := cr.Lease; l != nil {
		fs = append(fs,
			field{"lease.chunk", strconv.FormatInt(l.Chunk, 10)},
			field{"lease.ttl", l.TTL},
			field{"lease.clamp", strconv.FormatBool(l.Clamp)},
			field{"lease.strategy", string(l.Strategy)},
			field{"lease.fallback_per_region", strconv.FormatInt(l.FallbackPerRegion, 10)},
			field{"lease.max_held_per_region", strconv.FormatInt(l.MaxHeldPerRegion, 10)},
			field{"lease.gateway_chunk", strconv.FormatInt(l.GatewayChunk, 10)},
		)
	}
	fs = append(fs, field{"fail_mode", string(cr.FailMode)}, field{"shadow", strconv.FormatBool(cr.Shadow)})
	return fs
}

func formatMatch(ms []Match) string {
	s := make([]string, len(ms))
	for i, m := range ms {
		s[i] = m.String()
	}
	return "[" + strings.Join(s, ", ") + "]"
}

// summarize is a one-line description of a rule for added/removed changes.
func summarize(r *Rule) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s scope=%s match=%s", r.Kind, r.Scope, formatMatch(r.Match))
	switch r.Kind {
	case KindFixedWindow, KindSlidingWindow:
		fmt.Fprintf(&b, " limit=%d/%s cost=%d", r.Limit, formatDuration(r.Window), r.Cost)
	case KindTokenBucket:
		fmt.Fprintf(&b, " capacity=%d refill=%s/s cost=%d", r.Capacity, formatMilli(r.RefillMilliPerSecond), r.Cost)
	case KindConcurrency:
		fmt.Fprintf(&b, " max_in_flight=%d slot_ttl=%s", r.MaxInFlight, formatDuration(r.SlotTTL))
	case KindGlobalQuota:
		fmt.Fprintf(&b, " limit=%d/%s cost=%d", r.Limit, formatDuration(r.Window), r.Cost)
		if l := r.Lease; l != nil {
			fmt.Fprintf(&b, " chunk=%d ttl=%s clamp=%t", l.Chunk, formatDuration(l.TTL), l.Clamp)
			if l.MaxHeldPerRegion > 0 {
				fmt.Fprintf(&b, " max_held_per_region=%d", l.MaxHeldPerRegion)
			}
		}
	}
	fmt.Fprintf(&b, " fail_mode=%s", r.FailMode)
	if r.Shadow {
		b.WriteString(" shadow")
	}
	return b.String()
}
