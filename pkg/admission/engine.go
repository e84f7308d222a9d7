package admission

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/allot-dev/allot/pkg/policy"
)

// Engine decides requests against one policy version at a time. It is safe
// for concurrent use. The store is shared; the engine owns the in-process
// parts: the negative cache, the gateway-local chunks, the fallback buckets
// and the circuit breakers (one per shard of the store: per master on
// Redis Cluster, else one).
type Engine struct {
	cfg   Config
	store Store
	clock Clock
	// fbClock places the in-process fallback's windows (WithFallbackClock);
	// nil: clock.
	fbClock Clock
	log     *zap.Logger
	hash    hasher
	start   time.Time

	snap    atomic.Pointer[snapshot]
	applyMu sync.Mutex
	chunks  map[string]*localChunk // by rule digest; guarded by applyMu

	neg *negCache    // nil when disabled
	ids *admittedIDs // ids admitted recently; nil without negative cache or idempotency
	// brks[i] is the circuit breaker of the store's shard i (Store.shard):
	// a node that fails opens its own, and the others' calls go on.
	brks [maxShards]breaker
	fb   *fallback

	idPrefix string
	idSeq    atomic.Uint64

	closed atomic.Bool
	done   chan struct{} // closed by Close: background work stops
	m      counters

	orphans atomic.Int64 // late-slot releases scheduled and not yet done

	ops sync.Pool // of *op whose store calls completed: reused by decideOp

	// storeClock makes the engine pass its own clock to the store instead of
	// letting the store read Redis TIME. Only tests set it (export_test.go),
	// so that one fake clock drives every backend.
	storeClock bool
}

// New returns an engine deciding with doc as policy version version.
func New(cfg Config, store Store, doc *policy.Document, version uint64, opts ...Option) (*Engine, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if store == nil {
		return nil, errors.New("admission: nil store")
	}
	o := options{clock: SystemClock{}, logger: zap.NewNop(), rand: rand.Reader}
	for _, opt := range opts {
		opt(&o)
	}
	var seed [4]byte
	if _, err := io.ReadFull(o.rand, seed[:]); err != nil {
		return nil, fmt.Errorf("admission: decision id seed: %w", err)
	}
	e := &Engine{
		cfg:      cfg,
		store:    store,
		clock:    o.clock,
		fbClock:  o.fbClock,
		log:      o.logger.Named("admission"),
		hash:     hasher{ns: cfg.Namespace, salt: cfg.KeySalt, cache: newKeyCache(cfg.KeyCacheSize)},
		start:    o.clock.Now(),
		chunks:   make(map[string]*localChunk),
		fb:       newFallback(cfg.FallbackKeys),
		idPrefix: "d-" + hex.EncodeToString(seed[:]) + "-",
		done:     make(chan struct{}),
	}
	for i := range e.brks {
		e.brks[i].threshold = int64(cfg.BreakerFailures)
		e.brks[i].cooldown = cfg.BreakerCooldown.Nanoseconds()
	}
	if cfg.NegativeCacheTTL > 0 {
		e.neg = newNegCache(cfg.NegativeCacheSize)
		if cfg.IdempotencyTTL > 0 {
			e.ids = newAdmittedIDs()
		}
	}
	if err := e.Apply(doc, version); err != nil {
		return nil, err
	}
	if o.registry != nil {
		if err := o.registry.Register(&collector{e: e}); err != nil {
			return nil, fmt.Errorf("admission: register metrics: %w", err)
		}
	}
	return e, nil
}

// Apply makes doc, as version, the policy for every later decision. It
// swaps the whole compiled snapshot atomically, so each decision sees one
// coherent version. It rejects a version that is not newer than the one in
// force (ErrStalePolicy) and an invalid document (ErrInvalidPolicy); either
// way the previous version stays in force (last-known-good). Counters of
// rules whose identity did not change carry over.
func (e *Engine) Apply(doc *policy.Document, version uint64) error {
	e.applyMu.Lock()
	defer e.applyMu.Unlock()
	if cur := e.snap.Load(); cur != nil && version <= cur.version {
		return fmt.Errorf("%w: version %d is not newer than %d", ErrStalePolicy, version, cur.version)
	}
	s, err := compile(doc, version, &e.cfg)
	if err != nil {
		return err
	}
	live := make(map[string]*localChunk)
	for _, sp := range s.specs {
		if !sp.local {
			continue
		}
		c := e.chunks[sp.digest]
		if c == nil {
			c = &localChunk{}
		}
		live[sp.digest] = c
		sp.chunk = c
	}
	e.chunks = live
	e.snap.Store(s)
	if len(s.floored) > 0 {
		e.log.Warn("fallback share under one request per gateway, raised to one: during an outage the fleet may admit up to one request per gateway where the rule allows fewer",
			zap.Strings("rules", s.floored), zap.Int("gateways", e.cfg.Gateways), zap.Uint64("version", version))
	}
	if len(s.narrow) > 0 {
		e.log.Warn("global quotas whose in-process fallback answers 503 for over a quarter of each window while the store fails: "+
			"their share is spent only pool_fallback_margin inside each window (the bound's store_fallback term assumes it); longer windows lose less",
			zap.Strings("rules", s.narrow), zap.Duration("pool_fallback_margin", e.cfg.PoolFallbackMargin), zap.Uint64("version", version))
	}
	return nil
}

// Policy returns the document and version in force.
func (e *Engine) Policy() (*policy.Document, uint64) {
	s := e.snap.Load()
	return s.doc, s.version
}

// Close makes later calls fail with ErrClosed. The store is not closed: its
// owner closes it.
func (e *Engine) Close() error {
	if e.closed.CompareAndSwap(false, true) {
		close(e.done)
	}
	return nil
}

// mono returns now on the engine's monotonic clock, in nanoseconds.
func (e *Engine) mono(now time.Time) int64 { return now.Sub(e.start).Nanoseconds() }

// storeNow is the time passed to the store: 0 (the store's clock, Redis
// TIME) except in tests.
func (e *Engine) storeNow(now time.Time) int64 {
	if e.storeClock {
		return now.UnixMilli()
	}
	return 0
}

// newID returns the next decision id: one allocation, the id itself (a
// concatenation with strconv.FormatUint made a second string for the
// number first).
func (e *Engine) newID() string {
	var buf [64]byte
	b := append(buf[:0], e.idPrefix...)
	return string(strconv.AppendUint(b, e.idSeq.Add(1), 36))
}

// item is one matched rule of a request being decided.
type item struct {
	sp    *spec
	key   string // counter key; the pool's sorted set for a pool
	poolH string // a pool's hash
	hash  uint64 // negative cache and fallback key
	tag   string
	cost  int64
	res   *RuleResult // in the decision's Rules
	spent *chunkState // local chunk spend, for a refund
}

// group is a set of items decided together: one store call for the rules
// sharing a hash tag, or one gateway-local chunk.
type group struct {
	tag    string
	idx    []int
	local  bool
	op     *op        // the store call, for a refund
	fb     []*fbState // fallback debits, for a refund
	fbIdx  []int
	fbAt   int64 // wall ms of the fallback debits
	replay bool
	shard  int // the store's shard of the group's keys, once a call was tried: its breaker quotes a 503's Retry-After
}

// Decide answers req. It returns an error only for bad input (wrapping
// ErrInvalidRequest; nothing is debited) or after Close. Store trouble is
// never an error here: each rule's fail mode decides, within
// Config.StoreTimeout, and the decision says so.
func (e *Engine) Decide(ctx context.Context, req *Request) (*Decision, error) {
	b := new(decision1) // a one-rule decision is one allocation
	b.d.Rules = b.results[:0]
	if err := e.DecideInto(ctx, req, &b.d); err != nil {
		return nil, err
	}
	return &b.d, nil
}

// DecideInto is Decide writing the decision into d, which the caller owns:
// a gateway that reuses one Decision per worker makes no garbage for it
// (its Rules slice is reused when it has room). Whatever d held is
// overwritten, so release a decision's slots (HasSlots) before reusing it.
// On error d is unspecified.
func (e *Engine) DecideInto(ctx context.Context, req *Request, d *Decision) error {
	if e.closed.Load() {
		return ErrClosed
	}
	if d == nil {
		return fmt.Errorf("decision: nil: %w", ErrInvalidRequest)
	}
	snap := e.snap.Load()
	var ibuf [4]item // a small decision's items stay on the stack
	items, results, err := e.plan(snap, req, ibuf[:0], d.Rules[:0])
	if err != nil {
		return err
	}
	*d = Decision{PolicyVersion: snap.version, Remaining: -1, Source: SourceNone, Rules: results}
	e.m.decisions.Add(1)
	if len(items) == 0 {
		d.ID = e.newID()
		e.m.allowed.Add(1)
		return nil
	}
	now := e.clock.Now()
	mono := e.mono(now)

	// A key denied a moment ago is denied again without a store call,
	// unless the request is the retry of one admitted here: the store
	// replays that admission.
	if e.neg != nil {
		for i := range items {
			it := &items[i]
			if it.sp.shadow || it.sp.kind == kindSlots {
				continue
			}
			if retryAt, ok := e.neg.get(it.hash, mono); ok {
				if e.admittedHere(req, mono) {
					break
				}
				e.m.negHits.Add(1)
				d.ID = e.newID()
				d.Source = SourceNegativeCache
				it.res.Allowed = false
				it.res.RetryAfter = retrySeconds(retryAt, mono)
				e.finish(d, items, results, i, Deny, it.res.RetryAfter)
				return nil
			}
		}
	}
	d.ID = e.newID()
	member := req.RequestID
	if member == "" {
		member = d.ID
	}
	var gbuf [2]group
	groups := groupItems(gbuf[:0], items)
	defer e.recycle(groups)
	d.Source = SourceLocal
	// deferred is a gateway-local chunk's denial of the retry of a request
	// admitted here, held back while the store groups are decided: one of
	// them replays the earlier admission, or the denial stands.
	deferred := struct {
		on    bool
		deny  int
		retry int64
	}{}
	for gi := range groups {
		g := &groups[gi]
		var (
			outcome Outcome
			deny    int
			retry   int64
		)
		if g.local {
			deny = g.idx[0]
			outcome, retry = e.runLocal(ctx, g, items, now, mono)
			if outcome == Deny && !deferred.on && hasStoreGroup(groups) && e.admittedHere(req, mono) {
				deferred.on, deferred.deny, deferred.retry = true, deny, retry
				continue
			}
		} else {
			outcome, deny, retry = e.runStore(ctx, g, items, req, d, member, now, mono)
		}
		if outcome != Allow {
			if deferred.on { // the first denial in order
				outcome, deny, retry = Deny, deferred.deny, deferred.retry
			}
			e.compensate(groups[:gi], items, mono)
			e.finish(d, items, results, deny, outcome, retry)
			return nil
		}
	}
	replayed := false
	for gi := range groups {
		if groups[gi].replay {
			// The earlier decision already spent the local chunks.
			for _, lg := range groups {
				if lg.local {
					it := &items[lg.idx[0]]
					it.sp.chunk.refund(it.spent, mono, it.cost)
				}
			}
			d.Source = SourceReplay
			e.m.replays.Add(1)
			replayed = true
			break
		}
	}
	if deferred.on {
		if !replayed { // no earlier admission to replay: the chunk's denial stands
			e.compensate(groups, items, mono)
			e.finish(d, items, results, deferred.deny, Deny, deferred.retry)
			return nil
		}
		it := &items[deferred.deny] // admitted by the replayed decision
		it.res.Allowed, it.res.Remaining, it.res.RetryAfter = true, -1, 0
	}
	e.finish(d, items, results, -1, Allow, 0)
	if e.ids != nil && req.RequestID != "" && (d.Source == SourceStore || d.Source == SourceReplay) {
		e.ids.put(e.ids.hash(req), mono+e.cfg.IdempotencyTTL.Nanoseconds())
	}
	for gi := range groups {
		g := &groups[gi]
		if g.local || g.replay {
			// A replay's slots are the earlier decision's, held by the
			// request that made it: releasing them is that request's.
			continue
		}
		for _, i := range g.idx {
			it := &items[i]
			if it.sp.kind == kindSlots && it.res.Allowed && it.res.FailMode == "" {
				d.slots = append(d.slots, slotRef{key: it.key, member: member, ttl: it.sp.b})
			}
		}
	}
	for gi := range groups {
		for j, s := range groups[gi].fb {
			it := &items[groups[gi].fbIdx[j]]
			if it.sp.kind == kindSlots {
				d.slots = append(d.slots, slotRef{fb: s, fbDeadline: slotDeadline(it.sp, groups[gi].fbAt)})
			}
		}
	}
	return nil
}

// admittedHere reports whether req is, as far as this engine knows, the
// retry of a request it admitted within the idempotency TTL (admittedIDs):
// its answer is then the store's replay, not a local denial.
func (e *Engine) admittedHere(req *Request, mono int64) bool {
	return e.ids != nil && req.RequestID != "" && e.ids.has(e.ids.hash(req), mono)
}

// hasStoreGroup reports whether a group of groups is decided in the store,
// where a request's idempotency record lives.
func hasStoreGroup(groups []group) bool {
	for i := range groups {
		if !groups[i].local {
			return true
		}
	}
	return false
}

// decision1 holds a one-rule decision and its rule result in one
// allocation.
type decision1 struct {
	d       Decision
	results [1]RuleResult
}

// plan validates req and matches it against snap. The items go into ibuf
// and the rule results into rbuf when they have room. Each item's result
// points into the returned results, which become the decision's Rules.
func (e *Engine) plan(snap *snapshot, req *Request, ibuf []item, rbuf []RuleResult) ([]item, []RuleResult, error) {
	if req == nil {
		return nil, nil, fmt.Errorf("request: nil: %w", ErrInvalidRequest)
	}
	hits, err := req.validate(snap.known)
	if err != nil {
		return nil, nil, err
	}
	// The matches and their parts (read only to name the counters) on the
	// stack.
	var mbuf [4]policy.Matched
	var pbuf [8]string
	matched, parts := snap.matcher.AppendMatchRules(mbuf[:0], pbuf[:0], req.Descriptors)
	if len(matched) == 0 {
		return nil, rbuf[:0], nil
	}
	var tenant, ip string
	for _, en := range req.Descriptors {
		switch en.Key {
		case "tenant":
			if tenant == "" {
				tenant = en.Value
			}
		case "ip":
			if ip == "" {
				ip = en.Value
			}
		}
	}
	var (
		items   []item
		results []RuleResult // becomes Decision.Rules
	)
	if len(matched) <= cap(ibuf) {
		items = ibuf[:len(matched)]
		clear(items)
	} else {
		items = make([]item, len(matched))
	}
	if len(matched) <= cap(rbuf) {
		results = rbuf[:len(matched)] // every entry is set below
	} else {
		results = make([]RuleResult, len(matched))
	}
	ttag := "" // the tenant's hash tag, made once for all its rules
	for i, m := range matched {
		sp := snap.specs[m.Rule]
		parts := m.PartsIn(parts)
		it := &items[i]
		it.sp = sp
		if sp.kind != kindSlots {
			switch {
			case hits <= sp.ceiling/sp.unit:
				it.cost = sp.unit * hits
			case sp.shadow && !sp.local:
				// A shadow rule only reports: one that could never admit
				// the request would deny it (the store sees a cost just
				// over all it can hold), and the request goes on.
				it.cost = sp.ceiling + 1
			default:
				return nil, nil, fmt.Errorf("hits: %d x cost %d exceeds what rule %s can ever admit (%d): %w",
					hits, sp.rule.Cost, sp.name, sp.ceiling/sp.unit*sp.rule.Cost, ErrBadCost)
			}
		}
		switch {
		case sp.kind == kindPool && sp.template:
			// An instance of a template: its pool, by its name.
			it.tag = instanceTag(sp, m.Instance, tenant)
			it.key, it.poolH = poolKeys(e.cfg.Namespace, it.tag, m.Instance)
			_, it.hash = e.hash.counter(it.tag, sp.digest, parts)
		case sp.kind == kindPool:
			it.tag, it.key, it.poolH = sp.poolTag, sp.poolZ, sp.poolH
			_, it.hash = e.hash.counter(sp.poolTag, sp.digest, nil)
		case sp.scope == policy.ScopeIP:
			it.tag = e.hash.ipTag(ip)
		case sp.scope == policy.ScopeGlobal:
			it.tag = "g:" + sp.name
		case ttag == "" && !strings.ContainsAny(tenant, "{}"):
			// The tenant's first rule: its key holds the tag (tenantTag).
			it.key, it.hash, ttag = e.hash.tenantCounter(tenant, sp.digest, parts)
			it.tag = ttag
		default:
			if ttag == "" {
				ttag = tenantTag(tenant)
			}
			it.tag = ttag
		}
		if sp.kind != kindPool && it.key == "" {
			it.key, it.hash = e.hash.counter(it.tag, sp.digest, parts)
		}
		it.res = &results[i]
		*it.res = RuleResult{
			Rule:      sp.name,
			Scope:     sp.scope,
			Kind:      sp.rule.Kind,
			Def:       sp.rule,
			Shadow:    sp.shadow,
			Allowed:   true,
			Remaining: -1,
		}
		if sp.kind == kindPool {
			it.res.Pool = sp.name
			if sp.template {
				it.res.Pool = m.Instance
			}
		}
		if !sp.shadow && sp.scope != policy.ScopeGlobal && sp.scope != policy.ScopeIP && sp.quota > 0 {
			it.res.Quota, it.res.Window = sp.quota, sp.window
		}
	}
	return items, results, nil
}

// groupItems appends to gs (empty, with room to spare if the caller likes)
// the groups of items, by hash tag in evaluation order; a rule spent from a
// gateway-local chunk is a group of its own. The groups' idx lists share one
// backing array; callers only read them.
func groupItems(gs []group, items []item) []group {
	gs = gs[:0]
	if len(items) == 1 {
		if items[0].sp.local {
			return append(gs, group{local: true, idx: firstOnly})
		}
		return append(gs, group{tag: items[0].tag, idx: firstOnly})
	}
	var gi, count []int // the group of each item; the items of each group
	if len(items) <= 8 {
		var gbuf, cbuf [8]int
		gi, count = gbuf[:len(items)], cbuf[:len(items)]
	} else {
		gi, count = make([]int, len(items)), make([]int, len(items))
	}
	for i := range items {
		it := &items[i]
		g := -1
		if !it.sp.local {
			for j := range gs {
				if !gs[j].local && gs[j].tag == it.tag {
					g = j
					break
				}
			}
		}
		if g < 0 {
			gs = append(gs, group{tag: it.tag, local: it.sp.local})
			g = len(gs) - 1
			if it.sp.local {
				gs[g].tag = ""
			}
		}
		gi[i] = g
		count[g]++
	}
	idx := make([]int, len(items))
	off := 0
	for j := range gs {
		gs[j].idx = idx[off : off : off+count[j]]
		off += count[j]
	}
	for i := range items {
		g := &gs[gi[i]]
		g.idx = append(g.idx, i)
	}
	return gs
}

// firstOnly is the idx of the one group of a one-item decision; read only.
var firstOnly = []int{0}

// decideOp builds the store call for group g.
func (e *Engine) decideOp(g *group, items []item, req *Request, id, member string, now time.Time) *op {
	o, _ := e.ops.Get().(*op)
	if o == nil {
		o = new(op)
	}
	*o = op{code: opDecide, now: e.storeNow(now), id: id, member: member, out: o.out[:0]}
	o.keys = o.keyBuf[:0]
	if n := 1 + len(g.idx) + 1; n > len(o.keyBuf) {
		o.keys = make([]string, 0, n)
	}
	if req.RequestID != "" && e.cfg.IdempotencyTTL > 0 {
		o.keys = append(o.keys, e.hash.idemKey(g.tag, req))
		o.idemTTL = e.cfg.IdempotencyTTL.Milliseconds()
	} else {
		// Without an idempotency record the first key is only a place
		// holder, never read or written: a rule's key (the same slot).
		o.keys = append(o.keys, items[g.idx[0]].key)
	}
	if n := len(g.idx); n <= len(o.ruleBuf) {
		o.rules = o.ruleBuf[:n:n]
	} else {
		o.rules = make([]ruleArg, n)
	}
	// String-state keys first, so the script reads them with one MGET.
	for pass := 0; pass < 2; pass++ {
		for j, i := range g.idx {
			it := &items[i]
			sp := it.sp
			str := sp.kind == kindBucket || sp.kind == kindFixed || sp.kind == kindSliding
			if str != (pass == 0) {
				continue
			}
			ra := ruleArg{kind: sp.kind, key: len(o.keys) + 1, a: sp.a, b: sp.b, c: it.cost, d: sp.d, shadow: sp.shadow}
			o.keys = append(o.keys, it.key)
			if str {
				o.strKeys++
			}
			if sp.kind == kindPool {
				ra.a = it.cost // a pool's first argument is the cost
				o.keys = append(o.keys, it.poolH)
			}
			o.rules[j] = ra
		}
	}
	return o
}

// call runs o on the store through the breaker of its shard (Store.shard of
// its first key), within timeout when it is positive. It reports whether
// the breaker refused the call.
func (e *Engine) call(ctx context.Context, o *op, mono int64, timeout time.Duration) (refused bool, err error) {
	sh := 0
	if len(o.keys) > 0 {
		sh = e.store.shard(o.keys[0]) & (maxShards - 1)
	}
	o.shard = uint8(sh)
	brk := &e.brks[sh]
	if ok, _ := brk.allow(mono); !ok {
		return true, errRefused
	}
	o.timeout = timeout
	err = e.store.run(ctx, o)
	e.m.storeCalls.Add(1)
	switch {
	case err == nil:
		brk.done(mono, false)
	case callerLeft(ctx, err):
		// The caller left before the store answered: neither the store's
		// failure nor a fail mode's engagement, and counted as neither.
		e.m.storeCanceled.Add(1)
		brk.abort()
	case errors.Is(err, ErrOverloaded) || errors.Is(err, ErrClosed) || errors.Is(err, ErrStoreFull) || ctx.Err() != nil:
		// Our own queue, our own shutdown, the caller's deadline passing
		// first, or the embedded store refusing a new key at its cap (it
		// still answers for the keys it holds): not the store failing, so
		// the breaker does not count it and other tenants keep their store.
		e.m.storeErrors.Add(1)
		brk.abort()
	case routingRefusal(err):
		// Redis Cluster refused the call for where its keys live (a slot
		// being moved): the node is serving, so the breaker does not count
		// it either.
		e.m.storeErrors.Add(1)
		brk.abort()
	default:
		e.m.storeErrors.Add(1)
		brk.done(e.mono(e.clock.Now()), true)
		e.log.Debug("store call failed", zap.Error(err))
	}
	return false, err
}

// callerLeft reports whether a store call that failed with err ended
// because the caller's context was canceled: the caller left (a client
// disconnected), which says nothing about the store. A caller's deadline
// is different: the store did not answer within the caller's budget, and
// the fail modes decide as they do at StoreTimeout.
func callerLeft(ctx context.Context, err error) bool {
	return err != nil && errors.Is(ctx.Err(), context.Canceled)
}

// runStore decides group g in one store call, or by the fail modes.
func (e *Engine) runStore(ctx context.Context, g *group, items []item, req *Request, d *Decision,
	member string, now time.Time, mono int64) (Outcome, int, int64) {
	o := e.decideOp(g, items, req, d.ID, member, now)
	_, err := e.call(ctx, o, mono, e.cfg.StoreTimeout)
	g.shard = int(o.shard)
	if err != nil {
		// A decide that may still land takes slots nobody holds: release
		// them later. One the breaker refused, or the batcher dropped
		// before sending it, takes none (Unsent covers both).
		if !Unsent(err) && member == d.ID {
			e.releaseLate(g, items, member)
		}
		return e.failGroup(g, items, now, mono, !callerLeft(ctx, err))
	}
	n := len(g.idx)
	if len(o.out) < 2 {
		return e.failGroup(g, items, now, mono, true)
	}
	replay := o.out[0] == 1
	if replay {
		g.replay = true
		d.ID = o.outID
		if len(o.out) != 2+4*n { // decided under another policy version
			return Allow, -1, 0
		}
	} else if len(o.out) != 2+4*n {
		e.log.Warn("malformed store reply", zap.Int("len", len(o.out)), zap.Int("rules", n))
		return e.failGroup(g, items, now, mono, true)
	}
	if d.Source == SourceLocal || d.Source == SourceNone {
		d.Source = SourceStore
	}
	g.op = o
	deny := -1
	var retry int64
	for j, i := range g.idx {
		it := &items[i]
		r := o.out[2+4*j : 6+4*j]
		it.res.Allowed = r[0] == 1
		it.res.Remaining = r[1]
		it.res.Reset = ceilSeconds(r[3])
		if !it.res.Allowed {
			it.res.RetryAfter = msToRetry(r[2])
			if it.sp.shadow {
				continue
			}
			if deny < 0 && o.out[1] == int64(j+1) {
				deny = i
			}
			retry = maxRetry(retry, it.res.RetryAfter)
			if e.neg != nil && !replay && it.sp.kind != kindSlots {
				e.remember(it.hash, r[2], mono)
			}
		}
	}
	if deny >= 0 {
		return Deny, deny, retry
	}
	return Allow, -1, 0
}

// lateReleaseDelays are when, after a decide holding concurrency rules went
// unanswered, the engine releases the slots that decide may still take if
// it lands late (it was sent before its caller gave up, and a paused Redis
// runs it when it resumes; one still queued then is dropped unsent). The
// caller has taken the fail mode instead, so such a slot is held by nobody, and would otherwise deny the rule's requests for
// its whole slot_ttl (ten minutes for P-EXPORT). A release is a no-op
// where the decide never landed. One that lands after the last attempt
// keeps its slot until slot_ttl.
var lateReleaseDelays = []time.Duration{time.Second, 10 * time.Second, time.Minute}

// maxLateReleases bounds the late-slot releases scheduled at once; beyond
// it, slots of unanswered decides expire by their slot_ttl.
const maxLateReleases = 1024

// releaseLate schedules the release of the slots group g's unanswered decide
// may take under member. Only a decision's own id is released this way: a
// caller's RequestID may be reused by its retry, whose slot must stay.
func (e *Engine) releaseLate(g *group, items []item, member string) {
	var keys []string
	var ttl time.Duration
	for _, i := range g.idx {
		if it := &items[i]; it.sp.kind == kindSlots {
			keys = append(keys, it.key)
			ttl = max(ttl, time.Duration(it.sp.b)*time.Millisecond)
		}
	}
	if len(keys) == 0 {
		return
	}
	if e.orphans.Add(1) > maxLateReleases {
		e.orphans.Add(-1)
		return
	}
	go func() {
		defer e.orphans.Add(-1)
		start := time.Now()
		for _, delay := range lateReleaseDelays {
			if delay > ttl {
				return // the slot has expired by then
			}
			t := time.NewTimer(delay - time.Since(start))
			select {
			case <-t.C:
			case <-e.done:
				t.Stop()
				return
			}
			for _, k := range keys {
				ctx, cancel := context.WithTimeout(context.Background(), max(e.cfg.StoreTimeout, time.Second))
				err := e.run(ctx, &op{code: opRelease, now: e.storeNow(e.clock.Now()), keys: []string{k}, member: member})
				cancel()
				if err != nil {
					e.log.Debug("release of a late decide's slot failed; trying again later", zap.String("member", member), zap.Error(err))
				}
			}
		}
	}()
}

// remember puts a denied key in the negative cache for min(hint, ceiling).
func (e *Engine) remember(hash uint64, retryMs, mono int64) {
	ceiling := e.cfg.NegativeCacheTTL.Nanoseconds()
	hold, retryAt := ceiling, int64(-1)
	if retryMs >= 0 {
		r := retryMs * int64(time.Millisecond)
		hold = min(r, ceiling)
		retryAt = mono + r
	}
	if hold > 0 {
		e.neg.put(hash, mono+hold, retryAt)
	}
}

// failGroup decides group g by its rules' fail modes: the first rule in
// order that does not admit decides; closed answers Unavailable, a fallback
// bucket that is empty answers Deny, a global quota's fallback outside its
// window's span (Config.PoolFallbackMargin) answers Unavailable; open
// admits (counted). Fallback debits
// happen only when the whole group admits. The fail-mode counters count
// the rules decided unless count is false (the caller has left).
func (e *Engine) failGroup(g *group, items []item, now time.Time, mono int64, count bool) (Outcome, int, int64) {
	add := func(c *atomic.Uint64, n uint64) {
		if count {
			c.Add(n)
		}
	}
	var fbItems []fbItem
	var fbIdx []int
	for _, i := range g.idx {
		it := &items[i]
		it.res.Remaining = -1
		if it.sp.shadow {
			continue
		}
		switch it.sp.fail {
		case policy.FailOpen:
			it.res.FailMode = policy.FailOpen
		case policy.FailFallback:
			it.res.FailMode = policy.FailFallback
			fbItems = append(fbItems, fbItem{sp: it.sp, hash: it.hash, cost: it.cost})
			fbIdx = append(fbIdx, i)
		default:
			it.res.FailMode = policy.FailClosed
			it.res.Allowed = false
			add(&e.m.failClosed, 1)
			return Unavailable, i, e.unavailableRetry(g.shard, mono)
		}
	}
	wall := now.UnixMilli()
	if e.fbClock != nil && len(fbItems) > 0 {
		wall = e.fbClock.Now().UnixMilli()
	}
	if len(fbItems) > 0 {
		deny, retryMs, closed, states := e.fb.decide(fbItems, wall)
		if deny >= 0 {
			it := &items[fbIdx[deny]]
			it.res.Allowed = false
			add(&e.m.fallback, 1)
			if closed {
				// A global quota's fallback outside its window's span
				// cannot decide: 503, as fail closed, until the span.
				it.res.RetryAfter = msToRetry(retryMs)
				if retryMs < 0 {
					it.res.RetryAfter = e.unavailableRetry(g.shard, mono)
				}
				return Unavailable, fbIdx[deny], it.res.RetryAfter
			}
			it.res.RetryAfter = msToRetry(retryMs)
			return Deny, fbIdx[deny], it.res.RetryAfter
		}
		g.fb, g.fbIdx, g.fbAt = states, fbIdx, wall
		add(&e.m.fallback, uint64(len(fbItems)))
	}
	for _, i := range g.idx {
		if items[i].res.FailMode == policy.FailOpen {
			add(&e.m.failOpen, 1)
		}
	}
	return Allow, -1, 0
}

// unavailableRetry is the Retry-After of a 503: until the breaker of the
// store's shard lets a probe through, or the configured default.
func (e *Engine) unavailableRetry(shard int, mono int64) int64 {
	if at := e.brks[shard&(maxShards-1)].probeAt(mono); at > mono {
		return retrySeconds(at, mono)
	}
	return ceilSeconds(e.cfg.UnavailableRetryAfter.Milliseconds())
}

// maxChunkRounds bounds how many takes a request waits through in runLocal
// (its clock may stand still, as a test's does).
const maxChunkRounds = 1000

// runLocal spends a global quota from the gateway-local chunk, taking a new
// chunk from the regional pool when it is empty.
func (e *Engine) runLocal(ctx context.Context, g *group, items []item, now time.Time, mono int64) (Outcome, int64) {
	it := &items[g.idx[0]]
	c := it.sp.chunk
	failMode := func(count bool) (Outcome, int64) {
		g.shard = e.store.shard(it.sp.poolZ)
		out, _, retry := e.failGroup(g, items, now, e.mono(now), count)
		return out, retry
	}
	// A request that finds the chunk empty waits on the take in flight or
	// makes one. A take serves the request that made it first (below), so
	// every take admits someone and a request only waits while others are
	// being served; it gives up (429, retry in a second) only after
	// StoreTimeout of losing such races, or maxChunkRounds of them.
	giveUp := mono + e.cfg.StoreTimeout.Nanoseconds()
	for round := 0; round < maxChunkRounds && (round == 0 || mono < giveUp); round++ {
		if s := c.spend(mono, it.cost); s != nil {
			it.spent = s
			it.res.Remaining = s.tokens.Load()
			e.m.localSpends.Add(1)
			return Allow, 0
		}
		c.mu.Lock()
		if mono < c.starved {
			retryAt := c.retryAt
			c.mu.Unlock()
			it.res.Allowed, it.res.Remaining = false, 0
			it.res.RetryAfter = retrySeconds(retryAt, mono)
			return Deny, it.res.RetryAfter
		}
		if t := c.refill; t != nil {
			c.mu.Unlock()
			select {
			case <-t.done:
				if t.failed {
					return failMode(true)
				}
				now = e.clock.Now()
				mono = e.mono(now)
				continue
			case <-ctx.Done():
				return failMode(!callerLeft(ctx, ctx.Err()))
			}
		}
		t := &chunkTake{done: make(chan struct{})}
		c.refill = t
		c.mu.Unlock()

		o := &op{code: opTake, now: e.storeNow(now), keys: []string{it.sp.poolZ, it.sp.poolH}, n1: it.sp.gatewayChunk}
		sent := mono
		_, err := e.call(ctx, o, mono, e.cfg.StoreTimeout)
		now = e.clock.Now()
		mono = e.mono(now)
		c.mu.Lock()
		c.refill = nil
		// The store failed the take unless it answered, or the taker's own
		// context ended first (then the waiters take their own turn).
		t.failed = (err != nil || len(o.out) != 3) && ctx.Err() == nil
		close(t.done)
		if err == nil && len(o.out) == 3 && o.out[0] > 0 {
			e.m.localTakes.Add(1)
			st := &chunkState{expires: sent + o.out[1]*int64(time.Millisecond)}
			if old := c.cur.Load(); old != nil && mono < old.expires {
				// Keep what is left of the old chunk, under the earlier expiry.
				st.tokens.Store(old.tokens.Swap(0))
				st.expires = min(st.expires, old.expires)
			}
			st.tokens.Add(o.out[0])
			// The taker spends first: without this the requests woken by
			// its take could spend the chunk and leave the taker to take
			// again, and again.
			if st.tokens.Load() >= it.cost {
				st.tokens.Add(-it.cost)
				c.cur.Store(st)
				c.mu.Unlock()
				it.spent = st
				it.res.Remaining = st.tokens.Load()
				e.m.localSpends.Add(1)
				return Allow, 0
			}
			c.cur.Store(st)
		} else if err == nil && len(o.out) == 3 {
			retry := o.out[2] * int64(time.Millisecond)
			hold := min(retry, e.cfg.NegativeCacheTTL.Nanoseconds())
			c.starved, c.retryAt = mono+hold, mono+retry
			c.mu.Unlock()
			it.res.Allowed, it.res.Remaining = false, 0
			it.res.RetryAfter = msToRetry(o.out[2])
			return Deny, it.res.RetryAfter
		}
		c.mu.Unlock()
		if err != nil || len(o.out) != 3 {
			return failMode(!callerLeft(ctx, err))
		}
	}
	it.res.Allowed, it.res.Remaining = false, 0
	it.res.RetryAfter = 1
	return Deny, 1
}

// compensate undoes the debits of groups that admitted before a later group
// denied: local chunks and fallback buckets in process, store groups with a
// refund call. A failed refund is logged and counted; it leaves counters
// charged, the safe direction.
func (e *Engine) compensate(groups []group, items []item, mono int64) {
	for gi := range groups {
		g := &groups[gi]
		switch {
		case g.local:
			it := &items[g.idx[0]]
			it.sp.chunk.refund(it.spent, mono, it.cost)
			it.spent = nil
		case g.op != nil && !g.replay:
			r := *g.op
			r.code, r.done, r.out = opRefund, nil, nil
			// Only the rules the decide debited: a shadow rule that denied
			// was not, and giving it back tokens would undercount it. Nor
			// a slot the member held before the decide (a retry of a
			// request still running, under its request id): refunded, it
			// would free the slot of the request that holds it.
			r.rules = r.ruleBuf[:0]
			for j, ra := range g.op.rules {
				res := g.op.out[2+4*j : 6+4*j] // ok remaining retry reset
				if res[0] == 1 && !(ra.kind == kindSlots && res[2] == 1) {
					r.rules = append(r.rules, ra)
				}
			}
			if len(r.rules) == 0 && r.idemTTL == 0 {
				break // nothing to give back
			}
			if _, err := e.call(context.Background(), &r, mono, e.cfg.StoreTimeout); err != nil {
				// The store may still be sending r, which shares g.op's
				// keys: g.op must not be reused.
				g.op = nil
				e.m.refundErrors.Add(1)
				e.log.Warn("refund failed; the earlier rules stay charged", zap.Error(err))
			}
		}
		for j, s := range g.fb {
			it := &items[g.fbIdx[j]]
			e.fb.mu.Lock()
			switch it.sp.kind {
			case kindBucket:
				s.tok = min(it.sp.fbCap, s.tok+it.cost)
			case kindSlots:
				s.free(slotDeadline(it.sp, g.fbAt))
			default:
				s.c = max(0, s.c-it.cost)
			}
			e.fb.mu.Unlock()
		}
		g.fb = nil
	}
}

// recycle returns the groups' store calls to the pool once the decision is
// made. A group holds only a call that was answered (runStore keeps no
// other, compensate drops one whose refund was not), so the store holds
// none of them any more.
func (e *Engine) recycle(groups []group) {
	for i := range groups {
		if o := groups[i].op; o != nil {
			groups[i].op = nil
			e.ops.Put(o)
		}
	}
}

// finish fills the decision from the items.
func (e *Engine) finish(d *Decision, items []item, results []RuleResult, deny int, outcome Outcome, retry int64) {
	d.Outcome = outcome
	d.Rules = results
	degraded := false
	for i := range d.Rules {
		r := &d.Rules[i]
		if r.Shadow && !r.Allowed {
			d.WouldDeny = true
		}
		if r.FailMode != "" {
			degraded = true
		}
		if !r.Shadow && r.Remaining >= 0 && (d.Remaining < 0 || r.Remaining < d.Remaining) {
			d.Remaining = r.Remaining
		}
	}
	if degraded && d.Source != SourceReplay {
		d.Source = SourceFailMode
	}
	switch outcome {
	case Allow:
		e.m.allowed.Add(1)
	case Deny:
		e.m.denied.Add(1)
	case Unavailable:
		e.m.unavailable.Add(1)
	}
	if deny >= 0 {
		d.Rule, d.Scope = items[deny].sp.name, items[deny].sp.scope
		if retry == 0 {
			retry = 1
		}
		d.RetryAfter = retry
	}
}

// msToRetry converts a retry hint in milliseconds to whole seconds, rounded
// up and at least 1; -1 (waiting will not help) stays -1.
func msToRetry(ms int64) int64 {
	if ms < 0 {
		return -1
	}
	return max(1, ceilSeconds(ms))
}

func ceilSeconds(ms int64) int64 {
	if ms <= 0 {
		return 0
	}
	return (ms + 999) / 1000
}

// retrySeconds is the whole seconds from mono until at (monotonic ns),
// rounded up, at least 1; -1 when at is -1.
func retrySeconds(at, mono int64) int64 {
	if at < 0 {
		return -1
	}
	s := (at - mono + int64(time.Second) - 1) / int64(time.Second)
	return max(1, s)
}

// maxRetry combines two retry hints; -1 (never) dominates.
func maxRetry(a, b int64) int64 {
	if a < 0 || b < 0 {
		return -1
	}
	return max(a, b)
}
