package admission

import (
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"
)

// Config configures an Engine. DefaultConfig works as is for one gateway.
type Config struct {
	// StoreTimeout bounds one store call on the decision path, including the
	// time it waits to join a pipeline. When it passes, the rules of the call
	// are decided by their fail modes.
	StoreTimeout time.Duration
	// Gateways is how many gateways share one regional store. Fallback
	// buckets are sized as the rule divided by it, so the fleet cannot exceed
	// the rule while the store is down, but never under one request (a
	// share that small would deny every request of the outage; such rules
	// are logged when a policy is applied).
	Gateways int
	// NegativeCacheTTL is the ceiling on how long a denied key is denied
	// locally without a store call: min(retry hint, NegativeCacheTTL). Zero
	// disables the negative cache.
	NegativeCacheTTL time.Duration
	// NegativeCacheSize is the number of denied keys the negative cache holds
	// (rounded up to a power of two); older entries are overwritten, so its
	// memory is fixed.
	NegativeCacheSize int
	// KeyCacheSize is the number of counter keys the engine keeps made, so
	// that a principal seen again costs no hash and no allocation for its
	// keys (about 200 bytes a key, with short principals; a random key
	// makes room when it is full). Zero disables it.
	KeyCacheSize int
	// IdempotencyTTL is how long the store remembers an admitted request id:
	// a retry with the same id (and the same descriptors and hits) within it
	// returns the earlier decision and debits nothing again; the id on
	// another request is decided afresh. Zero disables idempotency.
	IdempotencyTTL time.Duration
	// BreakerFailures is the number of consecutive failed store calls that
	// opens a circuit breaker; while it is open no call is attempted. There
	// is one breaker per shard of the store (per master on Redis Cluster,
	// else one), counting that shard's calls: see the package doc.
	BreakerFailures int
	// BreakerCooldown is how long a breaker stays open before one probe
	// call is let through.
	BreakerCooldown time.Duration
	// UnavailableRetryAfter is the Retry-After of a 503 when a fail-closed
	// rule cannot be decided and the breaker gives no better estimate.
	UnavailableRetryAfter time.Duration
	// FallbackKeys caps the in-process fallback buckets; beyond it a new key
	// takes the room of the least recently used bucket that has been idle
	// for a minute, holds no slot and is at rest (full again, its window's
	// count lapsed: dropping it gives its key no second share), or is denied
	// (it never grows without bound).
	FallbackKeys int
	// ExtraDescriptors are descriptor keys accepted although no rule uses
	// them (e.g. keys a newer policy will use). The standard keys tenant,
	// user, route, ip and auth are always accepted; any other key no rule
	// uses is rejected with ErrUnknownDescriptor.
	ExtraDescriptors []string
	// Namespace prefixes every store key ("<namespace>:{tag}:..."), so that
	// several deployments can share one Redis; 1-32 of [a-z0-9_-].
	Namespace string
	// PoolFallbackMargin is how far inside each window a global quota's
	// in-process fallback (fail_mode fallback, while the store fails or is
	// slow) spends: the gateway's share of the window [S, E), by its wall
	// clock, is spendable only within [S + margin, E - margin), and outside
	// that span the quota answers Unavailable (503, as fail closed would)
	// with a Retry-After to the next span's start. A gateway clock within
	// the margin of true time then spends each window's share inside that
	// window, never two shares in one, which the stated bound's
	// store_fallback term assumes. A window no longer than twice the margin
	// has no span: its fallback always answers Unavailable. It must not be
	// less than the gateway clock's error; the default, 250 ms, is the
	// default lease margin (the allocator's -lease-margin). 0 to 1 minute.
	PoolFallbackMargin time.Duration
	// KeySalt is mixed into the hash of principals in store key names, so a
	// store dump does not reveal user ids or addresses by dictionary attack
	// (empty: no secret; the region agent warns). Every agent and gateway of
	// a region must use the same salt (the agent's $ALLOT_KEY_SALT), or their
	// counters split; changing it starts every rule counter afresh.
	KeySalt string
}

// standardDescriptors are the descriptor keys of the reference design's
// vocabulary, which httpmw sends with every request. They are accepted
// whether or not a rule uses them: a policy without ip rules (or an update
// that removes the last one) must not turn every request into a bad one.
var standardDescriptors = []string{"tenant", "user", "route", "ip", "auth"}

// DefaultConfig returns the defaults: a 50 ms store timeout, one gateway, a
// 250 ms negative cache of 4096 keys, a cache of 16,384 counter keys, 2
// minutes of idempotency, breakers that open after 5 failures for 1 s, a
// pool fallback margin of 250 ms.
func DefaultConfig() Config {
	return Config{
		StoreTimeout:          50 * time.Millisecond,
		Gateways:              1,
		NegativeCacheTTL:      250 * time.Millisecond,
		NegativeCacheSize:     4096,
		KeyCacheSize:          16384,
		IdempotencyTTL:        2 * time.Minute,
		BreakerFailures:       5,
		BreakerCooldown:       time.Second,
		UnavailableRetryAfter: time.Second,
		FallbackKeys:          100_000,
		Namespace:             "al",
		PoolFallbackMargin:    250 * time.Millisecond,
	}
}

// Validate says what is wrong with c, or returns nil.
func (c Config) Validate() error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if c.StoreTimeout <= 0 {
		bad("StoreTimeout must be positive, got %s", c.StoreTimeout)
	}
	if c.Gateways < 1 {
		bad("Gateways must be at least 1, got %d", c.Gateways)
	}
	if c.NegativeCacheTTL < 0 {
		bad("NegativeCacheTTL must not be negative, got %s", c.NegativeCacheTTL)
	}
	if c.NegativeCacheTTL > 0 && (c.NegativeCacheSize < 1 || c.NegativeCacheSize > 1<<24) {
		bad("NegativeCacheSize must be in [1, %d], got %d", 1<<24, c.NegativeCacheSize)
	}
	if c.KeyCacheSize < 0 || c.KeyCacheSize > 1<<24 {
		bad("KeyCacheSize must be in [0, %d], got %d", 1<<24, c.KeyCacheSize)
	}
	if c.IdempotencyTTL < 0 || c.IdempotencyTTL > time.Hour {
		bad("IdempotencyTTL must be in [0, 1h], got %s", c.IdempotencyTTL)
	}
	if c.BreakerFailures < 1 {
		bad("BreakerFailures must be at least 1, got %d", c.BreakerFailures)
	}
	if c.BreakerCooldown <= 0 {
		bad("BreakerCooldown must be positive, got %s", c.BreakerCooldown)
	}
	if c.UnavailableRetryAfter <= 0 {
		bad("UnavailableRetryAfter must be positive, got %s", c.UnavailableRetryAfter)
	}
	if c.FallbackKeys < 1 {
		bad("FallbackKeys must be at least 1, got %d", c.FallbackKeys)
	}
	if c.PoolFallbackMargin < 0 || c.PoolFallbackMargin > time.Minute {
		bad("PoolFallbackMargin must be in [0, 1m], got %s", c.PoolFallbackMargin)
	}
	if !validNamespace(c.Namespace) {
		bad("Namespace must be 1-32 of [a-z0-9_-], got %q", c.Namespace)
	}
	for i, k := range c.ExtraDescriptors {
		if !validKey(k) {
			bad("ExtraDescriptors[%d]: %q is not a descriptor key", i, k)
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("admission config: %w", errors.Join(errs...))
	}
	return nil
}

// Option sets an optional dependency of an Engine.
type Option func(*options)

type options struct {
	clock    Clock
	fbClock  Clock
	logger   *zap.Logger
	rand     io.Reader
	registry prometheus.Registerer
}

// WithClock sets the clock for the negative cache, the gateway-local chunks,
// the fallback buckets and the breaker. The store keeps its own clock
// (Redis TIME, or the MemoryStore's clock).
func WithClock(c Clock) Option { return func(o *options) { o.clock = c } }

// WithFallbackClock sets the clock whose wall time places the in-process
// fallback's windows while the store fails: above all a global quota's
// share, spent only Config.PoolFallbackMargin inside each window, which the
// stated bound assumes is the allocator's window. The default is the
// engine's clock (WithClock). The region agent passes its estimate of the
// allocator leader's clock, so that its share follows the allocator's
// windows even when its host's clock is off.
func WithFallbackClock(c Clock) Option { return func(o *options) { o.fbClock = c } }

// WithLogger sets the logger; the default discards everything.
func WithLogger(l *zap.Logger) Option { return func(o *options) { o.logger = l } }

// WithRand sets the source of the random prefix of decision ids; the default
// is crypto/rand.
func WithRand(r io.Reader) Option { return func(o *options) { o.rand = r } }

// WithRegisterer registers the engine's metrics (allot_admission_*) with r.
func WithRegisterer(r prometheus.Registerer) Option { return func(o *options) { o.registry = r } }

func validNamespace(s string) bool {
	if s == "" || len(s) > 32 {
		return false
	}
	for i := 0; i < len(s); i++ {
		if b := s[i]; !(b >= 'a' && b <= 'z' || b >= '0' && b <= '9' || b == '_' || b == '-') {
			return false
		}
	}
	return true
}
