package agent

import (
	"errors"
	"fmt"
	"io"
	"math"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/allot-dev/allot/fsm"
	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/allocator"
	"github.com/allot-dev/allot/pkg/policy"
)

// Config configures a region agent. DefaultConfig works once Region and
// AllocatorEndpoints (or, standalone, PolicyFile or WithPolicy) are set.
type Config struct {
	// Region is the region this agent leases global quotas for ("eu"). The
	// allocator refuses a region the policy does not declare for a quota.
	Region string
	// AllocatorEndpoints are API addresses of allocator nodes; the client
	// fails over between them and follows leader hints. Empty runs the agent
	// standalone on PolicyFile: no policy watch and no leases, so a global
	// quota spends only its fallback allowance and then answers unavailable.
	AllocatorEndpoints []string
	// AllocatorGRPCEndpoints, when set, are the allocator nodes' gRPC
	// listeners (allocator -grpc-addr): Acquire and Release go there over
	// grpc-go, the cheaper transport, while the policy watch stays on
	// AllocatorEndpoints. It needs AllocatorEndpoints.
	AllocatorGRPCEndpoints []string
	// DataDir holds the last-known-good policy (policy.json), so a restarted
	// agent decides under the version it last accepted even when the
	// allocator is unreachable. Empty keeps it in memory only.
	DataDir string
	// PolicyFile is a policy (YAML or JSON) put in force as version 0 when
	// there is no last-known-good one; any published version replaces it.
	PolicyFile string
	// Engine configures the admission engine. DefaultConfig turns its
	// negative cache off: a pool denied for lack of leased tokens must be
	// spendable the moment a renewal lands (see doc.go).
	//
	// Engine.KeySalt is the secret mixed into the hashes of principals
	// (client addresses, user ids) in the store's key names. Every agent and
	// gateway sharing the region's Redis must use the same one, or their
	// counters split silently; changing it starts every counter afresh (new
	// key names). Empty, anyone who can list the keys recovers principals
	// by hashing candidates, so New warns once when it is empty with a
	// Redis store (not with the embedded one: its keys never leave the
	// process). regionagent reads it from $ALLOT_KEY_SALT.
	//
	// Engine.PoolFallbackMargin is raised to Lease.Margin when smaller: the
	// stated bound assumes no process spends a global quota's in-process
	// fallback share nearer a window's edges than the lease margin.
	Engine admission.Config
	// Store configures the Redis store: its auto-batcher and the form of
	// counter state it writes. The default is DefaultStoreConfig.
	Store admission.RedisConfig
	// Lease configures the lease manager.
	Lease LeaseConfig
	// MaxRequestBytes caps one Check, CheckBatch (the whole batch),
	// ReleaseSlot or ShouldRateLimit message; larger ones are refused with
	// ResourceExhausted (pkg/checkclient then splits a refused batch).
	MaxRequestBytes int
	// StarveWait is the longest a request denied only for lack of leased
	// tokens waits for a renewal the agent has asked for, before it is
	// answered unavailable. It never applies to an exhausted pool (429 at
	// once) or while the allocator is unreachable (503 at once).
	StarveWait time.Duration
	// EnvoyDomain, when set, is the only rate limit domain ShouldRateLimit
	// accepts; others are InvalidArgument.
	EnvoyDomain string
	// EnvoyRequestIDKey, when set, is the descriptor key whose value
	// ShouldRateLimit takes as the request id (idempotency and the names of
	// concurrency slots) instead of a descriptor entry; RequestIDKey is the
	// suggested value. Empty (the default) takes no request id from Envoy:
	// an entry with that key is a descriptor entry like any other. Set it
	// only when the value is generated per request by your own edge, never
	// taken from clients: a repeated id is replayed (admitted again without
	// being charged) and shares the first request's concurrency slots.
	// Envoy regenerates x-request-id for requests it classes as external,
	// unless preserve_external_request_id is set; which requests are external
	// depends on use_remote_address and internal_address_config (Envoy's
	// "HTTP header sanitizing"). Where clients' x-request-id can reach the
	// agent, leave this empty.
	EnvoyRequestIDKey string
	// MaxTrackedSlots bounds the decisions holding concurrency slots that the
	// agent remembers for ReleaseSlot; beyond it ReleaseSlot frees the slots
	// in the store by request id (slots taken by a fail-mode fallback then
	// free themselves only after their rule's slot_ttl).
	MaxTrackedSlots int
	// DecisionLogSample is the fraction of decisions logged, in [0, 1],
	// chosen by a hash of the decision id.
	DecisionLogSample float64
	// LogSalt keys the hash (HMAC-SHA-256) of descriptor values in decision
	// logs. Empty, each agent draws a random salt when it starts: its hashes
	// then match no other agent's, nor its own after a restart. Set it,
	// and keep it secret, to follow a principal across agents and restarts.
	// regionagent reads it from $ALLOT_LOG_SALT.
	LogSalt string
	// LogClearKeys are the descriptor keys logged in clear; every other
	// value (users, addresses, keys) is logged as a salted hash.
	LogClearKeys []string
	// WatchBackoff is the first pause before re-opening a failed policy
	// watch; it doubles up to MaxWatchBackoff.
	WatchBackoff, MaxWatchBackoff time.Duration
	// ShutdownTimeout bounds handing unspent tokens back when Run ends,
	// counted from the end of Run's context (the lease round then in
	// progress shares it).
	ShutdownTimeout time.Duration
}

// LeaseConfig configures the lease manager.
type LeaseConfig struct {
	// Tick is how often the manager runs a round: it reads the pools that
	// are due and sends one batched Acquire for those under their low
	// watermark. Rounds never run more often, so a request starved of
	// leased tokens waits up to a Tick (plus the Acquire) for its renewal.
	Tick time.Duration
	// Lead is how long before a pool runs dry, at its measured demand, the
	// agent renews: the low watermark is demand x Lead. A pool whose grants
	// are spendable for less than about two Leads uses a shorter one
	// (lease.LeadWithin), or it would hold tokens it cannot spend in time.
	Lead time.Duration
	// MinChunk is the smallest chunk asked for (the policy's chunk is the
	// largest).
	MinChunk int64
	// Margin is subtracted from every lease deadline. It must cover the
	// clock drift over a TTL and the skew between allocator leaders, and
	// should equal the allocator's -lease-margin, which the stated bound
	// assumes. An allocator that states its margin in its Acquire answers
	// (lease_margin_ms) and states a larger one is followed: deadlines use
	// the larger of the two from then on, and the agent warns.
	Margin time.Duration
	// MaxDriftPPM is the assumed maximum rate error of the agent's clock
	// against the allocator leader's, in parts per million (the bound's
	// assumption: pkg/bound Config.MaxDriftPPM). While cut off, the agent
	// places the leader's windows by the monotonic time since its last
	// measurement of the leader's clock, and widens that estimate by this
	// much of the time elapsed: a fallback allowance is deposited only
	// where the estimate is surely inside its window. A pre-grant opens
	// that much of its lead later too (lease.NotBeforeDrift).
	MaxDriftPPM int64
	// MinStoreDelay is the floor of the agent-to-Redis delay subtracted
	// from a deposit's TTL (the measured delay is used when larger).
	MinStoreDelay time.Duration
	// MinUsefulTTL is the shortest deposit worth making; a grant that would
	// live less in the store is handed back to the allocator instead.
	MinUsefulTTL time.Duration
	// DepositTimeout is the shortest bound on one deposit attempt (four
	// times the measured store delay when larger). A chunk's store TTL
	// leaves that much of its lease unused, so a deposit that lands within
	// the bound never outlives its lease; one that takes longer is settled
	// by withdrawing the grant, and only what is certainly out of the store
	// is handed back. Raise it where store calls are slow (a loaded
	// machine); it costs each chunk that much of its life.
	DepositTimeout time.Duration
	// AcquireTimeout bounds one Acquire call, failover and retries included.
	// One attempt on one allocator endpoint gets a third of it
	// (acquireAttemptTimeout), so an endpoint that does not answer (a
	// connection a partition left half-dead, a stopped node) leaves time to
	// fail over to the others within the call.
	AcquireTimeout time.Duration
	// IdlePoll is how often a pool without demand is looked at.
	IdlePoll time.Duration
	// BoundaryDelay is how long after a window's estimated end the pools
	// with demand are renewed from the new window.
	BoundaryDelay time.Duration
	// PregrantLead is how long before a window's estimated end a pool with
	// demand and clamp on asks for a chunk of the next window (a pre-grant,
	// spendable from that window's start), so the region holds tokens the
	// moment the window turns instead of an Acquire round trip and a tick
	// later. At most a quarter of the window; 0 turns pre-grants off.
	PregrantLead time.Duration
	// ExhaustedRecheck is how often an exhausted pool with starved demand is
	// asked for again (another region may have handed tokens back).
	ExhaustedRecheck time.Duration
	// DemandHalfLife is the half-life of the demand estimate (tokens per
	// second consumed plus requests starved for lack of tokens, by cost).
	DemandHalfLife time.Duration
	// MaxWantsPerCall is the most quotas one Acquire carries, at most
	// fsm.MaxWants (the allocator's own limit may be lower: a call it
	// refuses as too large is split, and later calls carry what it takes);
	// more quotas due in one tick take more calls.
	MaxWantsPerCall int
	// StoreParallelism is how many store calls (pool reads, deposits) the
	// manager runs at once.
	StoreParallelism int
	// QuarantineTime is how long a quota the allocator refuses (unknown,
	// region not declared) is left out of Acquire calls. Meanwhile a request
	// its pool cannot serve is answered unavailable at once, with a retry
	// after the rest of the quarantine, instead of waiting StarveWait.
	QuarantineTime time.Duration
}

// DefaultStoreConfig is the agent's Redis store: the SDK's defaults
// (admission.DefaultRedisConfig), except that while pipelines are in flight
// a partial batch waits for them to return, up to 300 µs, instead of taking
// a free pipeline slot at once. An agent decides for many gateways at once:
// under load its batches grow and Redis and the agent spend less CPU per
// decision (2026-12-03, docs/agent-bench.md: ~1.5 µs less Redis CPU per
// decision); a lone call still goes out at once.
func DefaultStoreConfig() admission.RedisConfig {
	c := admission.DefaultRedisConfig()
	c.BatchDelay = 300 * time.Microsecond
	return c
}

// DefaultConfig returns the defaults: a 100 ms tick, renewals 1 s ahead of
// demand, a 250 ms lease margin (the allocator's default), 2 s Acquire
// timeout, a 1 s starve wait (a cold pool, or one at a window's turn, waits
// a tick plus an Acquire plus the margin), 64 KiB requests, 1% of decisions
// logged.
func DefaultConfig() Config {
	eng := admission.DefaultConfig()
	eng.NegativeCacheTTL = 0
	return Config{
		Engine:            eng,
		Store:             DefaultStoreConfig(),
		Lease:             DefaultLeaseConfig(),
		MaxRequestBytes:   64 << 10,
		StarveWait:        time.Second,
		MaxTrackedSlots:   100_000,
		DecisionLogSample: 0.01,
		LogClearKeys:      []string{"tenant", "route", "auth"},
		WatchBackoff:      100 * time.Millisecond,
		MaxWatchBackoff:   5 * time.Second,
		ShutdownTimeout:   3 * time.Second,
	}
}

// DefaultLeaseConfig returns the lease manager's defaults.
func DefaultLeaseConfig() LeaseConfig {
	return LeaseConfig{
		Tick:             100 * time.Millisecond,
		Lead:             time.Second,
		MinChunk:         1,
		Margin:           250 * time.Millisecond,
		MaxDriftPPM:      200,
		MinStoreDelay:    time.Millisecond,
		MinUsefulTTL:     20 * time.Millisecond,
		DepositTimeout:   50 * time.Millisecond,
		AcquireTimeout:   2 * time.Second,
		IdlePoll:         time.Second,
		BoundaryDelay:    5 * time.Millisecond,
		PregrantLead:     time.Second,
		ExhaustedRecheck: time.Second,
		DemandHalfLife:   time.Second,
		MaxWantsPerCall:  16_384, // the allocator's default: one Acquire per tick
		StoreParallelism: 32,
		QuarantineTime:   5 * time.Second,
	}
}

// ErrConfig marks an invalid configuration.
var ErrConfig = errors.New("invalid agent config")

// Validate says what is wrong with c, naming every bad field, or returns nil.
func (c Config) Validate() error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if c.Region == "" || len(c.Region) > policy.MaxRegionLen {
		bad("Region must be 1-%d bytes, got %q", policy.MaxRegionLen, c.Region)
	}
	for i, e := range c.AllocatorEndpoints {
		if e == "" {
			bad("AllocatorEndpoints[%d] is empty", i)
		}
	}
	for i, e := range c.AllocatorGRPCEndpoints {
		if e == "" {
			bad("AllocatorGRPCEndpoints[%d] is empty", i)
		}
	}
	if len(c.AllocatorGRPCEndpoints) > 0 && len(c.AllocatorEndpoints) == 0 {
		bad("AllocatorGRPCEndpoints needs AllocatorEndpoints (the policy watch uses the Connect API)")
	}
	if err := c.Engine.Validate(); err != nil {
		bad("Engine: %w", err)
	}
	if err := c.Store.Validate(); err != nil {
		bad("Store: %w", err)
	}
	if err := c.Lease.Validate(); err != nil {
		bad("Lease: %w", err)
	}
	if c.MaxRequestBytes < 1024 || c.MaxRequestBytes > 16<<20 {
		bad("MaxRequestBytes must be in [1KiB, 16MiB], got %d", c.MaxRequestBytes)
	}
	if c.StarveWait < 0 || c.StarveWait > 10*time.Second {
		bad("StarveWait must be in [0, 10s], got %s", c.StarveWait)
	}
	if c.MaxTrackedSlots < 0 {
		bad("MaxTrackedSlots must not be negative, got %d", c.MaxTrackedSlots)
	}
	if !(c.DecisionLogSample >= 0 && c.DecisionLogSample <= 1) {
		bad("DecisionLogSample must be in [0, 1], got %v", c.DecisionLogSample)
	}
	if c.WatchBackoff <= 0 || c.MaxWatchBackoff < c.WatchBackoff {
		bad("WatchBackoff must be positive and at most MaxWatchBackoff, got %s and %s", c.WatchBackoff, c.MaxWatchBackoff)
	}
	if c.ShutdownTimeout <= 0 {
		bad("ShutdownTimeout must be positive, got %s", c.ShutdownTimeout)
	}
	if len(errs) > 0 {
		return fmt.Errorf("%w: %w", ErrConfig, errors.Join(errs...))
	}
	return nil
}

// Validate says what is wrong with c, or returns nil.
func (c LeaseConfig) Validate() error {
	var errs []error
	bad := func(format string, args ...any) { errs = append(errs, fmt.Errorf(format, args...)) }
	if c.Tick < time.Millisecond {
		bad("Tick must be at least 1ms, got %s", c.Tick)
	}
	if c.Lead <= 0 {
		bad("Lead must be positive, got %s", c.Lead)
	}
	if c.MinChunk < 1 || c.MinChunk > policy.MaxAmount {
		bad("MinChunk must be in [1, %d], got %d", int64(policy.MaxAmount), c.MinChunk)
	}
	if c.Margin < 0 {
		bad("Margin must not be negative, got %s", c.Margin)
	}
	if c.MaxDriftPPM < 0 || c.MaxDriftPPM >= 1_000_000 {
		bad("MaxDriftPPM must be in [0, 1000000), got %d", c.MaxDriftPPM)
	}
	if c.MinStoreDelay < 0 {
		bad("MinStoreDelay must not be negative, got %s", c.MinStoreDelay)
	}
	if c.MinUsefulTTL < time.Millisecond {
		bad("MinUsefulTTL must be at least 1ms, got %s", c.MinUsefulTTL)
	}
	if c.DepositTimeout < time.Millisecond || c.DepositTimeout > 10*time.Second {
		bad("DepositTimeout must be in [1ms, 10s], got %s", c.DepositTimeout)
	}
	if c.AcquireTimeout <= 0 {
		bad("AcquireTimeout must be positive, got %s", c.AcquireTimeout)
	}
	if c.IdlePoll < c.Tick {
		bad("IdlePoll must be at least Tick (%s), got %s", c.Tick, c.IdlePoll)
	}
	if c.BoundaryDelay < 0 {
		bad("BoundaryDelay must not be negative, got %s", c.BoundaryDelay)
	}
	if c.PregrantLead < 0 || c.PregrantLead > time.Minute {
		bad("PregrantLead must be in [0, 1m], got %s", c.PregrantLead)
	}
	if c.ExhaustedRecheck <= 0 {
		bad("ExhaustedRecheck must be positive, got %s", c.ExhaustedRecheck)
	}
	if c.DemandHalfLife <= 0 {
		bad("DemandHalfLife must be positive, got %s", c.DemandHalfLife)
	}
	if c.MaxWantsPerCall < 1 || c.MaxWantsPerCall > fsm.MaxWants {
		bad("MaxWantsPerCall must be in [1, %d] (no allocator takes more), got %d", fsm.MaxWants, c.MaxWantsPerCall)
	}
	if c.StoreParallelism < 1 || c.StoreParallelism > 1024 {
		bad("StoreParallelism must be in [1, 1024], got %d", c.StoreParallelism)
	}
	if c.QuarantineTime <= 0 {
		bad("QuarantineTime must be positive, got %s", c.QuarantineTime)
	}
	return errors.Join(errs...)
}

// Option sets an optional dependency of an Agent.
type Option func(*options)

type options struct {
	clock    admission.Clock
	logger   *zap.Logger
	registry prometheus.Registerer
	rand     io.Reader
	client   *allocator.Client
	doc      *policy.Document
	version  uint64
	store    admission.Store
	observer LeaseObserver
}

// WithClock sets the clock of the agent and its engine (monotonic readings
// are required: lease deadlines are measured on it).
func WithClock(c admission.Clock) Option { return func(o *options) { o.clock = c } }

// WithLogger sets the logger; the default discards everything.
func WithLogger(l *zap.Logger) Option { return func(o *options) { o.logger = l } }

// WithRegisterer registers the agent's metrics (allot_agent_*) and the
// engine's (allot_admission_*) with r.
func WithRegisterer(r prometheus.Registerer) Option { return func(o *options) { o.registry = r } }

// WithRand sets the source of the agent's instance id (in Acquire request
// ids) and of the engine's decision ids; the default is crypto/rand.
func WithRand(r io.Reader) Option { return func(o *options) { o.rand = r } }

// WithAllocatorClient sets the allocator client instead of one built from
// Config.AllocatorEndpoints.
func WithAllocatorClient(c *allocator.Client) Option { return func(o *options) { o.client = c } }

// WithPolicy puts doc in force as version when there is no last-known-good
// policy, like Config.PolicyFile, for a document built in code.
func WithPolicy(doc *policy.Document, version uint64) Option {
	return func(o *options) { o.doc, o.version = doc, version }
}

// WithStore makes the agent decide on s (for example the embedded
// admission.MemoryStore, for a region without Redis) instead of a Redis
// client: New's rdb must then be nil. s is the caller's to close. Without a
// Redis client the agent cannot withdraw its deposited tokens when it stops,
// so it hands none back to the allocator: they stay in s until their leases
// end (stranded, never spent twice). ReleaseSlot goes through the engine.
func WithStore(s admission.Store) Option { return func(o *options) { o.store = s } }

// halfLifeAlpha returns the EWMA weight of a sample dt after the previous
// one, for half-life h.
func halfLifeAlpha(dt, h time.Duration) float64 {
	if dt <= 0 {
		return 0
	}
	return 1 - math.Exp2(-dt.Seconds()/h.Seconds())
}
