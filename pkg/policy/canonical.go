package policy

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"slices"
	"strings"
	"time"
)

// Canonical validates doc and returns its canonical JSON encoding: compact,
// fields in a fixed order, defaults written out (but lease.max_held_per_region
// only when set, so that documents older than the field keep their bytes),
// fields a kind does not use left out, durations in Go syntax ("10s", "1m"), the refill rate as an exact
// decimal, regions and rules sorted by name, no HTML escaping. It is what the
// allocator stores and hashes. Parse(Canonical(d)) equals d for any d that
// Parse returned.
func Canonical(doc *Document) ([]byte, error) {
	if err := doc.Validate(); err != nil {
		return nil, err
	}
	return encodeCanonical(doc), nil
}

// Digest returns the lowercase hex SHA-256 of doc's canonical encoding. It
// does not validate doc; use Canonical for that.
func Digest(doc *Document) string {
	sum := sha256.Sum256(encodeCanonical(doc))
	return hex.EncodeToString(sum[:])
}

type canonDoc struct {
	Name        string      `json:"name"`
	Description string      `json:"description,omitempty"`
	Regions     []string    `json:"regions,omitempty"`
	Rules       []canonRule `json:"rules"`
}

type canonRule struct {
	Name             string          `json:"name"`
	Description      string          `json:"description,omitempty"`
	Scope            Scope           `json:"scope"`
	Match            []canonMatch    `json:"match"`
	Kind             Kind            `json:"kind"`
	Limit            int64           `json:"limit,omitempty"`
	Window           string          `json:"window,omitempty"`
	Cost             int64           `json:"cost,omitempty"`
	Capacity         int64           `json:"capacity,omitempty"`
	RefillPerSecond  json.RawMessage `json:"refill_per_second,omitempty"`
	ZeroRefillReason string          `json:"zero_refill_reason,omitempty"`
	MaxInFlight      int64           `json:"max_in_flight,omitempty"`
	SlotTTL          string          `json:"slot_ttl,omitempty"`
	Lease            *canonLease     `json:"lease,omitempty"`
	FailMode         FailMode        `json:"fail_mode"`
	Shadow           bool            `json:"shadow,omitempty"`
}

type canonMatch struct {
	Key   string  `json:"key"`
	Value *string `json:"value,omitempty"`
}

type canonLease struct {
	Chunk             int64    `json:"chunk"`
	TTL               string   `json:"ttl"`
	Clamp             bool     `json:"clamp"`
	Strategy          Strategy `json:"strategy"`
	FallbackPerRegion int64    `json:"fallback_per_region"`
	// MaxHeldPerRegion is left out when 0 (no cap), unlike the other
	// fields: a document published before the field existed keeps its
	// canonical bytes and its digest.
	MaxHeldPerRegion int64 `json:"max_held_per_region,omitempty"`
	GatewayChunk     int64 `json:"gateway_chunk"`
}

// encodeCanonical encodes any Document, valid or not; it cannot fail.
func encodeCanonical(doc *Document) []byte {
	d := doc.Clone()
	d.normalize()
	cd := canonDoc{Name: d.Name, Description: d.Description, Regions: d.Regions, Rules: make([]canonRule, len(d.Rules))}
	for i := range d.Rules {
		cd.Rules[i] = canonicalRule(&d.Rules[i])
	}
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	if err := enc.Encode(cd); err != nil {
		// Only plain strings, integers and pre-built numbers are encoded.
		panic("policy: canonical encoding failed: " + err.Error())
	}
	return bytes.TrimSuffix(buf.Bytes(), []byte("\n"))
}

func canonicalRule(r *Rule) canonRule {
	cr := canonRule{
		Name:             r.Name,
		Description:      r.Description,
		Scope:            r.Scope,
		Match:            make([]canonMatch, len(r.Match)),
		Kind:             r.Kind,
		Limit:            r.Limit,
		Window:           formatDuration(r.Window),
		Cost:             r.Cost,
		Capacity:         r.Capacity,
		ZeroRefillReason: r.ZeroRefillReason,
		MaxInFlight:      r.MaxInFlight,
		SlotTTL:          formatDuration(r.SlotTTL),
		FailMode:         r.FailMode,
		Shadow:           r.Shadow,
	}
	for i, m := range r.Match {
		cr.Match[i].Key = m.Key
		if m.HasValue {
			v := m.Value
			cr.Match[i].Value = &v
		}
	}
	if r.Kind == KindTokenBucket || r.RefillMilliPerSecond != 0 {
		cr.RefillPerSecond = json.RawMessage(formatMilli(r.RefillMilliPerSecond))
	}
	if l := r.Lease; l != nil {
		cr.Lease = &canonLease{
			Chunk:             l.Chunk,
			TTL:               formatDuration(l.TTL),
			Clamp:             l.Clamp,
			Strategy:          l.Strategy,
			FallbackPerRegion: l.FallbackPerRegion,
			MaxHeldPerRegion:  l.MaxHeldPerRegion,
			GatewayChunk:      l.GatewayChunk,
		}
	}
	return cr
}

// formatDuration is time.Duration.String without zero trailing units
// ("1m0s" is "1m", "1h0m0s" is "1h"), and "" for 0.
func formatDuration(d time.Duration) string {
	if d == 0 {
		return ""
	}
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = s[:len(s)-2]
	}
	if strings.HasSuffix(s, "h0m") {
		s = s[:len(s)-2]
	}
	return s
}

// sortedCopy returns a sorted copy of ss.
func sortedCopy(ss []string) []string {
	c := slices.Clone(ss)
	slices.Sort(c)
	return c
}
