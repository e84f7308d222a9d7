package policy

import (
	"bytes"
	"cmp"
	"errors"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"
	"time"
	"unicode/utf8"

	"go.yaml.in/yaml/v3"
)

// maxNodeVisits bounds the YAML nodes Parse walks, counting every expansion
// of an alias, so anchors cannot turn a small document into a huge one.
const maxNodeVisits = 2_000_000

// Parse decodes a YAML or JSON policy strictly, validates it, and returns it
// normalized: cost, fail_mode, lease.clamp and lease.strategy defaulted
// (1, closed, true, demand), regions and rules sorted by name.
//
// Strict means: unknown fields, duplicate keys, merge keys (<<), explicit
// tags, scalars of the wrong type (a quoted number, a duration without a
// unit, a fractional count), null values and more than one YAML document are
// errors. Inputs over MaxDocumentBytes or MaxRules are refused. Every error
// wraps ErrInvalid, and each problem is a *FieldError naming the field path in
// the source order, e.g. "rules[2].cost: 30 exceeds capacity 20 (line 31)".
// Unknown fields are listed with the problems validation finds in the rest
// of the document; any other problem of decoding (a value of the wrong
// type, say) is listed without them.
func Parse(data []byte) (*Document, error) {
	if len(data) > MaxDocumentBytes {
		return nil, Errors{{Msg: fmt.Sprintf("document is %d bytes; the limit is %d", len(data), MaxDocumentBytes)}}
	}
	dec := yaml.NewDecoder(bytes.NewReader(data))
	var root yaml.Node
	if err := dec.Decode(&root); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, Errors{{Msg: "empty document"}}
		}
		return nil, Errors{{Msg: yamlMessage(err)}}
	}
	var extra yaml.Node
	switch err := dec.Decode(&extra); {
	case err == nil:
		return nil, Errors{{Line: extra.Line, Msg: "more than one YAML document"}}
	case !errors.Is(err, io.EOF):
		return nil, Errors{{Msg: yamlMessage(err)}}
	}

	p := parser{budget: maxNodeVisits}
	d := p.document(&root)
	if !p.onlyUnknownFields() {
		// A value of the wrong type or shape was left out of d: validating
		// d would report what is missing from it, not what is wrong.
		return nil, p.c.err()
	}
	// Unknown fields are left out of d, which holds every known field as
	// written: validate it too, so that every problem is listed at once.
	// What validation says of a field the document misspelt (it is
	// absent) is left out: the unknown field's "did you mean" says it.
	c := p.c
	decoded := len(c.errs)
	d.validate(&c)
	if len(c.errs) == 0 {
		d.normalize()
		return d, nil
	}
	c.errs = slices.DeleteFunc(c.errs, func(fe *FieldError) bool {
		return !strings.HasPrefix(fe.Msg, unknownField) && p.misspeltField(fe.Path)
	})
	for _, fe := range c.errs[decoded:] {
		if fe.Path != "" {
			fe.Line = lineOf(&root, fe.Path)
		}
	}
	if decoded > 0 { // merge the unknown fields in, in document order
		slices.SortStableFunc(c.errs, func(a, b *FieldError) int { return cmp.Compare(a.Line, b.Line) })
	}
	return nil, c.err()
}

// onlyUnknownFields reports whether the problems p found while decoding,
// if any, are all unknown fields, and that it decoded the whole document
// (within its node budget, and without stopping at the cap of reported
// problems).
func (p *parser) onlyUnknownFields() bool {
	if p.budget < 0 || p.c.truncated {
		return false
	}
	for _, fe := range p.c.errs {
		if !strings.HasPrefix(fe.Msg, unknownField) {
			return false
		}
	}
	return true
}

// misspeltField reports whether path is, or is within, a field p found
// misspelt.
func (p *parser) misspeltField(path string) bool {
	for m := range p.misspelt {
		if path == m || strings.HasPrefix(path, m+".") || strings.HasPrefix(path, m+"[") {
			return true
		}
	}
	return false
}

// unknownField begins the message of a field the schema does not have.
const unknownField = "unknown field"

// yamlMessage strips the package prefix from a yaml.v3 error.
func yamlMessage(err error) string {
	return "yaml: " + strings.TrimPrefix(err.Error(), "yaml: ")
}

// parser walks a yaml.Node tree into a Document.
type parser struct {
	c      collector
	budget int
	// misspelt holds the paths of known fields absent from their mapping
	// and suggested for an unknown field there ("did you mean"): what
	// validation says of them follows from the misspelling.
	misspelt map[string]bool
}

// lineOf returns the source line of a field path such as "rules[2].cost",
// or of its deepest ancestor present in the tree.
func lineOf(root *yaml.Node, path string) int {
	n := deref(root)
	if n != nil && n.Kind == yaml.DocumentNode && len(n.Content) == 1 {
		n = deref(n.Content[0])
	}
	line := 0
	if n != nil {
		line = n.Line
	}
	for seg := range strings.SplitSeq(path, ".") {
		if seg == "" {
			break
		}
		name, rest, _ := strings.Cut(seg, "[")
		n = child(n, name)
		if n == nil {
			return line
		}
		line = n.Line
		for rest != "" {
			idx, after, _ := strings.Cut(rest, "]")
			rest = strings.TrimPrefix(after, "[")
			i, err := strconv.Atoi(idx)
			if n.Kind != yaml.SequenceNode || err != nil || i < 0 || i >= len(n.Content) {
				return line
			}
			if n = deref(n.Content[i]); n == nil {
				return line
			}
			line = n.Line
		}
	}
	return line
}

// child returns the value of key in mapping n, or nil.
func child(n *yaml.Node, key string) *yaml.Node {
	if n == nil || n.Kind != yaml.MappingNode {
		return nil
	}
	for i := 0; i+1 < len(n.Content); i += 2 {
		if n.Content[i].Value == key {
			return deref(n.Content[i+1])
		}
	}
	return nil
}

// deref follows aliases.
func deref(n *yaml.Node) *yaml.Node {
	for i := 0; n != nil && n.Kind == yaml.AliasNode && i < 8; i++ {
		n = n.Alias
	}
	return n
}

// node follows aliases and charges the visit budget; it returns nil once the
// budget is spent.
func (p *parser) node(path string, n *yaml.Node) *yaml.Node {
	n = deref(n)
	if n == nil || n.Kind == yaml.AliasNode {
		p.c.add(path, 0, "unresolvable alias")
		return nil
	}
	p.budget--
	if p.budget < 0 {
		if p.budget == -1 {
			p.c.add("", n.Line, "document expands to more than %d nodes (aliases)", maxNodeVisits)
		}
		return nil
	}
	return n
}

// fields checks that n is a mapping with string keys drawn from known, and
// returns the value node of each key present.
func (p *parser) fields(path string, n *yaml.Node, known ...string) map[string]*yaml.Node {
	n = p.node(path, n)
	if n == nil {
		return nil
	}
	if n.Kind != yaml.MappingNode {
		p.c.add(path, n.Line, "expected a mapping, got %s", describe(n))
		return nil
	}
	out := make(map[string]*yaml.Node, len(n.Content)/2)
	var suggested []string // known fields suggested for unknown ones
	for i := 0; i+1 < len(n.Content); i += 2 {
		k, v := n.Content[i], n.Content[i+1]
		if k.Kind == yaml.AliasNode {
			k = k.Alias
		}
		if k == nil || k.Kind != yaml.ScalarNode || k.ShortTag() != "!!str" {
			if k != nil && k.ShortTag() == "!!merge" {
				p.c.add(join(path, "<<"), k.Line, "merge keys are not supported")
			} else {
				p.c.add(path, n.Line, "mapping keys must be strings")
			}
			continue
		}
		fp := join(path, truncate(k.Value))
		if _, dup := out[k.Value]; dup {
			p.c.add(fp, k.Line, "duplicate key")
			continue
		}
		if !contains(known, k.Value) {
			msg := unknownField
			if s := suggest(k.Value, known); s != "" {
				msg += fmt.Sprintf("; did you mean %q?", s)
				suggested = append(suggested, s)
			}
			p.c.add(fp, k.Line, "%s", msg)
			continue
		}
		out[k.Value] = v
	}
	for _, s := range suggested {
		if _, ok := out[s]; !ok {
			if p.misspelt == nil {
				p.misspelt = map[string]bool{}
			}
			p.misspelt[join(path, s)] = true
		}
	}
	return out
}

func join(path, field string) string {
	if path == "" {
		return field
	}
	return path + "." + field
}

// sequence checks that n is a sequence and returns its items.
func (p *parser) sequence(path string, n *yaml.Node) ([]*yaml.Node, bool) {
	n = p.node(path, n)
	if n == nil {
		return nil, false
	}
	if n.Kind != yaml.SequenceNode {
		p.c.add(path, n.Line, "expected a sequence, got %s", describe(n))
		return nil, false
	}
	return n.Content, true
}

// scalar checks that n is a scalar with one of the given tags.
func (p *parser) scalar(path string, n *yaml.Node, want string, tags ...string) (*yaml.Node, bool) {
	n = p.node(path, n)
	if n == nil {
		return nil, false
	}
	if n.Kind != yaml.ScalarNode || !contains(tags, n.ShortTag()) {
		p.c.add(path, n.Line, "expected %s, got %s", want, describe(n))
		return nil, false
	}
	return n, true
}

func (p *parser) str(path string, n *yaml.Node) string {
	s, ok := p.scalar(path, n, "a string", "!!str")
	if !ok {
		return ""
	}
	return s.Value
}

func (p *parser) integer(path string, n *yaml.Node) int64 {
	s, ok := p.scalar(path, n, "an integer", "!!int")
	if !ok {
		return 0
	}
	v, err := strconv.ParseInt(strings.ReplaceAll(s.Value, "_", ""), 10, 64)
	if err != nil {
		p.c.add(path, s.Line, "%q is not a decimal integer in range", truncate(s.Value))
		return 0
	}
	return v
}

func (p *parser) boolean(path string, n *yaml.Node) bool {
	s, ok := p.scalar(path, n, "true or false", "!!bool")
	if !ok {
		return false
	}
	switch strings.ToLower(s.Value) {
	case "true":
		return true
	case "false":
		return false
	}
	p.c.add(path, s.Line, "expected true or false, got %q", truncate(s.Value))
	return false
}

func (p *parser) duration(path string, n *yaml.Node) time.Duration {
	s, ok := p.scalar(path, n, "a duration with a unit, such as 10s or 1m,", "!!str")
	if !ok {
		return 0
	}
	d, err := time.ParseDuration(s.Value)
	if err != nil {
		p.c.add(path, s.Line, "%q is not a duration such as 10s or 1m", truncate(s.Value))
		return 0
	}
	return d
}

// milli reads a non-negative decimal with at most three fraction digits,
// exactly (no floating point), as thousandths.
func (p *parser) milli(path string, n *yaml.Node) int64 {
	s, ok := p.scalar(path, n, "a number", "!!int", "!!float")
	if !ok {
		return 0
	}
	v, err := parseMilli(s.Value)
	if err != nil {
		p.c.add(path, s.Line, "%q: %v", truncate(s.Value), err)
		return 0
	}
	return v
}

func (p *parser) document(root *yaml.Node) *Document {
	d := &Document{}
	if root.Kind == yaml.DocumentNode {
		if len(root.Content) != 1 {
			p.c.add("", root.Line, "empty document")
			return d
		}
		root = root.Content[0]
	}
	f := p.fields("", root, "name", "description", "regions", "rules")
	if f == nil {
		return d
	}
	if n, ok := f["name"]; ok {
		d.Name = p.str("name", n)
	}
	if n, ok := f["description"]; ok {
		d.Description = p.str("description", n)
	}
	if n, ok := f["regions"]; ok {
		if items, ok := p.sequence("regions", n); ok {
			if len(items) > MaxRegions {
				p.c.add("regions", n.Line, "%d regions; the limit is %d", len(items), MaxRegions)
			} else {
				d.Regions = make([]string, 0, len(items))
				for i, it := range items {
					d.Regions = append(d.Regions, p.str(fmt.Sprintf("regions[%d]", i), it))
				}
			}
		}
	}
	if n, ok := f["rules"]; ok {
		if items, ok := p.sequence("rules", n); ok {
			if len(items) > MaxRules {
				p.c.add("rules", n.Line, "%d rules; the limit is %d", len(items), MaxRules)
				return d
			}
			d.Rules = make([]Rule, len(items))
			for i, it := range items {
				if p.c.full() {
					p.c.truncated = true // enough to report; the rest would only add noise
					break
				}
				if p.budget < 0 {
					break
				}
				p.rule(fmt.Sprintf("rules[%d]", i), it, &d.Rules[i])
			}
		}
	}
	return d
}

var ruleKeys = []string{
	"name", "description", "scope", "match", "kind", "limit", "window", "cost",
	"capacity", "refill_per_second", "zero_refill_reason", "max_in_flight",
	"slot_ttl", "lease", "fail_mode", "shadow",
}

func (p *parser) rule(path string, n *yaml.Node, r *Rule) {
	f := p.fields(path, n, ruleKeys...)
	if f == nil {
		return
	}
	at := func(field string) (string, *yaml.Node, bool) {
		v, ok := f[field]
		return path + "." + field, v, ok
	}
	if fp, v, ok := at("name"); ok {
		r.Name = p.str(fp, v)
	}
	if fp, v, ok := at("description"); ok {
		r.Description = p.str(fp, v)
	}
	if fp, v, ok := at("scope"); ok {
		r.Scope = Scope(p.str(fp, v))
	}
	if fp, v, ok := at("kind"); ok {
		r.Kind = Kind(p.str(fp, v))
	}
	if fp, v, ok := at("match"); ok {
		if items, ok := p.sequence(fp, v); ok {
			if len(items) > MaxMatchEntries {
				p.c.add(fp, v.Line, "%d entries; the limit is %d", len(items), MaxMatchEntries)
			} else {
				r.Match = make([]Match, len(items))
				for i, it := range items {
					p.match(fmt.Sprintf("%s[%d]", fp, i), it, &r.Match[i])
				}
			}
		}
	}
	ints := []struct {
		field string
		dst   *int64
	}{{"limit", &r.Limit}, {"cost", &r.Cost}, {"capacity", &r.Capacity}, {"max_in_flight", &r.MaxInFlight}}
	for _, it := range ints {
		if fp, v, ok := at(it.field); ok {
			*it.dst = p.integer(fp, v)
		}
	}
	durs := []struct {
		field string
		dst   *time.Duration
	}{{"window", &r.Window}, {"slot_ttl", &r.SlotTTL}}
	for _, it := range durs {
		if fp, v, ok := at(it.field); ok {
			*it.dst = p.duration(fp, v)
		}
	}
	if fp, v, ok := at("refill_per_second"); ok {
		r.RefillMilliPerSecond = p.milli(fp, v)
	}
	if fp, v, ok := at("zero_refill_reason"); ok {
		r.ZeroRefillReason = p.str(fp, v)
	}
	if _, ok := f["cost"]; !ok && r.Kind != KindConcurrency {
		r.Cost = 1
	}
	r.FailMode = FailClosed
	if fp, v, ok := at("fail_mode"); ok {
		r.FailMode = FailMode(p.str(fp, v))
	}
	if fp, v, ok := at("shadow"); ok {
		r.Shadow = p.boolean(fp, v)
	}
	if fp, v, ok := at("lease"); ok {
		r.Lease = p.lease(fp, v)
	}
}

func (p *parser) match(path string, n *yaml.Node, m *Match) {
	f := p.fields(path, n, "key", "value")
	if f == nil {
		return
	}
	if v, ok := f["key"]; ok {
		m.Key = p.str(path+".key", v)
	} else {
		p.c.add(path+".key", n.Line, "required")
	}
	if v, ok := f["value"]; ok {
		m.Value = p.str(path+".value", v)
		m.HasValue = true
	}
}

func (p *parser) lease(path string, n *yaml.Node) *Lease {
	f := p.fields(path, n, "chunk", "ttl", "clamp", "strategy", "fallback_per_region", "max_held_per_region", "gateway_chunk")
	if f == nil {
		return nil
	}
	l := &Lease{Clamp: true, Strategy: StrategyDemand}
	if v, ok := f["chunk"]; ok {
		l.Chunk = p.integer(path+".chunk", v)
	}
	if v, ok := f["ttl"]; ok {
		l.TTL = p.duration(path+".ttl", v)
	}
	if v, ok := f["clamp"]; ok {
		l.Clamp = p.boolean(path+".clamp", v)
	}
	if v, ok := f["strategy"]; ok {
		l.Strategy = Strategy(p.str(path+".strategy", v))
	}
	if v, ok := f["fallback_per_region"]; ok {
		l.FallbackPerRegion = p.integer(path+".fallback_per_region", v)
	}
	if v, ok := f["max_held_per_region"]; ok {
		l.MaxHeldPerRegion = p.integer(path+".max_held_per_region", v)
	}
	if v, ok := f["gateway_chunk"]; ok {
		l.GatewayChunk = p.integer(path+".gateway_chunk", v)
	}
	return l
}

// describe names a node's type for error messages.
func describe(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a sequence"
	case yaml.ScalarNode:
		switch t := n.ShortTag(); t {
		case "!!null":
			return "null"
		case "!!str":
			return fmt.Sprintf("string %q", truncate(n.Value))
		case "!!int", "!!float", "!!bool":
			return fmt.Sprintf("%s %s", strings.TrimPrefix(t, "!!"), truncate(n.Value))
		default:
			return fmt.Sprintf("tagged value %s", truncate(t))
		}
	}
	return "an unsupported node"
}

// maxQuoted bounds the bytes of an input value an error message repeats.
const maxQuoted = 64

// truncate shortens input repeated in an error message to maxQuoted bytes,
// cut at a rune boundary, marked "..."; every message quoting input goes
// through it, so a document's errors never repeat a large scalar whole.
func truncate(s string) string {
	if len(s) <= maxQuoted {
		return s
	}
	cut := maxQuoted
	for cut > 0 && !utf8.RuneStart(s[cut]) {
		cut--
	}
	return s[:cut] + "..."
}

func contains(xs []string, x string) bool {
	for _, s := range xs {
		if s == x {
			return true
		}
	}
	return false
}

// suggest returns the known field closest to a misspelt one, if close.
func suggest(s string, known []string) string {
	best, bestD := "", 3
	for _, k := range known {
		if d := editDistance(s, k); d < bestD {
			best, bestD = k, d
		}
	}
	return best
}

func editDistance(a, b string) int {
	if len(a) > 64 || len(b) > 64 {
		return 64
	}
	prev := make([]int, len(b)+1)
	cur := make([]int, len(b)+1)
	for j := range prev {
		prev[j] = j
	}
	for i := 1; i <= len(a); i++ {
		cur[0] = i
		for j := 1; j <= len(b); j++ {
			cost := 1
			if a[i-1] == b[j-1] {
				cost = 0
			}
			cur[j] = min(prev[j]+1, cur[j-1]+1, prev[j-1]+cost)
		}
		prev, cur = cur, prev
	}
	return prev[len(b)]
}

// parseMilli parses a non-negative decimal such as "2", "0.5" or "1_000.25"
// into thousandths, exactly.
func parseMilli(s string) (int64, error) {
	s = strings.ReplaceAll(s, "_", "")
	whole, frac, hasFrac := strings.Cut(s, ".")
	if whole == "" || strings.IndexFunc(whole, notDigit) >= 0 {
		return 0, errors.New("want a non-negative decimal such as 2 or 0.5")
	}
	if hasFrac && (frac == "" || len(frac) > 3 || strings.IndexFunc(frac, notDigit) >= 0) {
		return 0, errors.New("want at most 3 digits after the decimal point (millitokens)")
	}
	w, err := strconv.ParseInt(whole, 10, 64)
	if err != nil || w > MaxAmount {
		return 0, fmt.Errorf("exceeds the maximum %d", int64(MaxAmount))
	}
	f := int64(0)
	if hasFrac {
		frac += strings.Repeat("0", 3-len(frac))
		f, _ = strconv.ParseInt(frac, 10, 64)
	}
	return w*1000 + f, nil
}

func notDigit(r rune) bool { return r < '0' || r > '9' }

// formatMilli formats thousandths as the shortest exact decimal: 2000 is
// "2", 500 is "0.5".
func formatMilli(v int64) string {
	sign, u := "", uint64(v)
	if v < 0 {
		sign, u = "-", -uint64(v)
	}
	s := sign + strconv.FormatUint(u/1000, 10)
	if f := u % 1000; f != 0 {
		s += strings.TrimRight(fmt.Sprintf(".%03d", f), "0")
	}
	return s
}
