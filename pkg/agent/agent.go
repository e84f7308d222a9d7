package agent

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/redis/go-redis/v9"
	"go.uber.org/zap"
	"golang.org/x/sync/errgroup"

	"github.com/allot-dev/allot/internal/gopool"
	"github.com/allot-dev/allot/internal/pausewatch"
	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/allocator"
	"github.com/allot-dev/allot/pkg/policy"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// Agent is a region agent: it decides requests on the region's Redis with
// the admission engine, keeps the region's leased pools filled from the
// allocator, and follows the allocator's policy. It is safe for concurrent
// use; Run owns its background loops.
type Agent struct {
	cfg    Config
	clock  admission.Clock
	log    *zap.Logger
	m      *metrics
	store  admission.Store
	rstore *admission.RedisStore // the store New made on rdb; nil with WithStore
	rdb    redis.UniversalClient // nil with WithStore
	client *allocator.Client
	owned  bool // client was made by New (and is closed by Run)
	leases *leases
	dlog   *decisionLog
	slots  *slotTable
	items  *gopool.Pool // runs the checks of CheckBatch calls

	engine atomic.Pointer[admission.Engine]
	// unready says why the policy in force makes the agent not ready
	// (Ready): its regions do not include the agent's. Empty otherwise.
	unready atomic.Pointer[string]
	applyMu sync.Mutex
	current atomic.Uint64 // version in force (0: bootstrap or none)
	digest  string        // guarded by applyMu
	engOpts []admission.Option
	// retired are the engines replaced by one of a record adopted from an
	// allocator whose history differs (adoptRecord); guarded by applyMu.
	// Calls that loaded one before the swap finish on it, so one is closed
	// only retireGrace after it was replaced (at the next replacement or
	// release): repeated adoptions keep no more than those of the last
	// retireGrace, and their in-process state, alive.
	retired []retiredEngine
}

// retiredEngine is an engine replaced at at.
type retiredEngine struct {
	eng *admission.Engine
	at  time.Time
}

// retireGrace is how long a replaced engine stays open for the calls that
// loaded it before the swap: far longer than any call takes (the starve
// wait, the store and fail-mode timeouts).
const retireGrace = 5 * time.Minute

// retire keeps eng, replaced now, open for the calls still using it, and
// closes the engines retired retireGrace or more before now. The caller
// holds applyMu.
func (a *Agent) retire(eng *admission.Engine, now time.Time) {
	kept := a.retired[:0]
	for _, r := range a.retired {
		if now.Sub(r.at) >= retireGrace {
			_ = r.eng.Close()
			continue
		}
		kept = append(kept, r)
	}
	clear(a.retired[len(kept):])
	a.retired = append(kept, retiredEngine{eng: eng, at: now})
}

// acquireAttemptTimeout is how long the agent's client waits for one
// endpoint's answer: a third of the Acquire call's bound (at least 100 ms,
// at most the bound), so that a call can try the other endpoints. With the
// client's default (2 s, the default AcquireTimeout) one endpoint that did
// not answer took the whole call and cut the region off, although the
// other allocators would have answered (a chaos run after a partition
// healed: a 2 s attempt on a stalled connection, then 503s until the
// retry).
func acquireAttemptTimeout(call time.Duration) time.Duration {
	return min(max(call/3, 100*time.Millisecond), call)
}

// idleWorker is how long a goroutine that ran a batch's check waits for
// another before it leaves.
const idleWorker = 250 * time.Millisecond

// New returns an agent deciding on the Redis behind rdb (which the caller
// creates and closes), or, with WithStore and a nil rdb, on the given store.
// It puts the last-known-good policy in force when Config.DataDir holds one,
// else Config.PolicyFile or WithPolicy as version 0; with none of them the
// agent is not ready (ErrNotReady) until the allocator's policy arrives in
// Run. New does no network I/O.
func New(cfg Config, rdb redis.UniversalClient, opts ...Option) (*Agent, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	o := options{clock: admission.SystemClock{}, logger: zap.NewNop(), rand: rand.Reader}
	for _, opt := range opts {
		opt(&o)
	}
	switch {
	case rdb == nil && o.store == nil:
		return nil, errors.New("agent: nil redis client (and no WithStore)")
	case rdb != nil && o.store != nil:
		return nil, errors.New("agent: a redis client and WithStore: give one store only")
	}
	var idb [6]byte
	if _, err := io.ReadFull(o.rand, idb[:]); err != nil {
		return nil, fmt.Errorf("agent: instance id: %w", err)
	}
	log := o.logger.Named("agent").With(zap.String("region", cfg.Region))
	if m := cfg.Engine.PoolFallbackMargin; m < cfg.Lease.Margin {
		// The stated bound assumes no process spends a global quota's
		// in-process share nearer a window's edges than the lease margin.
		cfg.Engine.PoolFallbackMargin = cfg.Lease.Margin
		log.Info("the engine's pool fallback margin is raised to the lease margin",
			zap.Duration("pool_fallback_margin", m), zap.Duration("lease_margin", cfg.Lease.Margin))
	}
	salt := cfg.LogSalt
	if salt == "" {
		// A key anyone knows (none) would make the hashes public, and an
		// IPv4 address found again by hashing all 2^32. The salt is a
		// secret, so it comes from crypto/rand, not WithRand's source.
		salt = rand.Text()
		if cfg.DecisionLogSample > 0 {
			log.Info("decision logs hash principals with a random salt of this process: the hashes do not correlate across restarts or agents (set LogSalt, regionagent $ALLOT_LOG_SALT, for that)")
		}
	}
	if _, redisStore := o.store.(*admission.RedisStore); cfg.Engine.KeySalt == "" && (rdb != nil || redisStore) {
		// Not refused: a region already running without a salt would have
		// to start its counters afresh (new key names) to set one.
		log.Warn("Redis key names hash principals without a secret salt: the client addresses and user ids in them can be recovered by hashing candidates (an IPv4 /24 takes 256 tries)",
			zap.String("fix", "set one secret key salt on every agent and gateway of the region: regionagent $ALLOT_KEY_SALT, Go SDK admission.Config.KeySalt; setting or changing it starts every counter afresh (new key names)"))
	}
	var (
		store  = o.store
		rstore *admission.RedisStore
		err    error
	)
	if rdb != nil {
		if rstore, err = admission.NewRedisStore(rdb, cfg.Store, admission.WithRedisLogger(log)); err != nil {
			return nil, err
		}
		store = rstore
	}
	client, owned := o.client, false
	if client == nil && len(cfg.AllocatorEndpoints) > 0 {
		copts := []allocator.ClientOption{allocator.WithAttemptTimeout(acquireAttemptTimeout(cfg.Lease.AcquireTimeout))}
		if len(cfg.AllocatorGRPCEndpoints) > 0 {
			copts = append(copts, allocator.WithGRPCEndpoints(cfg.AllocatorGRPCEndpoints...))
		}
		if client, err = allocator.NewClient(cfg.AllocatorEndpoints, copts...); err != nil {
			if rstore != nil {
				_ = rstore.Close()
			}
			return nil, err
		}
		owned = true
	}
	a := &Agent{
		cfg: cfg, clock: o.clock, log: log, m: newMetrics(), store: store, rstore: rstore, rdb: rdb, client: client, owned: owned,
		dlog:  newDecisionLog(log.Named("decisions"), cfg.DecisionLogSample, salt, cfg.LogClearKeys),
		slots: newSlotTable(cfg.MaxTrackedSlots),
		items: gopool.New(idleWorker),
	}
	made := false
	defer func() {
		if !made {
			_ = a.release() // New failed: free what it made
		}
	}()
	a.leases = newLeases(cfg.Lease, cfg.Region, client, o.clock, log, a.m, hex.EncodeToString(idb[:]),
		newWithdrawer(rdb, cfg.Engine.Namespace), cfg.ShutdownTimeout)
	a.leases.journal = o.observer
	a.engOpts = []admission.Option{admission.WithClock(o.clock), admission.WithLogger(log), admission.WithRand(o.rand),
		// The engine's in-process fallback (a global quota's share while
		// Redis fails) follows the allocator's windows, not this host's clock.
		admission.WithFallbackClock(leaderWall{a.leases})}
	if o.registry != nil {
		a.engOpts = append(a.engOpts, admission.WithRegisterer(&engineRegisterer{reg: o.registry}))
		if err := a.m.register(o.registry, a.leases); err != nil {
			return nil, fmt.Errorf("agent: register metrics: %w", err)
		}
		if rdb != nil {
			if err := o.registry.Register(admission.RedisPoolCollector(rdb)); err != nil {
				return nil, fmt.Errorf("agent: register Redis pool metrics: %w", err)
			}
		}
	}

	rec, err := loadLKG(cfg.DataDir)
	switch {
	case err != nil:
		// A damaged file must not stop the agent: it waits for the
		// allocator instead, as if there were none.
		log.Warn("last-known-good policy ignored", zap.Error(err))
	case rec != nil:
		if err := a.install(rec.doc, rec.version, rec.digest, false); err != nil {
			return nil, fmt.Errorf("agent: last-known-good policy: %w", err)
		}
		log.Info("last-known-good policy in force", zap.Uint64("version", rec.version))
	}
	if a.engine.Load() == nil {
		doc, version := o.doc, o.version
		if doc == nil && cfg.PolicyFile != "" {
			b, err := os.ReadFile(cfg.PolicyFile)
			if err != nil {
				return nil, fmt.Errorf("agent: policy file: %w", err)
			}
			if doc, err = policy.Parse(b); err != nil {
				return nil, fmt.Errorf("agent: policy file %s: %w", cfg.PolicyFile, err)
			}
		}
		if doc != nil {
			if err := a.install(doc, version, policy.Digest(doc), false); err != nil {
				return nil, fmt.Errorf("agent: policy: %w", err)
			}
		}
	}
	if a.engine.Load() == nil && client == nil {
		return nil, fmt.Errorf("%w: no allocator endpoints and no policy (PolicyFile, WithPolicy or a last-known-good one)", ErrConfig)
	}
	made = true
	return a, nil
}

// release closes what the agent made: the engine, the Redis store New
// created, the allocator client New created and the goroutines of
// CheckBatch.
func (a *Agent) release() error {
	if eng := a.engine.Load(); eng != nil {
		_ = eng.Close()
	}
	a.applyMu.Lock()
	for _, r := range a.retired {
		_ = r.eng.Close()
	}
	a.retired = nil
	a.applyMu.Unlock()
	var err error
	if a.rstore != nil {
		err = a.rstore.Close()
	}
	if a.owned {
		a.client.Close()
	}
	// Last: the checks still running end fast on the closed engine.
	a.items.Close()
	return err
}

// install puts doc in force as version: it creates the engine on the first
// policy and swaps the policy atomically afterwards (Engine.Apply), then
// tells the lease manager. An engine takes only newer versions; with
// replace, a version that is not newer than the engine's is put in force by
// a new engine, which replaces the engine in force (a record adopted from
// an allocator whose history differs: adoptRecord).
func (a *Agent) install(doc *policy.Document, version uint64, digest string, replace bool) error {
	a.applyMu.Lock()
	defer a.applyMu.Unlock()
	// The lease manager learns the new quotas before any decision can
	// name them, and forgets removed ones only after the swap.
	a.leases.addQuotas(doc)
	unready := regionUnready(doc, a.cfg.Region, version)
	eng := a.engine.Load()
	switch {
	case eng == nil:
		e, err := admission.New(a.cfg.Engine, a.store, doc, version, a.engOpts...)
		if err != nil {
			a.leases.setPolicy(nil, nil)
			return err
		}
		a.leases.setPolicy(doc, e)
		a.unready.Store(&unready)
		a.engine.Store(e)
	case replace && version <= a.current.Load():
		// The new engine starts with empty in-process state (negative
		// cache, gateway-local chunks, fallback buckets, breakers, its
		// allot_admission_* counters); the counters of the rules and the
		// leased pools live in the store, which it shares. The old one
		// stays open for the calls that loaded it before the swap, until
		// retireGrace has passed (retire).
		e, err := admission.New(a.cfg.Engine, a.store, doc, version, a.engOpts...)
		if err != nil {
			old, _ := eng.Policy()
			a.leases.setPolicy(old, eng)
			return err
		}
		a.leases.setPolicy(doc, e)
		a.unready.Store(&unready)
		a.engine.Store(e)
		a.retire(eng, a.now())
	default:
		if err := eng.Apply(doc, version); err != nil {
			old, _ := eng.Policy()
			a.leases.setPolicy(old, eng)
			return err
		}
		a.leases.setPolicy(doc, eng)
		a.unready.Store(&unready)
	}
	a.current.Store(version)
	a.digest = digest
	a.m.policyVer.Set(float64(version))
	a.logNotLeased(doc, version, unready != "")
	return nil
}

// regionUnready says why doc, in force as version, makes an agent of region
// not ready: doc declares regions and region is not one of them (every
// quota it leases then answers unavailable). Empty when it does not.
func regionUnready(doc *policy.Document, region string, version uint64) string {
	if len(doc.Regions) == 0 || slices.Contains(doc.Regions, region) {
		return ""
	}
	return fmt.Sprintf("region %q is not one of the regions [%s] of policy v%d: check the agent's region (regionagent -region)",
		region, strings.Join(doc.Regions, " "), version)
}

// maxLoggedQuotas is how many quota names logNotLeased names.
const maxLoggedQuotas = 20

// logNotLeased logs, once for each policy version put in force, the leased
// quotas of doc that are not leased to this agent's region: requests they
// deny are answered unavailable (fail_mode_total{mode="refused"}), as no
// renewal can come. foreign is whether the region is none of doc's regions
// (logged then even without such quotas: the agent is not ready).
func (a *Agent) logNotLeased(doc *policy.Document, version uint64, foreign bool) {
	var names []string
	for _, gq := range doc.GlobalQuotas() {
		if !leasedTo(gq, a.cfg.Region) {
			names = append(names, gq.Name)
		}
	}
	if len(names) == 0 && !foreign {
		return
	}
	fields := []zap.Field{zap.Uint64("version", version), zap.Strings("policy_regions", doc.Regions),
		zap.Int("not_leased", len(names)), zap.Strings("quotas", names[:min(len(names), maxLoggedQuotas)])}
	if foreign {
		a.log.Error("this agent's region is not one of the policy's regions (likely a wrong -region): every leased quota is answered unavailable (503), and the agent is not ready",
			fields...)
		return
	}
	a.log.Warn("quotas not leased to this agent's region: requests they deny are answered unavailable (503)", fields...)
}

// applyRecord applies a record received from the allocator: newer versions
// only, digest and document checked, persisted as last-known-good once in
// force. A rejected record leaves the version in force untouched.
func (a *Agent) applyRecord(p *allotv1.PolicyRecord) {
	if p == nil {
		return
	}
	cur := a.current.Load()
	if a.engine.Load() != nil && p.GetVersion() <= cur {
		a.applyMu.Lock()
		same := p.GetVersion() == cur && p.GetDigest() == a.digest
		a.applyMu.Unlock()
		if !same {
			a.m.policyUpd.WithLabelValues("older").Inc()
			a.log.Warn("older policy version rejected", zap.Uint64("version", p.GetVersion()), zap.Uint64("in_force", cur))
		}
		return
	}
	a.takeRecord(p, false)
}

// adoptRecord puts p in force whatever the version in force: the allocator's
// history differs from the one that version came from (see syncRecord), and
// the allocator is the source of truth. It reports whether p is in force.
func (a *Agent) adoptRecord(p *allotv1.PolicyRecord) bool {
	if p == nil {
		return false
	}
	a.applyMu.Lock()
	same := p.GetVersion() == a.current.Load() && p.GetDigest() == a.digest
	a.applyMu.Unlock()
	if same { // the record in force, published again
		return true
	}
	return a.takeRecord(p, true)
}

// takeRecord checks p and puts it in force (with adopt, even when it is not
// newer than the version in force), then saves it as last-known-good. It
// reports whether p is in force.
func (a *Agent) takeRecord(p *allotv1.PolicyRecord, adopt bool) bool {
	cur := a.current.Load()
	rec, err := checkRecord(p.GetVersion(), p.GetDigest(), p.GetDocument())
	if err != nil {
		a.m.policyUpd.WithLabelValues("malformed").Inc()
		a.log.Error("malformed policy rejected; keeping the version in force",
			zap.Uint64("version", p.GetVersion()), zap.Uint64("in_force", cur), zap.Error(err))
		return false
	}
	if err := a.install(rec.doc, rec.version, rec.digest, adopt); err != nil {
		result := "invalid"
		if errors.Is(err, admission.ErrStalePolicy) {
			result = "older"
		}
		a.m.policyUpd.WithLabelValues(result).Inc()
		a.log.Error("policy rejected; keeping the version in force", zap.Uint64("version", rec.version), zap.Error(err))
		return false
	}
	if adopt {
		a.m.policyUpd.WithLabelValues("diverged").Inc()
		a.log.Info("allocator's policy adopted", zap.Uint64("version", rec.version), zap.String("digest", rec.digest[:12]))
	} else {
		a.m.policyUpd.WithLabelValues("applied").Inc()
		a.log.Info("policy applied", zap.Uint64("version", rec.version), zap.String("digest", rec.digest[:12]))
	}
	if err := saveLKG(a.cfg.DataDir, rec, a.clock.Now()); err != nil {
		a.m.policyUpd.WithLabelValues("persist_error").Inc()
		a.log.Error("last-known-good policy not saved", zap.Error(err))
	}
	return true
}

// syncRecord reconciles the version in force with the allocator's current
// record p as GetPolicy answered it when the watch (re)connects (nil: the
// allocator has published none), and returns the version to watch after
// and whether to adopt the first record the watch brings (adoptRecord).
//
// The allocator is the source of truth. A current record older than the
// version in force, the same version with another digest, or none at all
// while a published version is in force, means that the allocator's
// history differs from the one the version in force came from: its
// cluster was rebuilt (state lost, policies published again from v1) or
// restored from an older backup, and the agent kept that version in its
// last-known-good file or in memory. Left alone, the agent would reject the
// allocator's versions up to its own as older and never see the one that
// shares its number, deciding under a document the allocator does not have
// while reporting the allocator's version number. So the agent logs an
// error and adopts the allocator's record, then watches from it.
//
// A node that is merely behind must not look like that, and cannot:
// GetPolicy is a leader read. The allocator answers it on the leader only,
// after a Raft barrier (pkg/allocator, Server.GetPolicy through leaderRead;
// a follower forwards the call, and a leader that lost its quorum cannot
// pass the barrier), so the answer includes every version the cluster has
// committed. Every version the agent had in force came from the allocator
// as a committed record: from GetPolicy, or from WatchPolicy, which a
// follower may serve but only with the records it applied, which are
// committed ones; the last-known-good file holds such a record. So in the
// same history the leader's answer is never older than the version in
// force, and a version number never names two digests. Only GetPolicy's
// answer is acted on so: the records of the stream, which a lagging
// follower may serve, are taken only when newer (applyRecord). The one
// exception is the first record streamed after GetPolicy found none
// published: the leader confirmed the history empty, so every record of
// the stream belongs to the history that started after it. (Allocators of
// builds before leader reads took a barrier answered GetPolicy from a
// leader's state as applied, which right after an election can be behind:
// against those, an agent could adopt an older version for as long as its
// stream takes to bring the newer ones again.)
func (a *Agent) syncRecord(p *allotv1.PolicyRecord) (after uint64, adopt bool) {
	a.applyMu.Lock()
	cur, digest := a.current.Load(), a.digest
	a.applyMu.Unlock()
	switch {
	case cur == 0: // no policy in force, or a local one (version 0): no history to differ from
		a.applyRecord(p)
	case p == nil:
		a.log.Error("the allocator's policy history differs from this agent's last-known-good (a rebuilt allocator cluster?): it has no policy, and the version in force was published by one; keeping that version until the allocator publishes one, which replaces it",
			zap.Uint64("in_force", cur), zap.String("digest", digest[:min(len(digest), 12)]))
		return 0, true
	case p.GetVersion() > cur:
		a.applyRecord(p)
	case p.GetVersion() == cur && p.GetDigest() == digest:
		// the same history
	default:
		a.log.Error("the allocator's policy history differs from this agent's last-known-good (a rebuilt allocator cluster, or one restored from an older backup?): adopting the allocator's current version, the source of truth",
			zap.Uint64("in_force", cur), zap.String("digest", digest[:min(len(digest), 12)]),
			zap.Uint64("allocator_version", p.GetVersion()), zap.String("allocator_digest", p.GetDigest()[:min(len(p.GetDigest()), 12)]))
		a.adoptRecord(p)
	}
	return a.current.Load(), false
}

// Run follows the policy and renews leases until ctx ends; then it hands
// the unspent tokens it deposited back to the allocator (within
// Config.ShutdownTimeout) and closes the engine and the Redis store (a store
// given with WithStore is the caller's to close). Call it once.
func (a *Agent) Run(ctx context.Context) error {
	if a.rstore != nil {
		if err := a.rstore.Load(ctx); err != nil {
			a.log.Warn("admission script not preloaded (it loads on first use)", zap.Error(err))
		}
	}
	g, gctx := errgroup.WithContext(ctx)
	if a.client != nil {
		w := &watcher{
			client: a.client, log: a.log.Named("policy"), backoff: a.cfg.WatchBackoff, max: a.cfg.MaxWatchBackoff,
			sync: a.syncRecord, apply: a.applyRecord, adopt: a.adoptRecord,
		}
		g.Go(func() error { return w.Run(gctx) })
	}
	g.Go(func() error { return a.leases.Run(gctx) })
	g.Go(func() error {
		return pausewatch.Run(gctx, pausewatch.Config{Histogram: a.m.pauses, OnPause: pausewatch.LogTo(a.log)})
	})
	err := g.Wait()
	return errors.Join(err, a.release())
}

// Ready reports whether the agent is ready to serve: a policy is in force,
// and when that policy declares regions, the agent's region is one of them.
func (a *Agent) Ready() bool { return a.NotReadyReason() == "" }

// NotReadyReason says why the agent is not ready (Ready); "" when it is.
func (a *Agent) NotReadyReason() string {
	if a.engine.Load() == nil {
		return "no policy in force yet"
	}
	if p := a.unready.Load(); p != nil {
		return *p
	}
	return ""
}

// PolicyVersion returns the version in force (0 for a local policy or
// none).
func (a *Agent) PolicyVersion() uint64 { return a.current.Load() }

// Engine returns the admission engine, nil before the first policy.
func (a *Agent) Engine() *admission.Engine { return a.engine.Load() }

// Leases returns the state of every leased quota of this region.
func (a *Agent) Leases() []QuotaStatus { return a.leases.Status() }

// CutOff reports whether the allocator is unreachable (the last Acquire
// failed) or absent.
func (a *Agent) CutOff() bool { return a.leases.CutOff() }

// Renew runs one round of the lease manager now (Run does it every tick).
// It is for tests and tools that drive the agent without Run.
func (a *Agent) Renew(ctx context.Context) { a.leases.Tick(ctx) }

// now is the agent's clock.
func (a *Agent) now() time.Time { return a.clock.Now() }
