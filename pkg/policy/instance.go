package policy

import (
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"strings"
)

// Quota templates. A global_quota rule with match entries that have no value
// is a template: every distinct tuple of a request's values for those
// entries, in match order, is a leased pool of its own (an instance) with the
// rule's limit, window and lease. "Every tenant: 1,000 requests per minute
// worldwide" is one rule, not one rule per tenant.
//
// An instance is named
//
//	<rule>/<value 1>/<value 2>...
//
// Rule names are [a-z0-9._-], so the first '/' ends the template's name. In
// a value the bytes '%', '/', '#', '{' and '}' are written %XX (uppercase
// hex) and every other byte as is: the values split back at '/', and the name
// never carries a brace (it becomes part of Redis keys and hash tags). A name
// longer than MaxInstanceNameBytes is replaced by
//
//	<rule>/#<32 lowercase hex digits>
//
// the first 128 bits of the SHA-256 of the length-prefixed values, so that
// every name fits the allocator's limit on a quota name. '#' is escaped in
// values, so the two forms cannot meet. Names are a pure function of the
// rule name and the values: every agent of every region names a tenant's
// pool the same way, which is what makes the pool global.

const (
	// MaxInstanceNameBytes is the longest instance name: the allocator's
	// limit on a quota name (fsm.MaxQuotaNameBytes). At this size the
	// largest batched Acquire (16,384 wants) still fits the allocator's
	// default 4 MiB body limit, request and answer.
	MaxInstanceNameBytes = 128
	// InstanceSeparator separates a template's name from its instance's
	// values, and the values from each other.
	InstanceSeparator = '/'
	// instanceHashHex is the length of a hashed instance's digest, in hex
	// digits.
	instanceHashHex = 32
)

// ErrInstanceName is wrapped by the errors ParseInstanceName returns.
var ErrInstanceName = errors.New("not an instance name")

// escapedInName reports whether b is written %XX in an instance name.
func escapedInName(b byte) bool {
	return b == '%' || b == '/' || b == '#' || b == '{' || b == '}'
}

const upperHex = "0123456789ABCDEF"

// InstanceName returns the name of the instance of template for values (the
// request's values for the template's value-less match entries, in match
// order). It does not check its arguments: template must be a rule name and
// values must be non-empty, as Match returns them.
func InstanceName(template string, values []string) string {
	n := len(template)
	for _, v := range values {
		n++
		for i := 0; i < len(v); i++ {
			if escapedInName(v[i]) {
				n += 3
			} else {
				n++
			}
		}
	}
	if n > MaxInstanceNameBytes {
		return hashedInstanceName(template, values)
	}
	b := make([]byte, 0, n)
	b = append(b, template...)
	for _, v := range values {
		b = append(b, InstanceSeparator)
		for i := 0; i < len(v); i++ {
			if c := v[i]; escapedInName(c) {
				b = append(b, '%', upperHex[c>>4], upperHex[c&15])
			} else {
				b = append(b, c)
			}
		}
	}
	return string(b)
}

func hashedInstanceName(template string, values []string) string {
	h := sha256.New()
	var n [4]byte
	for _, v := range values {
		binary.BigEndian.PutUint32(n[:], uint32(len(v)))
		h.Write(n[:])
		h.Write([]byte(v))
	}
	sum := h.Sum(nil)
	return template + string(InstanceSeparator) + "#" + hex.EncodeToString(sum[:instanceHashHex/2])
}

// Instance is an instance name taken apart by ParseInstanceName.
type Instance struct {
	// Template is the template rule's name.
	Template string
	// Values are the instance's values, unescaped, in match order; nil when
	// the name is hashed.
	Values []string
	// Hashed is set for the hashed form <rule>/#<digest>, which does not
	// carry the values.
	Hashed bool
}

// ParseInstanceName takes an instance name apart. It checks the syntax
// only, exactly as InstanceName writes names: a rule name, '/', then either
// the hashed form or one or more values, each non-empty, with exactly the
// bytes InstanceName escapes written as %XX in uppercase hex (so one value
// has one name), the whole at most MaxInstanceNameBytes. Whether the
// template exists and has that many value-less entries is the caller's
// question. Errors wrap ErrInstanceName.
func ParseInstanceName(name string) (Instance, error) {
	if len(name) > MaxInstanceNameBytes {
		return Instance{}, fmt.Errorf("%d bytes, at most %d: %w", len(name), MaxInstanceNameBytes, ErrInstanceName)
	}
	tmpl, rest, ok := strings.Cut(name, string(InstanceSeparator))
	if !ok {
		return Instance{}, fmt.Errorf("no %q after the template's name: %w", InstanceSeparator, ErrInstanceName)
	}
	if !isName(tmpl) {
		return Instance{}, fmt.Errorf("template %q is not a rule name: %w", tmpl, ErrInstanceName)
	}
	if strings.HasPrefix(rest, "#") {
		if !isLowerHex(rest[1:], instanceHashHex) {
			return Instance{}, fmt.Errorf("hashed instance: want '#' and %d lowercase hex digits: %w", instanceHashHex, ErrInstanceName)
		}
		return Instance{Template: tmpl, Hashed: true}, nil
	}
	segs := strings.Split(rest, string(InstanceSeparator))
	values := make([]string, len(segs))
	for i, s := range segs {
		v, err := unescapeValue(s)
		if err != nil {
			return Instance{}, fmt.Errorf("value %d: %w", i+1, err)
		}
		values[i] = v
	}
	return Instance{Template: tmpl, Values: values}, nil
}

// unescapeValue decodes one value of an instance name, refusing anything
// InstanceName would not have written.
func unescapeValue(s string) (string, error) {
	if s == "" {
		return "", fmt.Errorf("empty: %w", ErrInstanceName)
	}
	if !strings.Contains(s, "%") {
		if strings.ContainsAny(s, "#{}") {
			return "", fmt.Errorf("unescaped '#', '{' or '}': %w", ErrInstanceName)
		}
		return s, nil
	}
	b := make([]byte, 0, len(s))
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case c == '%':
			if i+2 >= len(s) {
				return "", fmt.Errorf("truncated escape: %w", ErrInstanceName)
			}
			hi, lo := strings.IndexByte(upperHex, s[i+1]), strings.IndexByte(upperHex, s[i+2])
			if hi < 0 || lo < 0 {
				return "", fmt.Errorf("escape %q: want %%XX in uppercase hex: %w", s[i:i+3], ErrInstanceName)
			}
			d := byte(hi<<4 | lo)
			if !escapedInName(d) {
				return "", fmt.Errorf("escape %q: %q is written as is: %w", s[i:i+3], d, ErrInstanceName)
			}
			b = append(b, d)
			i += 2
		case escapedInName(c):
			return "", fmt.Errorf("unescaped %q: %w", c, ErrInstanceName)
		default:
			b = append(b, c)
		}
	}
	return string(b), nil
}

func isLowerHex(s string, n int) bool {
	if len(s) != n {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !(c >= '0' && c <= '9' || c >= 'a' && c <= 'f') {
			return false
		}
	}
	return true
}

// IsTemplate reports whether r is a quota template: a global_quota with at
// least one match entry without a value.
func (r *Rule) IsTemplate() bool {
	if r.Kind != KindGlobalQuota {
		return false
	}
	for _, m := range r.Match {
		if !m.HasValue {
			return true
		}
	}
	return false
}

// TemplateKeys returns the keys of r's match entries without a value, in
// match order: the request's values for them name its instance. It is
// empty for a rule that is not a template.
func (r *Rule) TemplateKeys() []string {
	if r.Kind != KindGlobalQuota {
		return nil
	}
	var keys []string
	for _, m := range r.Match {
		if !m.HasValue {
			keys = append(keys, m.Key)
		}
	}
	return keys
}

// Quota returns the leased pool named name: a global quota of d (a single
// pool, or a template under its own name), or an instance of one of d's
// templates, which is the template's quota with Name set to the instance's
// name and no TemplateKeys (an instance is one pool). It checks an instance
// name's syntax and, unless the name is hashed, its number of values.
func (d *Document) Quota(name string) (GlobalQuota, bool) {
	qs := d.GlobalQuotas()
	find := func(n string) (GlobalQuota, bool) {
		for _, q := range qs {
			if q.Name == n {
				return q, true
			}
		}
		return GlobalQuota{}, false
	}
	if !strings.ContainsRune(name, InstanceSeparator) {
		return find(name)
	}
	in, err := ParseInstanceName(name)
	if err != nil {
		return GlobalQuota{}, false
	}
	q, ok := find(in.Template)
	if !ok || len(q.TemplateKeys) == 0 || (!in.Hashed && len(in.Values) != len(q.TemplateKeys)) {
		return GlobalQuota{}, false
	}
	q.Name, q.TemplateKeys = name, nil
	return q, true
}
