package policy

import (
	"cmp"
	"slices"
	"strings"
)

// Entry is one descriptor entry of a request, e.g. {tenant, atlas}. The
// gateway derives entries from verified claims and its own view of the
// request, never from headers the client sets.
type Entry struct {
	// Key is the descriptor key, e.g. "tenant".
	Key string
	// Value is the request's value; empty counts as absent.
	Value string
}

// Matched is a rule that applies to a request.
type Matched struct {
	// Rule is the matched rule, shared with the Document: do not modify it.
	Rule *Rule
	// Parts are the request's values for the rule's wildcard entries, in the
	// rule's match order: together with the rule name they identify the
	// counter (e.g. ["203.0.113.7"] for p-anon). Empty for one-pool rules.
	Parts []string
	// Instance is, for a quota template, the name of the leased pool the
	// request is charged to: InstanceName(Rule.Name, Parts). Empty for
	// every other rule (a single pool is named by its rule).
	Instance string

	// from and to locate the match's parts in the parts list of
	// AppendMatchRules (see PartsIn).
	from, to int32
}

// PartsIn returns the match's Parts from the parts list AppendMatchRules
// returned with it.
func (mt Matched) PartsIn(parts []string) []string { return parts[mt.from:mt.to:mt.to] }

// Match returns every rule of d that applies to the request described by
// entries, in evaluation order (scope ip, global, tenant, user, route; then
// rule name). A rule applies when each of its match entries is present in
// entries: equal for an entry with a value, any non-empty value otherwise.
// The order of entries does not matter; the first occurrence of a key wins;
// an empty value counts as absent.
//
// Match scans every rule; it is the specification that a Matcher from
// Compile implements with an index.
func (d *Document) Match(entries []Entry) []Matched {
	var out []Matched
	for i := range d.Rules {
		r := &d.Rules[i]
		if parts, ok := matchRule(r, entries, nil); ok {
			mt := Matched{Rule: r, Parts: parts}
			if r.IsTemplate() {
				mt.Instance = InstanceName(r.Name, parts)
			}
			out = append(out, mt)
		}
	}
	slices.SortStableFunc(out, func(a, b Matched) int { return compareRules(a.Rule, b.Rule) })
	return out
}

// compareRules orders rules by scope rank, then name.
func compareRules(a, b *Rule) int {
	return cmp.Or(cmp.Compare(a.Scope.Rank(), b.Scope.Rank()), strings.Compare(a.Name, b.Name))
}

// lookup returns the value of the first entry with key, and whether it is
// present and non-empty.
func lookup(entries []Entry, key string) (string, bool) {
	for _, e := range entries {
		if e.Key == key {
			return e.Value, e.Value != ""
		}
	}
	return "", false
}

// matchRule reports whether r applies to entries, appending the values of
// r's wildcard entries to parts.
func matchRule(r *Rule, entries []Entry, parts []string) ([]string, bool) {
	start := len(parts)
	for _, m := range r.Match {
		v, ok := lookup(entries, m.Key)
		if !ok || m.HasValue && v != m.Value {
			return parts[:start], false
		}
		if !m.HasValue {
			parts = append(parts, v)
		}
	}
	return parts, true
}

// Matcher is a compiled, read-only index of a Document's rules for
// matching; it is safe for concurrent use. Each rule is indexed once, under
// its first fixed (key, value) entry, or under its first key when it has
// none, so a request only verifies the rules anchored at one of its entries.
type Matcher struct {
	rules   []*Rule           // in evaluation order
	wild    []int             // wildcard entries per rule, by position
	tmpl    []bool            // quota templates, by position
	byValue map[Entry][]int32 // anchor (key, value) -> positions in rules, ascending
	byKey   map[string][]int32
}

// Compile builds a Matcher for d, which must be valid and must not be
// modified afterwards.
func Compile(d *Document) *Matcher {
	m := &Matcher{
		rules:   make([]*Rule, len(d.Rules)),
		wild:    make([]int, len(d.Rules)),
		tmpl:    make([]bool, len(d.Rules)),
		byValue: make(map[Entry][]int32),
		byKey:   make(map[string][]int32),
	}
	for i := range d.Rules {
		m.rules[i] = &d.Rules[i]
	}
	slices.SortStableFunc(m.rules, compareRules)
	for pos, r := range m.rules {
		m.tmpl[pos] = r.IsTemplate()
		anchored := false
		for _, e := range r.Match {
			if !e.HasValue {
				m.wild[pos]++
			}
		}
		for _, e := range r.Match {
			if e.HasValue {
				k := Entry{Key: e.Key, Value: e.Value}
				m.byValue[k] = append(m.byValue[k], int32(pos))
				anchored = true
				break
			}
		}
		if !anchored && len(r.Match) > 0 {
			m.byKey[r.Match[0].Key] = append(m.byKey[r.Match[0].Key], int32(pos))
		}
	}
	return m
}

// Rules returns the compiled rules in evaluation order.
func (m *Matcher) Rules() []*Rule { return slices.Clone(m.rules) }

// Match returns what Document.Match returns, using the index.
func (m *Matcher) Match(entries []Entry) []Matched {
	return m.AppendMatch(nil, entries)
}

// AppendMatch appends the matches for entries to dst and returns it, so a
// caller can reuse dst across requests.
func (m *Matcher) AppendMatch(dst []Matched, entries []Entry) []Matched {
	var stack [32]int32
	cands := m.candidates(stack[:0], entries)
	if len(cands) == 0 {
		return dst
	}
	n := 0
	for _, pos := range cands {
		n += m.wild[pos]
	}
	var parts []string
	if n > 0 {
		parts = make([]string, 0, n) // one allocation for every match's parts
	}
	for _, pos := range cands {
		r := m.rules[pos]
		start := len(parts)
		var ok bool
		if parts, ok = matchRule(r, entries, parts); ok {
			mt := Matched{Rule: r}
			if len(parts) > start {
				mt.Parts = parts[start:len(parts):len(parts)]
			}
			if m.tmpl[pos] {
				mt.Instance = InstanceName(r.Name, mt.Parts)
			}
			dst = append(dst, mt)
		}
	}
	return dst
}

// AppendMatchRules is AppendMatch with every match's parts appended to
// parts instead of held in its own Parts slice (left nil; PartsIn finds
// them): for a caller on a hot path that keeps both lists on its stack.
// With room in dst and parts it allocates nothing but the instances' names.
func (m *Matcher) AppendMatchRules(dst []Matched, parts []string, entries []Entry) ([]Matched, []string) {
	var stack [32]int32
	for _, pos := range m.candidates(stack[:0], entries) {
		r := m.rules[pos]
		start := len(parts)
		var ok bool
		if parts, ok = matchRule(r, entries, parts); !ok {
			continue
		}
		mt := Matched{Rule: r, from: int32(start), to: int32(len(parts))}
		if m.tmpl[pos] {
			mt.Instance = InstanceName(r.Name, parts[start:])
		}
		dst = append(dst, mt)
	}
	return dst, parts
}

// candidates appends to cands the positions of the rules anchored at one of
// entries (each key's first entry only), in evaluation order.
func (m *Matcher) candidates(cands []int32, entries []Entry) []int32 {
	for i, e := range entries {
		if e.Value == "" || firstIndex(entries, e.Key) != i {
			continue
		}
		cands = append(cands, m.byValue[e]...)
		cands = append(cands, m.byKey[e.Key]...)
	}
	slices.Sort(cands)
	return cands
}

func firstIndex(entries []Entry, key string) int {
	for i, e := range entries {
		if e.Key == key {
			return i
		}
	}
	return -1
}
