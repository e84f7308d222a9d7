package admission

import (
	"fmt"
	"unicode"
	"unicode/utf8"

	"github.com/allot-dev/allot/pkg/policy"
)

// Limits on one request. They bound the work and the memory a hostile or
// mistaken caller can cause.
const (
	// MaxDescriptors is the largest number of descriptor entries.
	MaxDescriptors = 32
	// MaxKeyLen is the longest descriptor key, in bytes.
	MaxKeyLen = policy.MaxNameLen
	// MaxValueLen is the longest descriptor value, in bytes.
	MaxValueLen = policy.MaxValueLen
	// MaxRequestIDLen is the longest request id, in bytes.
	MaxRequestIDLen = 128
	// MaxHits is the largest hit count of one request.
	MaxHits = policy.MaxAmount
)

// Request is one admission question.
type Request struct {
	// Descriptors describe the request: ip, auth, tenant, user, route... The
	// gateway derives them from verified claims and its own view of the
	// request, never from headers the client sets. An empty value counts as
	// absent.
	Descriptors []policy.Entry
	// Hits multiplies every matched rule's cost (a batch of N calls is N
	// hits); 0 means 1. A concurrency rule takes one slot whatever the hits.
	Hits int64
	// RequestID makes the decision idempotent: a retry carrying the same id
	// (with the same descriptors and hits) within Config.IdempotencyTTL gets
	// the earlier admission back and is not charged again. It also names
	// the request's concurrency slots. Empty means none.
	RequestID string
}

func validKey(k string) bool {
	if k == "" || len(k) > MaxKeyLen {
		return false
	}
	for i := 0; i < len(k); i++ {
		b := k[i]
		if !(b >= 'a' && b <= 'z' || b >= 'A' && b <= 'Z' || b >= '0' && b <= '9' || b == '_' || b == '-' || b == '.') {
			return false
		}
	}
	return true
}

// printable reports whether s is valid UTF-8 of printable characters (and
// spaces). Descriptor values are almost always ASCII: those are checked a
// byte at a time, without decoding.
func printable(s string) bool {
	ascii := true
	for i := 0; i < len(s); i++ {
		if b := s[i]; b < 0x20 || b > 0x7e {
			ascii = false
			break
		}
	}
	return ascii || printableRunes(s)
}

// ValidValue reports whether s is a descriptor value the engine accepts as
// to its characters (valid UTF-8, printable characters and spaces; its
// length is checked against MaxValueLen apart): for callers that build
// values from client input, such as a route label from a URL path.
func ValidValue(s string) bool { return printable(s) }

// printableRunes is printable's definition, decoding every rune.
func printableRunes(s string) bool {
	if !utf8.ValidString(s) {
		return false
	}
	for _, r := range s {
		if !unicode.IsPrint(r) && r != ' ' {
			return false
		}
	}
	return true
}

// validate checks r against the policy's descriptor keys. It returns the
// hit count to charge.
func (r *Request) validate(known map[string]bool) (int64, error) {
	if len(r.Descriptors) > MaxDescriptors {
		return 0, fmt.Errorf("descriptors: %d entries, the limit is %d: %w", len(r.Descriptors), MaxDescriptors, ErrTooLarge)
	}
	if len(r.RequestID) > MaxRequestIDLen {
		return 0, fmt.Errorf("request_id: %d bytes, the limit is %d: %w", len(r.RequestID), MaxRequestIDLen, ErrTooLarge)
	}
	if !printable(r.RequestID) {
		return 0, fmt.Errorf("request_id: not printable UTF-8: %w", ErrBadDescriptor)
	}
	hits := r.Hits
	switch {
	case hits == 0:
		hits = 1
	case hits < 0:
		return 0, fmt.Errorf("hits: must not be negative, got %d: %w", hits, ErrBadCost)
	case hits > MaxHits:
		return 0, fmt.Errorf("hits: %d exceeds the maximum %d: %w", hits, int64(MaxHits), ErrBadCost)
	}
	hasTenant, hasUser := false, false
	for i, e := range r.Descriptors {
		switch {
		case len(e.Key) > MaxKeyLen:
			return 0, descriptorError(i, fmt.Errorf("descriptors[%d].key: %d bytes, the limit is %d: %w", i, len(e.Key), MaxKeyLen, ErrTooLarge))
		case !validKey(e.Key):
			return 0, descriptorError(i, fmt.Errorf("descriptors[%d].key: %q is not a key of [A-Za-z0-9_.-]: %w", i, e.Key, ErrBadDescriptor))
		case !known[e.Key]:
			return 0, descriptorError(i, fmt.Errorf("descriptors[%d].key: %q is used by no rule: %w", i, e.Key, ErrUnknownDescriptor))
		case len(e.Value) > MaxValueLen:
			return 0, descriptorError(i, fmt.Errorf("descriptors[%d].value: %d bytes, the limit is %d: %w", i, len(e.Value), MaxValueLen, ErrTooLarge))
		case !printable(e.Value):
			return 0, descriptorError(i, fmt.Errorf("descriptors[%d].value: not printable UTF-8: %w", i, ErrBadDescriptor))
		}
		for j := 0; j < i; j++ {
			if r.Descriptors[j].Key == e.Key {
				return 0, descriptorError(i, fmt.Errorf("descriptors[%d].key: %q also at descriptors[%d]: %w", i, e.Key, j, ErrBadDescriptor))
			}
		}
		switch e.Key {
		case "tenant":
			hasTenant = e.Value != ""
		case "user":
			hasUser = e.Value != ""
		}
	}
	if hasUser && !hasTenant {
		return 0, fmt.Errorf("descriptors: a user without a tenant: %w", ErrMissingTenant)
	}
	return hits, nil
}
