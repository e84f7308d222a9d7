package admission

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/binary"
	"encoding/hex"
	"hash/maphash"
	"strings"
)

// Key layout. Every key starts with the namespace (Config.Namespace, "al" by
// default) and carries a hash tag, so all
// keys one store call touches live in one Redis Cluster slot:
//
//	al:{t:<tenant>}:<rule digest>:<principal hash>   tenant, user and route rules
//	al:{i:<address hash>}:<rule digest>:<principal hash>   ip rules
//	al:{g:<rule>}:<rule digest>:<principal hash>     fleet-wide rules
//	al:{<tag>}:pool:<quota>:z and :h                 a leased pool's grants and counters
//
// A leased pool's tag is the tenant's for a tenant-scoped quota and g:<quota>
// otherwise. A template's instance is a pool named by its instance name
// (policy.InstanceName, e.g. p-tenant-standard/birch), under the tag of the
// tenant it names, or g:<instance> when it names none (a fleet-wide
// template, or a hashed name that does not carry the tenant). An instance
// name carries its values in clear, as the allocator must know it: policy
// documents that templates be keyed by tenant or plan ids, not principals.
//	al:{<tag>}:id:<hash of request id and request>   an idempotency record
//
// Principals (users, addresses, any wildcard value) appear only hashed with
// the configured salt; the tenant appears in clear in its tag, as the design
// requires, unless it contains a brace, which would break the tag.

// tenantTag is the hash tag of a tenant's keys.
func tenantTag(tenant string) string {
	if strings.ContainsAny(tenant, "{}") {
		sum := sha256.Sum256([]byte(tenant))
		return "t:#" + hex.EncodeToString(sum[:8])
	}
	return "t:" + tenant
}

// hasher hashes principals into key names with a salt. cache, when set,
// keeps the counter keys it made (keyCache).
type hasher struct {
	ns, salt string
	cache    *keyCache
}

// sum hashes the length-prefixed fields into 32 bytes without allocating for
// small inputs.
func (h hasher) sum(fields ...string) [32]byte {
	var stack [512]byte
	b := stack[:0]
	b = appendField(b, h.salt)
	for _, f := range fields {
		b = appendField(b, f)
	}
	return sha256.Sum256(b)
}

func appendField(b []byte, s string) []byte {
	b = binary.BigEndian.AppendUint32(b, uint32(len(s)))
	return append(b, s...)
}

// ipTag is the hash tag of an address's keys.
func (h hasher) ipTag(ip string) string {
	sum := h.sum("ip", ip)
	return "i:" + hex.EncodeToString(sum[:8])
}

// counter returns the key of a rule's counter for one principal, and a
// 64-bit hash of it for the negative cache.
func (h hasher) counter(tag, digest string, parts []string) (string, uint64) {
	return h.counterOf("", tag, digest, parts)
}

// tenantCounter is counter for the tag of a tenant without braces
// (tenantTag), which it returns too, as part of the key: a decision's
// tenant rules then share the tag without a string of its own (one
// allocation a decision fewer).
func (h hasher) tenantCounter(tenant, digest string, parts []string) (key string, hash uint64, tag string) {
	key, hash = h.counterOf("t:", tenant, digest, parts)
	at := len(h.ns) + len(":{")
	return key, hash, key[at : at+len("t:")+len(tenant)]
}

// counterOf is counter of the tag tagPrefix + tagRest. The key is made on
// the stack and allocated once: as the key string, or with the cache's
// entry for it; a key in the cache costs a hash of its inputs and a lookup.
func (h hasher) counterOf(tagPrefix, tagRest, digest string, parts []string) (string, uint64) {
	var stack [512]byte
	b := stack[:0]
	b = appendField(b, h.salt)
	salted := len(b) // the salt is the engine's: the cache's inputs skip it
	b = binary.BigEndian.AppendUint32(b, uint32(len(tagPrefix)+len(tagRest)))
	b = append(append(b, tagPrefix...), tagRest...)
	b = appendField(b, digest)
	for _, p := range parts {
		b = appendField(b, p)
	}
	in := b[salted:]
	cache := h.cache != nil && len(in) <= maxCachedInput
	var ch uint64
	if cache {
		ch = maphash.Bytes(h.cache.seed, in)
		if key, hash, ok := h.cache.get(ch, in); ok {
			return key, hash
		}
	}
	sum := sha256.Sum256(b)
	hash := binary.LittleEndian.Uint64(sum[:8]) | 1
	var kstack [256]byte
	k := append(kstack[:0], h.ns...)
	k = append(append(append(k, ":{"...), tagPrefix...), tagRest...)
	k = append(append(append(k, "}:"...), digest...), ':')
	k = base64.RawURLEncoding.AppendEncode(k, sum[:12])
	if cache {
		return h.cache.put(ch, in, k, hash), hash
	}
	return string(k), hash
}

// idemKey is the key of req's idempotency record in a tag. It hashes the
// request id with the request itself (its descriptors, in order, and its
// hits), so a record is replayed only to a retry of the request that made
// it: the id reused on another route, tenant or cost is a new request, to
// be decided and charged, not handed the earlier admission.
func (h hasher) idemKey(tag string, req *Request) string {
	var stack [512]byte
	b := stack[:0]
	b = appendField(b, h.salt)
	b = appendField(b, "id")
	b = appendField(b, tag)
	b = appendField(b, req.RequestID)
	b = binary.BigEndian.AppendUint64(b, uint64(max(req.Hits, 1)))
	for _, e := range req.Descriptors {
		if e.Value != "" { // an empty value counts as absent
			b = appendField(b, e.Key)
			b = appendField(b, e.Value)
		}
	}
	sum := sha256.Sum256(b)
	return h.ns + ":{" + tag + "}:id:" + base64.RawURLEncoding.EncodeToString(sum[:12])
}
