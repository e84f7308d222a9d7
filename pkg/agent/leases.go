package agent

import (
	"context"
	"errors"
	"fmt"
	"math"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"
	"go.uber.org/zap"
	"golang.org/x/sync/errgroup"

	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/allocator"
	"github.com/allot-dev/allot/pkg/lease"
	"github.com/allot-dev/allot/pkg/policy"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// QuotaStatus is one leased quota as the lease manager last saw it.
type QuotaStatus struct {
	// Quota is the pool's name: a global quota's, or an instance's of a
	// template (policy.InstanceName).
	Quota string
	// Template is the template an instance belongs to; empty for a single
	// pool.
	Template string
	// Held is the unexpired, unspent tokens in the regional store at the
	// last look.
	Held int64
	// Consumed, Expired and Starved are the regional pool's counters (every
	// gateway of the region included).
	Consumed, Expired, Starved int64
	// Granted and Released count tokens this agent received from and handed
	// back to the allocator.
	Granted, Released int64
	// Deposits counts grants deposited into the store.
	Deposits int64
	// Demand is the measured demand in tokens per second.
	Demand float64
	// Exhausted is true while the allocator says the global pool is
	// exhausted for the current window.
	Exhausted bool
	// LiveGrants is the number of this agent's deposited grants whose lease
	// has not ended.
	LiveGrants int
}

// poolState is what a pool denied for lack of tokens is waiting for.
type poolState uint8

const (
	// poolRenewing: a renewal was asked for; wait for it.
	poolRenewing poolState = iota
	// poolExhausted: the global pool is exhausted for this window: 429.
	poolExhausted
	// poolCutOff: the allocator is unreachable (or absent): 503.
	poolCutOff
	// poolRefused: the allocator refused the pool (it is quarantined, see
	// LeaseConfig.QuarantineTime): 503 until the quarantine ends.
	poolRefused
)

// held is one grant this agent deposited.
type held struct {
	tokens   int64
	deadline time.Time
}

// quota is the lease manager's state of one leased pool: a single global
// quota, or an active instance of a template.
type quota struct {
	name string // the pool's name, as the allocator and the store know it
	tmpl string // the template of an instance; empty for a single pool
	spec policy.GlobalQuota
	rule *policy.Rule
	cost int64
	// lastActive is when the pool was last seen in use (created, spent
	// from, starved): an idle instance is forgotten (see idle).
	lastActive time.Time

	stats     admission.PoolStats
	statsAt   time.Time
	haveStats bool
	demand    float64 // EWMA, tokens per second
	backlog   int64   // tokens wanted by requests starved since the last reading

	nextPoll   time.Time
	boundaryAt time.Time // poll right after the current window's estimated end
	pregrantAt time.Time // poll then to ask for a chunk of the next window
	pregranted int64     // the window a pre-grant was last asked for
	kicked     bool      // look at the pool at the next tick
	starving   bool      // a request found the pool short since the last plan

	windowEnd      time.Time // monotonic estimate, from the latest grant
	exhaustedUntil time.Time
	recheckAt      time.Time // an exhausted pool is asked again from then
	quarantine     time.Time // the allocator refused the quota: not before
	inflight       bool      // an Acquire for it is out (or pending a retry)

	grants      map[string]held
	hasFallback bool
	fallbackIdx int64

	granted, released, deposits int64
	notify                      chan struct{}
	// gen is the leases' change counter; changedAt is its value at q's
	// last change.
	gen       *atomic.Uint64
	changedAt uint64
}

// changed wakes the requests waiting on q. The caller holds l.mu.
func (q *quota) changed() {
	close(q.notify)
	q.notify = make(chan struct{})
	q.changedAt = q.gen.Add(1)
}

// closedChan is returned to a waiter whose pool changed after it looked.
var closedChan = func() chan struct{} {
	c := make(chan struct{})
	close(c)
	return c
}()

// template is a quota template of the policy that this region leases: its
// instances become managed pools when requests for them arrive.
type template struct {
	spec      policy.GlobalQuota
	rule      *policy.Rule
	cost      int64
	instances int       // managed instances
	warnedAt  time.Time // the last warning that maxInstances was reached
}

// maxInstances bounds the managed instances of one template: the
// allocator's bound (fsm.MaxInstancesPerTemplate). Requests for further
// instances are answered unavailable (counted as refused in
// allot_agent_fail_mode_total: the allocator is not cut off) until idle ones
// are forgotten.
const maxInstances = 1_000_000

// maxAcquireBytes bounds the estimated size of one Acquire request: within
// the allocator's default 4 MiB body limit whatever the quota names, so a
// round that is due more wants than fit takes more calls.
const maxAcquireBytes = 3 << 20

// wantBytes estimates the encoded size of a want for quota name: the name
// and, with field tags and lengths, three numbers at their widest.
func wantBytes(name string) int { return len(name) + 32 }

// acquireCall is one Acquire request, kept with its first send time so that
// a retry (same request id) measures deadlines from the first send.
type acquireCall struct {
	req    *allotv1.AcquireRequest
	sentAt time.Time // monotonic, before the first send
	recvAt time.Time // monotonic, when the answer arrived
	maxTTL time.Duration
}

// leases keeps the region's leased pools filled in proportion to demand: it
// reads each pool's counters from the store, renews the pools under their low
// watermark in one batched Acquire per tick, deposits the grants with
// deadlines that never outlive the lease, and hands unspent tokens back when
// it stops. See doc.go.
type leases struct {
	// gen counts changes of any pool (quota.changed): a request reads it
	// before deciding, so a deposit that lands between its decision and
	// its wait wakes it at once (see starved).
	gen    atomic.Uint64
	cfg    LeaseConfig
	region string
	client *allocator.Client // nil: standalone, always cut off
	clock  admission.Clock
	log    *zap.Logger
	m      *metrics
	id     string
	wd     *withdrawer

	eng atomic.Pointer[admission.Engine]

	mu        sync.Mutex
	quotas    map[string]*quota    // single pools and active instances, by pool name
	templates map[string]*template // by name
	// unleased names the global quotas and templates of the policy that it
	// does not lease to this region: no renewal can come for them.
	unleased   map[string]bool
	seq        uint64
	cutOff     bool
	pending    []*acquireCall
	storeDelay time.Duration
	acquireRTT time.Duration
	offsetMs   int64 // leader wall clock minus ours, as last measured (the clock offset gauge)
	// leader is the leader's clock as last measured (see leaderNow);
	// leaderSnap a copy for readers that do not hold mu (leaderWall).
	leader     leaderClock
	leaderSnap atomic.Pointer[leaderClock]
	// warnedUnmeasured: the warning that fallback allowances are withheld
	// until the leader's clock is measured was logged.
	warnedUnmeasured bool
	// allocMargin is the expiry margin the allocator's answers last stated
	// (0: none did); warnedMargin the last one warned about (see margin).
	allocMargin, warnedMargin time.Duration
	// maxWants is the most wants one Acquire carries: MaxWantsPerCall,
	// lowered to what the allocator takes when it refuses a call as too
	// large (see failed).
	maxWants   int
	shutdownIn time.Duration
	journal    LeaseObserver // nil: no lease journal
	// maxInstances is maxInstances (tests lower it).
	maxInstances int
}

func newLeases(cfg LeaseConfig, region string, client *allocator.Client, clock admission.Clock, log *zap.Logger,
	m *metrics, id string, wd *withdrawer, shutdownIn time.Duration) *leases {
	return &leases{
		cfg: cfg, region: region, client: client, clock: clock, log: log.Named("leases"), m: m, id: id, wd: wd,
		shutdownIn: shutdownIn,
		quotas:     map[string]*quota{}, templates: map[string]*template{}, unleased: map[string]bool{}, cutOff: client == nil,
		storeDelay: cfg.MinStoreDelay, acquireRTT: 10 * time.Millisecond, maxWants: max(cfg.MaxWantsPerCall, 1),
		maxInstances: maxInstances,
	}
}

// addQuotas starts managing the quotas of doc that this region leases,
// keeping the ones it manages already.
func (l *leases) addQuotas(doc *policy.Document) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.sync(doc, false)
}

// setPolicy makes the quotas of doc that this region leases the managed
// ones, with eng deciding (nil doc: none). Quotas no longer in the policy
// are forgotten: their tokens in the store are unreachable by any rule and
// expire with their lease.
func (l *leases) setPolicy(doc *policy.Document, eng *admission.Engine) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if eng != nil {
		l.eng.Store(eng)
	}
	l.sync(doc, true)
}

// sync adds (and with prune, removes) quotas and templates; the instances
// of a template follow its spec, and go with it. The quotas doc does not
// lease to this region are recorded as unleased (with prune, only doc's).
// The caller holds l.mu.
func (l *leases) sync(doc *policy.Document, prune bool) {
	now := l.clock.Now()
	keep, keepT := map[string]bool{}, map[string]bool{}
	if prune {
		clear(l.unleased)
	}
	if doc != nil {
		for _, gq := range doc.GlobalQuotas() {
			if !leasedTo(gq, l.region) {
				l.unleased[gq.Name] = true
				continue
			}
			r := doc.Rule(gq.Name)
			if len(gq.TemplateKeys) > 0 {
				keepT[gq.Name] = true
				t := l.templates[gq.Name]
				if t == nil {
					t = &template{}
					l.templates[gq.Name] = t
				}
				t.spec, t.rule, t.cost = gq, r, max(r.Cost, 1)
				continue
			}
			keep[gq.Name] = true
			q := l.quotas[gq.Name]
			if q == nil {
				q = l.newQuota(gq.Name, "", now)
			}
			q.spec, q.rule, q.cost = gq, r, max(r.Cost, 1)
		}
	}
	for _, q := range l.quotas {
		if t := l.templates[q.tmpl]; q.tmpl != "" && t != nil {
			q.spec, q.rule, q.cost = t.spec, t.rule, t.cost
		}
	}
	if !prune {
		return
	}
	for name := range l.templates {
		if !keepT[name] {
			delete(l.templates, name)
		}
	}
	for name, q := range l.quotas {
		stale := !keep[name]
		if q.tmpl != "" {
			t := l.templates[q.tmpl]
			stale = t == nil || !instanceOf(name, t)
		}
		if stale {
			l.forget(q)
		}
	}
}

// leasedTo reports whether gq is leased to region.
func leasedTo(gq policy.GlobalQuota, region string) bool {
	return len(gq.Regions) == 0 || slices.Contains(gq.Regions, region)
}

// notLeased reports whether pool name (a global quota, or an instance of a
// template) is one the policy does not lease to this region. The caller
// holds l.mu.
func (l *leases) notLeased(name string) bool {
	if l.unleased[name] {
		return true
	}
	tmpl, _, ok := strings.Cut(name, string(policy.InstanceSeparator))
	return ok && l.unleased[tmpl]
}

// newQuota starts managing pool name (of template tmpl, or a single pool).
// The caller holds l.mu and sets the spec.
func (l *leases) newQuota(name, tmpl string, now time.Time) *quota {
	q := &quota{name: name, tmpl: tmpl, grants: map[string]held{}, notify: make(chan struct{}), nextPoll: now, lastActive: now, gen: &l.gen}
	l.quotas[name] = q
	if t := l.templates[tmpl]; t != nil {
		t.instances++
	}
	return q
}

// forget stops managing q, waking the requests waiting on it. Its tokens in
// the store stay spendable until their leases end. The caller holds l.mu.
func (l *leases) forget(q *quota) {
	q.changed()
	delete(l.quotas, q.name)
	if t := l.templates[q.tmpl]; q.tmpl != "" && t != nil {
		t.instances--
	}
}

// instanceOf reports whether name is a well-formed instance of t.
func instanceOf(name string, t *template) bool {
	in, err := policy.ParseInstanceName(name)
	return err == nil && in.Template == t.spec.Name && (in.Hashed || len(in.Values) == len(t.spec.TemplateKeys))
}

// lookup returns the managed pool name, activating it when it is an
// instance of a template this region leases: the lease manager learns of
// instances from the requests that need them. It returns nil for a pool
// that is not (or cannot be) managed; full says that name is an instance
// its template has no room for (maxInstances). The caller holds l.mu.
func (l *leases) lookup(name string, now time.Time) (q *quota, full bool) {
	if q := l.quotas[name]; q != nil {
		return q, false
	}
	tmpl, _, ok := strings.Cut(name, string(policy.InstanceSeparator))
	t := l.templates[tmpl]
	if !ok || t == nil || !instanceOf(name, t) {
		return nil, false
	}
	if t.instances >= l.maxInstances {
		if now.Sub(t.warnedAt) >= time.Minute {
			t.warnedAt = now
			l.log.Warn("too many active instances: requests for new ones are answered unavailable", zap.String("template", tmpl),
				zap.Int("instances", t.instances))
		}
		return nil, true
	}
	q = l.newQuota(name, tmpl, now)
	q.spec, q.rule, q.cost = t.spec, t.rule, t.cost
	return q, false
}

// idleFor is how long an instance must go unused before it is forgotten:
// the longer of two idle polls and the template's lease TTL, after which no
// grant it took can still be live.
func (l *leases) idleFor(q *quota) time.Duration {
	return max(2*l.cfg.IdlePoll, q.spec.TTL)
}

// minDemand is the demand (tokens per second) below which a pool counts as
// unused.
const minDemand = 0.01

// idle reports whether instance q can be forgotten: unused for idleFor,
// nothing of its own in the store or in flight, no request waiting for it.
// A later request for it makes it active again. The caller holds l.mu.
func (l *leases) idle(q *quota, now time.Time) bool {
	if q.tmpl == "" || q.inflight || q.starving || q.kicked || !q.haveStats || q.stats.Available > 0 ||
		q.demand >= minDemand || now.Sub(q.lastActive) < l.idleFor(q) {
		return false
	}
	for _, g := range q.grants {
		if now.Before(g.deadline) {
			return false
		}
	}
	return true
}

// Status returns every managed quota's state, sorted by name.
func (l *leases) Status() []QuotaStatus {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.clock.Now()
	out := make([]QuotaStatus, 0, len(l.quotas))
	for name, q := range l.quotas {
		live := 0
		for _, g := range q.grants {
			if now.Before(g.deadline) {
				live++
			}
		}
		out = append(out, QuotaStatus{
			Quota: name, Template: q.tmpl, Held: q.stats.Available, Consumed: q.stats.Consumed, Expired: q.stats.Expired,
			Starved: q.stats.Starved, Granted: q.granted, Released: q.released, Deposits: q.deposits,
			Demand: q.demand, Exhausted: now.Before(q.exhaustedUntil), LiveGrants: live,
		})
	}
	slices.SortFunc(out, func(a, b QuotaStatus) int {
		switch {
		case a.Quota < b.Quota:
			return -1
		case a.Quota > b.Quota:
			return 1
		}
		return 0
	})
	return out
}

// CutOff reports whether the last Acquire failed (or there is no allocator).
func (l *leases) CutOff() bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.cutOff
}

// starved is called for a request that only pool name denied (a single
// pool, or an instance of a template, which this makes active). It returns
// what the pool is waiting for, how long an answer should tell the caller
// to wait, and a channel closed at the pool's next change (nil unless the
// state is poolRenewing). It always marks the pool for the next round.
//
// seen is Generation() read before the request was decided: when the pool
// changed since, the returned channel is already closed, so the request
// decides again at once instead of waiting for the next change.
func (l *leases) starved(name string, seen uint64) (poolState, time.Duration, <-chan struct{}) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.clock.Now()
	q, full := l.lookup(name, now)
	if q == nil {
		if l.notLeased(name) || full {
			// The policy does not lease the pool to this region, or its
			// template has as many active instances as it may (lookup
			// warns): no renewal will come for it, and the allocator is
			// not cut off. Agent.install logs the first.
			return poolRefused, time.Second, nil
		}
		return poolCutOff, time.Second, nil // not managed (a policy being swapped)
	}
	q.lastActive = now
	l.waiting(q)
	q.kicked, q.starving = true, true
	if q.changedAt > seen {
		// The pool changed after the decision read it (a deposit, a
		// fallback allowance, an exhausted mark): decide again before any
		// verdict from this state, which may already count that change
		// (cut off with the allowance deposited is no reason for a 503
		// when the allowance is what the decision missed).
		return poolRenewing, 0, closedChan
	}
	if now.Before(q.exhaustedUntil) {
		return poolExhausted, q.exhaustedUntil.Sub(now), nil
	}
	if l.cutOff && !l.fallbackDue(q, now) && !l.fallbackNext(q, now) {
		return poolCutOff, l.cfg.Tick, nil
	}
	if !l.cutOff && now.Before(q.quarantine) {
		// No renewal is asked for before the quarantine ends: waiting
		// would only end in a 503 after the starve wait. (The pool is
		// marked starving, so the first round after it asks at once.)
		// Cut off, a fallback allowance due is deposited quarantined or
		// not (see plan): the request waits for it as above.
		return poolRefused, q.quarantine.Sub(now), nil
	}
	return poolRenewing, 0, q.notify
}

// Generation is the count of pool changes so far; see starved.
func (l *leases) Generation() uint64 { return l.gen.Load() }

// touch marks quotas name for the next round as if starved: a pool that
// holds less than one request's cost is then asked for at once. Check calls
// it for the other leased pools of a request a pool denied, so a request
// that needs several empty pools waits one round, not one per pool.
func (l *leases) touch(names []string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.clock.Now()
	for _, n := range names {
		if q, _ := l.lookup(n, now); q != nil {
			q.kicked, q.starving, q.lastActive = true, true, now
			l.waiting(q)
		}
	}
}

// waiting counts a request waiting for instance q before its pool was ever
// read: its first ask is what the waiting requests need (plus MinChunk),
// not the policy's chunk. Instances come and go with their tenants' traffic,
// and a tenant's occasional request must not take a chunk of its plan into
// one region each time its instance is created. (Once read, the pool's
// starved counter measures the backlog.) The caller holds l.mu.
func (l *leases) waiting(q *quota) {
	if q.tmpl != "" && !q.haveStats {
		q.backlog = min(q.backlog+q.cost, q.spec.Chunk)
	}
}

// Run renews until ctx ends, then hands unspent tokens back within the
// shutdown timeout. Rounds run once per Tick, no more often, so the
// allocator sees at most one batched Acquire per Tick from this agent (plus
// one per MaxWantsPerCall quotas beyond the first MaxWantsPerCall due, and
// the retry of an unanswered call): a starved request marks its pool for
// the next round rather than starting one.
//
// The shutdown timeout counts from the end of ctx, not from the end of the
// round then in progress: that round's hand-backs, which outlive ctx (see
// grant), and the shutdown share it, so Run returns within the timeout of
// ctx's end (plus, when Redis is slow, a deposit in progress settling
// within its own bounds: see grant).
func (l *leases) Run(ctx context.Context) error {
	b := newStopBudget(ctx, l.shutdownIn)
	defer b.close()
	t := time.NewTicker(l.cfg.Tick)
	defer t.Stop()
	for {
		l.tick(ctx, b.ctx)
		select {
		case <-ctx.Done():
			sctx, cancel := b.shutdownContext()
			defer cancel()
			return l.shutdown(sctx)
		case <-t.C:
		}
	}
}

// stopBudget is the shutdown's time budget, counted from the end of the run's
// context.
type stopBudget struct {
	d time.Duration
	// ctx is for work that outlives the run's context (hand-backs of
	// grants the allocator answered): it ends with the budget.
	ctx    context.Context
	cancel context.CancelFunc
	unhook func() bool

	mu    sync.Mutex
	end   time.Time // zero until the run's context ends
	timer *time.Timer
}

// newStopBudget returns the budget of d that starts when run ends.
func newStopBudget(run context.Context, d time.Duration) *stopBudget {
	b := &stopBudget{d: d}
	b.ctx, b.cancel = context.WithCancel(context.WithoutCancel(run))
	b.unhook = context.AfterFunc(run, func() { b.start() })
	return b
}

// start starts the budget, once, and returns its end.
func (b *stopBudget) start() time.Time {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.end.IsZero() {
		b.end = time.Now().Add(b.d)
		b.timer = time.AfterFunc(b.d, b.cancel)
	}
	return b.end
}

// shutdownContext is the shutdown's context: it ends with the budget, as
// its deadline (its calls cut short by it fail with DeadlineExceeded).
func (b *stopBudget) shutdownContext() (context.Context, context.CancelFunc) {
	return context.WithDeadline(context.WithoutCancel(b.ctx), b.start())
}

// close releases the budget's timer and ends b.ctx.
func (b *stopBudget) close() {
	b.unhook()
	b.mu.Lock()
	if b.timer != nil {
		b.timer.Stop()
	}
	b.mu.Unlock()
	b.cancel()
}

// Tick does one round: read the pools that are due, deposit the fallback
// allowances due while cut off, retry a pending Acquire with its request id,
// ask for every pool under its low watermark in one Acquire (more only when
// more than MaxWantsPerCall are due, or more than maxAcquireBytes of them),
// and forget the idle instances of templates.
//
// The fallbacks go before the retry: while the allocator is unreachable a
// retry can take AcquireTimeout, and a window's fallback allowance must not
// wait for it (requests starve for StarveWait, then get 503). Planning
// before the retry asks for nothing twice: the retried call's pools stay
// in flight until it settles.
func (l *leases) Tick(ctx context.Context) { l.tick(ctx, context.WithoutCancel(ctx)) }

// tick is Tick; after is the context of the hand-backs that outlive ctx
// (see grant).
func (l *leases) tick(ctx, after context.Context) {
	eng := l.eng.Load()
	if eng == nil {
		return
	}
	l.mu.Lock()
	pend := l.pending
	l.pending = nil
	l.mu.Unlock()

	stats := l.poll(ctx, eng)

	l.mu.Lock()
	now := l.clock.Now()
	var wants []*allotv1.Want
	var wantQ []*quota // the quota of each want
	var fallbacks []*quota
	for _, s := range stats {
		if l.quotas[s.q.name] != s.q {
			continue // forgotten meanwhile (a new policy)
		}
		l.observe(s.q, s.ps, s.at)
		w, fb := l.plan(s.q, now)
		if w != nil {
			wants = append(wants, w)
			wantQ = append(wantQ, s.q)
		}
		if fb {
			fallbacks = append(fallbacks, s.q)
		}
		if w == nil && !fb && l.idle(s.q, now) {
			l.forget(s.q)
		}
	}
	l.mu.Unlock()

	for _, q := range fallbacks {
		l.depositFallback(ctx, eng, q)
	}
	retried := false
	if len(pend) > 0 && l.client != nil {
		l.send(ctx, after, eng, pend)
		retried = true
	}

	l.mu.Lock()
	live := wants[:0]
	for i, w := range wants {
		if l.quotas[w.Quota] == wantQ[i] { // not forgotten by a policy applied meanwhile
			live = append(live, w)
		}
	}
	wants = live
	skipSend := l.client == nil || (retried && l.cutOff)
	var calls []*acquireCall
	if !skipSend && len(wants) > 0 {
		slices.SortFunc(wants, func(a, b *allotv1.Want) int { return compareStrings(a.Quota, b.Quota) })
		for i := 0; i < len(wants); {
			n, size := 0, 0
			for i+n < len(wants) && n < l.maxWants && (n == 0 || size+wantBytes(wants[i+n].Quota) <= maxAcquireBytes) {
				size += wantBytes(wants[i+n].Quota)
				n++
			}
			batch := wants[i : i+n]
			i += n
			c := &acquireCall{req: &allotv1.AcquireRequest{Region: l.region, RequestId: l.nextID(), Wants: batch}}
			for _, w := range batch {
				q := l.quotas[w.Quota]
				q.inflight = true
				c.maxTTL = max(c.maxTTL, q.spec.TTL)
			}
			calls = append(calls, c)
		}
	}
	l.mu.Unlock()

	if len(calls) > 0 {
		l.send(ctx, after, eng, calls)
	}
}

func compareStrings(a, b string) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

func (l *leases) nextID() string {
	l.seq++
	return l.region + "-" + l.id + "-" + strconv.FormatUint(l.seq, 36)
}

type polled struct {
	q  *quota
	ps admission.PoolStats
	at time.Time
}

// poll reads the pools that are due, StoreParallelism at a time.
func (l *leases) poll(ctx context.Context, eng *admission.Engine) []polled {
	l.mu.Lock()
	now := l.clock.Now()
	type job struct {
		name string
		q    *quota
	}
	var jobs []job
	for name, q := range l.quotas {
		due := q.kicked || !now.Before(q.nextPoll) || (!q.boundaryAt.IsZero() && !now.Before(q.boundaryAt)) ||
			(!q.pregrantAt.IsZero() && !now.Before(q.pregrantAt))
		if due {
			q.kicked = false
			q.boundaryAt, q.pregrantAt = time.Time{}, time.Time{}
			jobs = append(jobs, job{name, q})
		}
	}
	l.mu.Unlock()
	if len(jobs) == 0 {
		return nil
	}
	out := make([]polled, len(jobs))
	ok := make([]bool, len(jobs))
	var next atomic.Int64
	var wg sync.WaitGroup
	for w := 0; w < min(l.cfg.StoreParallelism, len(jobs)); w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := int(next.Add(1)) - 1
				if i >= len(jobs) {
					return
				}
				t0 := l.clock.Now()
				ps, err := eng.PoolStats(ctx, jobs[i].name)
				t1 := l.clock.Now()
				l.m.poolReads.Inc()
				if err != nil {
					l.storeError("stats", err)
					continue
				}
				l.observeStoreDelay(t1.Sub(t0))
				out[i], ok[i] = polled{q: jobs[i].q, ps: ps, at: t1}, true
			}
		}()
	}
	wg.Wait()
	res := out[:0]
	for i := range out {
		if ok[i] {
			res = append(res, out[i])
		} else {
			// Look again next tick.
			l.mu.Lock()
			jobs[i].q.nextPoll = l.clock.Now()
			l.mu.Unlock()
		}
	}
	return res
}

func (l *leases) storeError(op string, err error) {
	kind := "error"
	if errors.Is(err, context.DeadlineExceeded) {
		kind = "timeout"
	}
	l.m.storeErrors.WithLabelValues(op, kind).Inc()
	l.log.Debug("store call failed", zap.String("op", op), zap.Error(err))
}

// observeStoreDelay keeps a slowly decaying peak of the store round trip,
// the delay subtracted from deposit TTLs (a round trip bounds the one-way
// delay from above).
func (l *leases) observeStoreDelay(rtt time.Duration) {
	l.mu.Lock()
	defer l.mu.Unlock()
	decayed := time.Duration(float64(l.storeDelay) * 0.95)
	l.storeDelay = max(rtt, decayed, l.cfg.MinStoreDelay)
}

// minRateWindow is the shortest interval a demand rate is measured over.
const minRateWindow = 100 * time.Millisecond

// observe folds a pool reading into q's demand estimate. The caller holds
// l.mu.
func (l *leases) observe(q *quota, ps admission.PoolStats, at time.Time) {
	if q.haveStats {
		if dt := at.Sub(q.statsAt); dt > 0 {
			dc := max(0, ps.Consumed-q.stats.Consumed)
			ds := max(0, ps.Starved-q.stats.Starved)
			if dc > 0 || ds > 0 {
				q.lastActive = at
			}
			// A reading a moment after the previous one would turn one
			// starved request into a huge rate: measure over at least
			// minRateWindow.
			inst := (float64(dc) + float64(ds)*float64(q.cost)) / max(dt, l.cfg.Tick, minRateWindow).Seconds()
			q.demand += halfLifeAlpha(dt, l.cfg.DemandHalfLife) * (inst - q.demand)
			q.backlog = ds * q.cost
			if ds > 0 {
				q.starving = true // plan asks even above the watermark
			}
		}
	}
	// A first reading says nothing about starvation: the counters are the
	// store's since the pool's creation (a restarted agent would otherwise
	// take every pool that ever starved for starving). Starvation shows in
	// the next reading's delta, or sooner through Check (starved).
	q.stats, q.statsAt, q.haveStats = ps, at, true
}

// plan decides, from a fresh reading, whether q needs tokens now and returns
// the want (a renewal from the current window, else a pre-grant of the
// next), and whether a fallback allowance must be deposited. It schedules
// q's next look. The caller holds l.mu.
func (l *leases) plan(q *quota, now time.Time) (*allotv1.Want, bool) {
	w, fallback := l.planRenewal(q, now)
	if w == nil && !fallback {
		w = l.pregrant(q, now)
	}
	return w, fallback
}

// pregrant returns the want of a chunk of q's next window when it is time to
// ask for one (PregrantLead before the current window's estimated end),
// and otherwise schedules the look that will. Only pools with clamp on and
// demand take pre-grants: with clamp on every token they hold expires when
// the window turns. The caller holds l.mu.
func (l *leases) pregrant(q *quota, now time.Time) *allotv1.Want {
	lead := min(l.cfg.PregrantLead, q.spec.Window/4)
	if lead <= 0 || !q.spec.Clamp || q.demand < minDemand || q.inflight || l.cutOff || now.Before(q.quarantine) {
		return nil
	}
	w := q.spec.Window.Milliseconds()
	next := lease.WindowIndex(l.leaderMs(now), w) + 1
	if q.pregranted >= next {
		return nil // asked for this turn already
	}
	if at := l.windowEndEstimate(q, now).Add(-lead); now.Before(at) {
		q.pregrantAt = at
		return nil
	}
	q.pregranted = next
	// The current window's tokens die the margin before its end: requests
	// queue in that gap, and the pre-grant serves them when it opens.
	tokens := min(l.sizing(q).PregrantChunk(q.demand, l.margin()), q.spec.Limit)
	return &allotv1.Want{Quota: q.name, Tokens: tokens, DemandPerSecond: sanitizeRate(q.demand), NextWindow: true}
}

// planRenewal is plan's renewal from the current window.
func (l *leases) planRenewal(q *quota, now time.Time) (*allotv1.Want, bool) {
	q.nextPoll = now.Add(l.pollInterval(q))
	starving := q.starving
	q.starving = false
	held := q.stats.Available
	sz := l.sizing(q)
	// Renew at the watermark, not below it: at 1 token/s and a 1 s lead
	// the watermark is 1, and waiting for 0 means a request starves first.
	// A demand that decayed under minDemand is none: the pool is renewed
	// when a request starves, not forever in one-token chunks (the demand
	// estimate only tends to 0), and an idle instance can be forgotten.
	low := q.demand >= minDemand && held <= sz.LowWatermark(q.demand)
	if !low && (!starving || held >= q.cost) {
		return nil, false
	}
	fallback := false
	if l.cutOff {
		var withheld string
		fallback, withheld = l.fallbackState(q, now)
		if withheld != "" {
			l.withhold(q, withheld, starving, now)
		}
	}
	if q.inflight {
		return nil, fallback
	}
	if now.Before(q.quarantine) {
		return nil, fallback
	}
	if now.Before(q.exhaustedUntil) && (!starving || now.Before(q.recheckAt)) {
		return nil, false
	}
	// Too close to the window's end for a grant to be worth depositing (a
	// chunk's store TTL ends the margin and a deposit's bound before the
	// window does, see grant): ask right after the window turns.
	if end, near := l.turnNear(q, now); near {
		q.boundaryAt = end.Add(l.cfg.BoundaryDelay)
		// The requests starving now are owed a renewal at the turn: a
		// pool without measured demand is renewed only for them.
		q.starving = q.starving || starving
		return nil, false
	}
	// Enough for the demand until the next renewal lands, plus what the
	// requests starved since the last reading need now. (Sizing a starving
	// pool from its momentary rate instead turns a backlog piled up behind
	// a late round into a chunk the region cannot spend.)
	tokens := sz.Chunk(q.demand)
	if starving {
		tokens = min(tokens+q.backlog, q.spec.Chunk)
	}
	if q.demand <= 0 && q.backlog == 0 {
		tokens = q.spec.Chunk // first ask without any measurement: the policy's normal chunk
	}
	tokens = min(tokens, q.spec.Limit)
	q.backlog = 0
	q.nextPoll = now.Add(l.cfg.Tick)
	return &allotv1.Want{Quota: q.name, Tokens: tokens, DemandPerSecond: sanitizeRate(q.demand)}, fallback
}

func sanitizeRate(r float64) float64 {
	if math.IsNaN(r) || math.IsInf(r, 0) || r < 0 {
		return 0
	}
	return r
}

// sizing sizes q's chunks. Its lead is Config.Lead, shortened for a pool
// whose grants live too briefly to be spent from a stock that large
// (lease.LeadWithin): a fresh grant is spendable in the store for its TTL
// less the margin, the deposit bound and the round trip it took.
func (l *leases) sizing(q *quota) lease.Sizing {
	life := q.spec.TTL - l.margin() - l.depositBound() - l.acquireRTT
	lead := lease.LeadWithin(l.cfg.Lead, life, l.cfg.Tick, l.acquireRTT)
	return lease.Sizing{MinChunk: min(l.cfg.MinChunk, q.spec.Chunk), MaxChunk: q.spec.Chunk, Lead: lead, RTT: l.acquireRTT}
}

// pollInterval is how long q can go unobserved: half the time its held
// tokens last above the watermark at the measured demand, within [Tick,
// IdlePoll].
func (l *leases) pollInterval(q *quota) time.Duration {
	if q.demand <= 0 {
		return l.cfg.IdlePoll
	}
	spare := float64(q.stats.Available - l.sizing(q).LowWatermark(q.demand))
	d := time.Duration(spare / q.demand / 2 * float64(time.Second))
	return min(max(d, l.cfg.Tick), l.cfg.IdlePoll)
}

// windowEndEstimate is when (on the monotonic clock) q's current window
// ends, by the estimate of the leader's clock (leaderMs). It schedules
// renewals only; deadlines never use it.
func (l *leases) windowEndEstimate(q *quota, now time.Time) time.Time {
	w := q.spec.Window.Milliseconds()
	ms := l.leaderMs(now)
	end := lease.WindowEnd(lease.WindowIndex(ms, w), w)
	return now.Add(time.Duration(end-ms) * time.Millisecond)
}

// fallbackPolicy reports whether q's policy gives the region a fallback
// allowance while cut off.
func fallbackPolicy(q *quota) bool {
	return q.spec.FailMode == policy.FailFallback && q.spec.FallbackPerRegion > 0
}

// fallbackDue reports whether q may get its fallback allowance now. The
// caller holds l.mu.
func (l *leases) fallbackDue(q *quota, now time.Time) bool {
	due, _ := l.fallbackState(q, now)
	return due
}

// fallbackState reports whether q may get its fallback allowance now, and
// otherwise why an allowance the policy gives is withheld (fallbackWindow;
// "" when there is no allowance, or this window's is deposited). The caller
// holds l.mu.
func (l *leases) fallbackState(q *quota, now time.Time) (due bool, withheld string) {
	if !fallbackPolicy(q) {
		return false, ""
	}
	idx, _, withheld := l.fallbackWindow(q, now)
	if withheld != "" {
		return false, withheld
	}
	// Never an older window than the last allowance's (a new measurement
	// of a leader whose clock is behind).
	return !q.hasFallback || idx > q.fallbackIdx, ""
}

// turnNear returns the estimated end of q's window and whether it is too
// close for anything deposited now to be worth it (a deposit's store TTL
// ends the margin and a deposit's bound before the window does): rounds
// then keep q's starving requests for the turn. The caller holds l.mu.
func (l *leases) turnNear(q *quota, now time.Time) (time.Time, bool) {
	end := l.windowEndEstimate(q, now)
	return end, end.Sub(now) < l.margin()+l.acquireRTT+l.depositBound()+l.cfg.MinUsefulTTL
}

// fallbackNext reports whether q's window is in its last stretch (turnNear:
// its fallback allowance has expired or is about to) or in its first, where
// the leader's clock may not have reached it yet (withheldWindowStart), and
// the window's allowance will be due shortly: a request then waits for that
// deposit, as one of a connected region waits for the renewal at the turn,
// rather than being answered 503 for the rest of every window while the
// region is cut off. Nothing is due while the leader's clock was never
// measured. The caller holds l.mu.
func (l *leases) fallbackNext(q *quota, now time.Time) bool {
	if !fallbackPolicy(q) {
		return false
	}
	switch _, _, withheld := l.fallbackWindow(q, now); withheld {
	case withheldUnmeasured:
		return false
	case withheldWindowStart:
		return true
	}
	_, near := l.turnNear(q, now)
	return near
}

// depositFallback deposits q's fallback allowance for the current window,
// once, while the allocator is unreachable. It is the bound's fallback term.
func (l *leases) depositFallback(ctx context.Context, eng *admission.Engine, q *quota) {
	l.mu.Lock()
	now := l.clock.Now()
	if !l.cutOff || !l.fallbackDue(q, now) { // an answer since the plan ends the cut-off
		l.mu.Unlock()
		return
	}
	// The allowance is of the window that surely holds now by the leader's
	// clock, and ends the margin before that window surely ends, so no two
	// agents (or processes) of the region ever hold two windows' allowances
	// at once, whatever their wall clocks say.
	idx, deadline, _ := l.fallbackWindow(q, now)
	// The metric is labelled with the rule: a template's name for its
	// instances, so the labels stay bounded.
	name, rule, tokens := q.name, q.spec.Name, q.spec.FallbackPerRegion
	bound := l.depositBound()
	sent := l.clock.Now()
	leaderMs := l.leaderMs(sent)
	l.mu.Unlock()
	// As a grant's deposit (see grant): bounded by depositBound, and the
	// TTL counted from the send minus that bound, so a deposit answered
	// within it expires by the deadline however slow the store was; one
	// that may land late (a timeout, or an answer past the bound) is
	// withdrawn with a tombstone, so this window's allowance cannot spill
	// into the next one (the tombstone also voids this window's later
	// attempts: the region goes without its allowance, the safe side).
	ttl := lease.RedisTTL(deadline, sent, bound)
	if ttl < l.cfg.MinUsefulTTL {
		return
	}
	id := "fb-" + l.region + "-" + strconv.FormatInt(idx, 10)
	dctx, cancel := context.WithTimeout(ctx, bound)
	added, err := eng.DepositChunk(dctx, name, id, tokens, ttl)
	cancel()
	done := l.clock.Now()
	if err == nil {
		err = overBound(id, sent, done, bound)
	}
	var d depositTrace
	if err != nil {
		l.storeError("deposit", err)
		unsent := admission.Unsent(err)
		d.attempt(sent, done, ttl, !unsent)
		_, out, at := l.unsureDeposit(ctx, eng, &allotv1.Grant{Quota: name, GrantId: id, Tokens: tokens}, deadline, d)
		l.journalFallback(name, id, idx, tokens, leaderMs, deadline, d, err, out, at)
		return
	}
	d.attempt(sent, done, ttl, true)
	if !added {
		tokens = 0
	}
	l.journalFallback(name, id, idx, tokens, leaderMs, deadline, d, nil, false, time.Time{})
	if added {
		l.m.fallbackDep.WithLabelValues(rule).Inc()
		l.log.Warn("allocator unreachable: fallback allowance deposited", zap.String("quota", name), zap.Int64("tokens", tokens),
			zap.Duration("ttl", ttl))
	} // else the region's allowance for the window is in the store (another agent's), or tombstoned
	l.mu.Lock()
	q.hasFallback, q.fallbackIdx = true, idx
	q.changed()
	l.mu.Unlock()
}

// send runs the calls concurrently (one per MaxWantsPerCall quotas).
func (l *leases) send(ctx, after context.Context, eng *admission.Engine, calls []*acquireCall) {
	if len(calls) == 1 {
		l.do(ctx, after, eng, calls[0])
		return
	}
	var wg sync.WaitGroup
	for _, c := range calls {
		wg.Add(1)
		go func() {
			defer wg.Done()
			l.do(ctx, after, eng, c)
		}()
	}
	wg.Wait()
}

var wantIndex = regexp.MustCompile(`wants\[(\d+)\]`)

// tooManyWants matches the allocator's refusal of an Acquire that carries
// more wants than it takes, and captures its maximum: the server's check
// ("wants: 3 exceeds the maximum of 2 per call") and the state machine's
// ("wants: 3 entries, want 1 to 2").
var tooManyWants = regexp.MustCompile(`wants: \d+ (?:exceeds the maximum of|entries, want 1 to) (\d+)`)

// wantsLimit returns how many wants the calls after c, refused with err,
// should carry at most, when err refuses c for carrying too many: the
// maximum the refusal names, or half of c's wants when it names none that
// helps.
func wantsLimit(c *acquireCall, err error) (int, bool) {
	n := len(c.req.Wants)
	m := tooManyWants.FindStringSubmatch(err.Error())
	if m == nil || n < 2 || connect.CodeOf(err) != connect.CodeInvalidArgument {
		return 0, false
	}
	if lim, perr := strconv.Atoi(m[1]); perr == nil && lim >= 1 && lim < n {
		return lim, true
	}
	return n / 2, true
}

// do sends one Acquire (or its retry) and deposits what it grants; after is
// grant's.
func (l *leases) do(ctx, after context.Context, eng *admission.Engine, c *acquireCall) {
	cctx, cancel := context.WithTimeout(ctx, l.cfg.AcquireTimeout)
	t0 := l.clock.Now()
	first := c.sentAt.IsZero()
	if first {
		c.sentAt = t0 // read BEFORE the first send: deadlines count from it
	}
	if ce := l.log.Check(zap.DebugLevel, "acquire"); ce != nil {
		ws := make([]string, 0, min(len(c.req.Wants), 8))
		for _, w := range c.req.Wants[:min(len(c.req.Wants), 8)] {
			ws = append(ws, fmt.Sprintf("%s:%d@%.1f/s", w.Quota, w.Tokens, w.DemandPerSecond))
		}
		ce.Write(zap.String("request_id", c.req.RequestId), zap.Int("wants", len(c.req.Wants)), zap.Strings("first", ws))
	}
	resp, err := l.client.Acquire(cctx, c.req)
	cancel()
	t1 := l.clock.Now()
	c.recvAt = t1
	l.journalAcquire(c, t0, t1, resp, err)
	rtt := t1.Sub(t0)
	l.m.acquireCalls.Inc()
	l.m.acquireWants.Add(float64(len(c.req.Wants)))
	l.m.renewal.Observe(rtt.Seconds())
	if err != nil {
		l.failed(ctx, c, err, t1)
		return
	}
	if err := validateAcquire(c.req, resp); err != nil {
		l.m.renewFail.WithLabelValues("malformed").Inc()
		l.log.Warn("allocator answer refused", zap.String("request_id", c.req.RequestId), zap.Error(err))
		l.settle(c, true)
		return
	}
	l.mu.Lock()
	l.cutOff = false
	l.m.cutOff.Set(0)
	// Only a fresh answer to a first send measures the round trip and the
	// leader's clock. A retry's answer is the recorded result of an earlier
	// attempt (same request id), stamped with the leader's clock when that
	// attempt committed: measured against this attempt's send, it would make
	// the leader look as far behind as the answer was late, and the
	// fallback allowances and window-turn estimates scheduled from the
	// offset would run past the real window's end by as much.
	if first && !resp.Replayed {
		l.acquireRTT = time.Duration(0.8*float64(l.acquireRTT) + 0.2*float64(rtt))
		l.observeLeader(resp.LeaderNowUnixMs, t0, t1)
	}
	// Before the grants: their deadlines use it.
	l.observeMargin(resp.GetLeaseMarginMs())
	l.mu.Unlock()
	// Deposit concurrently: the store's auto-batcher pipelines them.
	if len(resp.Grants) == 1 {
		l.grant(ctx, after, eng, c, resp.Grants[0], resp.LeaderNowUnixMs)
		return
	}
	var next atomic.Int64
	var wg sync.WaitGroup
	for w := 0; w < min(l.cfg.StoreParallelism, len(resp.Grants)); w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := int(next.Add(1)) - 1; i < len(resp.Grants); i = int(next.Add(1)) - 1 {
				l.grant(ctx, after, eng, c, resp.Grants[i], resp.LeaderNowUnixMs)
			}
		}()
	}
	wg.Wait()
}

// failed handles an Acquire that got no answer or was refused.
func (l *leases) failed(ctx context.Context, c *acquireCall, err error, now time.Time) {
	if refused(err) {
		// Refused: nothing was granted. Leave the named quota (or all of
		// them) out for a while, and ask for the rest afresh. (The
		// allocator refuses a new instance of a template that has too many
		// with ResourceExhausted, naming its want.)
		l.m.renewFail.WithLabelValues("refused").Inc()
		l.mu.Lock()
		if lim, ok := wantsLimit(c, err); ok {
			// Refused for its size, not for any of its quotas: the
			// allocator takes fewer wants per call than MaxWantsPerCall.
			// Quarantining the quotas would only rebuild the same call
			// after QuarantineTime, for good: the next round asks for
			// them again in calls the allocator takes.
			l.maxWants = min(l.maxWants, lim)
			l.log.Warn("allocator refused an Acquire as too large: later calls carry fewer wants",
				zap.String("request_id", c.req.RequestId), zap.Int("wants", len(c.req.Wants)), zap.Int("max_wants", l.maxWants), zap.Error(err))
			for _, w := range c.req.Wants {
				if q := l.quotas[w.Quota]; q != nil {
					q.inflight = false
					q.kicked, q.starving = true, true // ask at the next round, as if starved
					if w.NextWindow {
						q.pregranted = 0 // nothing was granted: ask again
					}
				}
			}
			l.mu.Unlock()
			return
		}
		l.log.Warn("allocator refused Acquire", zap.String("request_id", c.req.RequestId), zap.Error(err))
		quarantine := now.Add(l.cfg.QuarantineTime)
		if m := wantIndex.FindStringSubmatch(err.Error()); m != nil {
			if i, perr := strconv.Atoi(m[1]); perr == nil && i < len(c.req.Wants) {
				if q := l.quotas[c.req.Wants[i].Quota]; q != nil {
					q.quarantine = quarantine
					q.changed() // its waiting requests are answered at once
				}
				quarantine = time.Time{}
			}
		}
		for _, w := range c.req.Wants {
			if q := l.quotas[w.Quota]; q != nil {
				q.inflight = false
				if !quarantine.IsZero() {
					q.quarantine = quarantine
					q.changed()
				}
			}
		}
		l.mu.Unlock()
		return
	}
	// No answer: the allocator may have committed the grants. Keep the call
	// to retry it with the same request id, as long as anything it could
	// return might still be spendable.
	if ctx.Err() != nil {
		// Shutting down cut the call short, and the allocator may have
		// committed its grants: shutdown replays it with its request id and
		// releases what it granted, as for a call kept to retry.
		l.mu.Lock()
		l.pending = append(l.pending, c)
		l.mu.Unlock()
		l.settle(c, false)
		return
	}
	l.m.renewFail.WithLabelValues("unreachable").Inc()
	l.log.Warn("allocator unreachable; spending held tokens only", zap.String("request_id", c.req.RequestId), zap.Error(err))
	l.mu.Lock()
	defer l.mu.Unlock()
	keep := now.Before(c.sentAt.Add(c.maxTTL))
	if keep {
		l.pending = append(l.pending, c)
	}
	if !l.cutOff {
		l.cutOff = true
		l.m.cutOff.Set(1)
		for _, q := range l.quotas {
			q.changed()
		}
	}
	if !keep {
		for _, w := range c.req.Wants {
			if q := l.quotas[w.Quota]; q != nil {
				q.inflight = false
			}
		}
	}
}

// settle clears the in-flight marks of c's quotas; unusable marks the
// allocator as unable to supply tokens (answered, but nothing usable).
func (l *leases) settle(c *acquireCall, unusable bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if unusable && !l.cutOff {
		l.cutOff = true
		l.m.cutOff.Set(1)
	}
	for _, w := range c.req.Wants {
		if q := l.quotas[w.Quota]; q != nil {
			q.inflight = false
			q.changed()
		}
	}
}

// validateAcquire refuses an answer that does not fit the request.
func validateAcquire(req *allotv1.AcquireRequest, resp *allotv1.AcquireResponse) error {
	if resp == nil {
		return fmt.Errorf("empty answer: %w", ErrMalformedGrant)
	}
	if len(resp.Grants) != len(req.Wants) {
		return fmt.Errorf("%d grants for %d wants: %w", len(resp.Grants), len(req.Wants), ErrMalformedGrant)
	}
	if resp.LeaderNowUnixMs <= 0 {
		return fmt.Errorf("leader_now_unix_ms %d: %w", resp.LeaderNowUnixMs, ErrMalformedGrant)
	}
	for i, g := range resp.Grants {
		w := req.Wants[i]
		switch {
		case g == nil:
			return fmt.Errorf("grants[%d]: missing: %w", i, ErrMalformedGrant)
		case g.Quota != w.Quota:
			return fmt.Errorf("grants[%d].quota %q: asked for %q: %w", i, g.Quota, w.Quota, ErrMalformedGrant)
		case g.Tokens < 0 || (w.Tokens > 0 && g.Tokens > w.Tokens):
			return fmt.Errorf("grants[%d].tokens %d: asked for %d: %w", i, g.Tokens, w.Tokens, ErrMalformedGrant)
		case g.Tokens > 0 && (g.GrantId == "" || len(g.GrantId) > admission.MaxRequestIDLen):
			return fmt.Errorf("grants[%d].grant_id %q: %w", i, g.GrantId, ErrMalformedGrant)
		case g.Tokens > 0 && g.ExpiresUnixMs-resp.LeaderNowUnixMs != g.TtlMs:
			return fmt.Errorf("grants[%d]: ttl_ms %d is not expires %d - leader now %d: %w", i, g.TtlMs, g.ExpiresUnixMs, resp.LeaderNowUnixMs, ErrMalformedGrant)
		case g.WindowEndUnixMs < resp.LeaderNowUnixMs && g.Tokens > 0:
			return fmt.Errorf("grants[%d]: window ended at %d before leader now %d: %w", i, g.WindowEndUnixMs, resp.LeaderNowUnixMs, ErrMalformedGrant)
		case !w.NextWindow && g.NotBeforeUnixMs != 0:
			return fmt.Errorf("grants[%d].not_before_unix_ms %d: no pre-grant was asked for: %w", i, g.NotBeforeUnixMs, ErrMalformedGrant)
		case g.NotBeforeUnixMs != 0 && g.Tokens > 0 && (g.NotBeforeUnixMs <= resp.LeaderNowUnixMs || g.NotBeforeUnixMs >= g.WindowEndUnixMs || g.ExpiresUnixMs <= g.NotBeforeUnixMs):
			return fmt.Errorf("grants[%d]: pre-grant for [%d, %d) expiring %d at leader now %d: %w", i, g.NotBeforeUnixMs, g.WindowEndUnixMs, g.ExpiresUnixMs, resp.LeaderNowUnixMs, ErrMalformedGrant)
		}
	}
	return nil
}

// grant deposits one grant, or hands it back when it cannot be used. The
// hand-backs run under after, which outlives ctx: the allocator answered,
// and its grant is worth handing back even when the agent is stopping
// (Run's after ends when the shutdown's budget runs out).
func (l *leases) grant(ctx, after context.Context, eng *admission.Engine, c *acquireCall, g *allotv1.Grant, leaderNow int64) {
	l.mu.Lock()
	q := l.quotas[g.Quota]
	if q == nil { // the policy changed meanwhile
		l.mu.Unlock()
		if g.Tokens > 0 {
			l.giveBack(after, g.Quota, g.GrantId, g.Tokens, nil)
		}
		return
	}
	q.inflight = false
	// A pre-grant is of the next window: it spends from that window's start
	// (opens) and says nothing about the current window's end or pool.
	pre := g.NotBeforeUnixMs > 0
	var opens time.Time
	if pre {
		opens = lease.NotBeforeDrift(c.recvAt, g.NotBeforeUnixMs, leaderNow, l.cfg.MaxDriftPPM)
		if g.Tokens > 0 {
			// Never ask twice for one window's pre-grant.
			q.pregranted = max(q.pregranted, g.WindowIndex)
		}
		if ce := l.log.Check(zap.DebugLevel, "pre-grant"); ce != nil {
			ce.Write(zap.String("quota", g.Quota), zap.String("grant", g.GrantId), zap.Int64("tokens", g.Tokens),
				zap.Duration("opens_in", opens.Sub(l.clock.Now())), zap.Int64("not_before_unix_ms", g.NotBeforeUnixMs))
		}
	} else {
		q.windowEnd = c.sentAt.Add(time.Duration(g.WindowEndUnixMs-leaderNow) * time.Millisecond)
	}
	if g.Tokens > 0 {
		// The clamped expiry must fit the policy (garbage guard): never
		// trust a lease longer than the quota's TTL (a pre-grant's TTL
		// runs from its window's start).
		life := g.TtlMs
		if pre {
			life = g.ExpiresUnixMs - g.NotBeforeUnixMs
		}
		if life > q.spec.TTL.Milliseconds() {
			l.mu.Unlock()
			l.m.renewFail.WithLabelValues("malformed").Inc()
			l.log.Warn("grant longer than the policy's TTL refused", zap.String("quota", g.Quota), zap.Int64("ttl_ms", life))
			l.giveBack(after, g.Quota, g.GrantId, g.Tokens, q)
			return
		}
		q.granted += g.Tokens
	}
	l.m.acquireToks.Add(float64(g.Tokens))
	deadline := lease.Deadline(c.sentAt, g.ExpiresUnixMs, leaderNow, l.margin())
	now := l.clock.Now()
	// depositBound is how long a deposit may take (see the loop below);
	// the store TTL leaves it unused, so the early check counts it too.
	depositBound := l.depositBound()
	ttl := lease.RedisTTL(deadline, now, depositBound)
	exhausted := g.PoolExhausted && !pre
	if exhausted {
		q.exhaustedUntil = q.windowEnd
		q.recheckAt = now.Add(l.cfg.ExhaustedRecheck)
	}
	if g.Tokens == 0 {
		q.changed()
		l.mu.Unlock()
		if exhausted {
			l.markExhausted(ctx, eng, q)
		}
		return
	}
	l.mu.Unlock()

	// The store work runs to its own bounds even when the agent is
	// stopping: a deposit whose caller gives up may still land if the
	// batcher had already sent it (a paused Redis runs it when it resumes),
	// and the shutdown that follows can only withdraw what this call knows
	// it deposited. (Those bounds are short: a deposit's, twice, and a
	// withdrawal's, only when a deposit failed.) The hand-backs, calls to
	// an allocator that may not answer, run under after.
	ctx = context.WithoutCancel(ctx)
	if ttl < l.cfg.MinUsefulTTL {
		l.m.renewFail.WithLabelValues("too_late").Inc()
		l.giveBack(after, g.Quota, g.GrantId, g.Tokens, q)
	} else {
		var (
			err        error
			added      bool
			dep        depositTrace
			storeOpens time.Time // by when, at the latest, the store opens a pre-grant
		)
		// A second attempt follows only one that certainly never reached
		// the store (admission.Unsent: the batcher drops a call whose
		// caller gave up before it was taken). One that may have (a timeout
		// after the batcher took it for the wire) is never followed by
		// another: the store keeps whichever copy lands first and counts
		// its TTL from that copy's arrival, and a late copy arrives after
		// the bound its TTL allowed for, so it would outlive the lease.
		// Such a deposit is settled by unsureDeposit instead.
		for attempt := 0; attempt < 2; attempt++ {
			// The TTL counts from this send: time spent since the
			// deadline was computed (the lock, an exhausted mark, a
			// failed attempt) must not push the store's expiry past it.
			// A deposit is bounded by its own timeout, and one answered
			// within it ran in Redis within it: counting the TTL from the
			// send minus that bound keeps the store's expiry at or before
			// the deadline however slow this call was (the measured store
			// delay alone is an average a loaded call can exceed).
			dsent := l.clock.Now()
			if ttl = lease.RedisTTL(deadline, dsent, depositBound); ttl < l.cfg.MinUsefulTTL {
				if attempt == 0 {
					err = fmt.Errorf("deposit of %s: %w", g.GrantId, errTooLate)
				}
				break
			}
			dctx, cancel := context.WithTimeout(ctx, depositBound)
			if start := opens.Sub(dsent); start > 0 {
				// Rounded up to the store's milliseconds: never earlier.
				start = (start + time.Millisecond - 1).Truncate(time.Millisecond)
				if start >= ttl {
					cancel()
					err = fmt.Errorf("pre-grant %s opens after its deadline: %w", g.GrantId, errTooLate)
					break
				}
				added, err = eng.DepositPregrant(dctx, g.Quota, g.GrantId, g.Tokens, start, ttl)
			} else {
				added, err = eng.DepositChunk(dctx, g.Quota, g.GrantId, g.Tokens, ttl)
			}
			cancel()
			done := l.clock.Now()
			// The store counts the start from the deposit's arrival, at
			// the latest when its answer came back, in whole milliseconds
			// (the start rounded up, and a decision's clock truncated to
			// the millisecond may read up to 1 ms behind).
			storeOpens = opens.Add(done.Sub(dsent) + 2*time.Millisecond)
			if admission.Unsent(err) {
				dep.attempt(dsent, done, ttl, false)
				continue // it had no effect: try once more
			}
			dep.attempt(dsent, done, ttl, true)
			// The expiry is within the deadline only if the deposit ran
			// within the bound of its send, by this attempt's TTL.
			// (With an error, no answer: it may still land, late; ctx
			// cannot end here: it is WithoutCancel.)
			if err == nil {
				err = overBound(g.GrantId, dsent, done, depositBound)
			}
			if err == nil && !added {
				// The store holds the grant already, with an expiry this
				// call did not set (no attempt of it came before).
				err = fmt.Errorf("deposit of %s: the store holds the grant already: %w", g.GrantId, errUnsureDeposit)
			}
			break
		}
		if err != nil {
			if errors.Is(err, errTooLate) {
				l.m.renewFail.WithLabelValues("too_late").Inc()
			} else {
				l.storeError("deposit", err)
				l.m.renewFail.WithLabelValues("deposit").Inc()
			}
			back, out, at := l.unsureDeposit(ctx, eng, g, deadline, dep)
			l.journalDeposit(g, deadline, dep, err, out, at)
			if back > 0 {
				l.giveBack(after, g.Quota, g.GrantId, back, q)
			}
		} else {
			l.journalDeposit(g, deadline, dep, nil, false, time.Time{})
			l.mu.Lock()
			q.grants[g.GrantId] = held{tokens: g.Tokens, deadline: deadline}
			q.deposits++
			for id, h := range q.grants { // forget grants whose lease is over
				if !now.Before(h.deadline) {
					delete(q.grants, id)
				}
			}
			if !exhausted {
				q.exhaustedUntil = time.Time{}
			}
			// Held tokens changed: look at the pool again soon.
			q.nextPoll = now.Add(l.cfg.Tick)
			q.changed()
			l.mu.Unlock()
			if wait := storeOpens.Sub(l.clock.Now()); pre && wait > 0 {
				// Requests starved at the turn wait for a change of the
				// pool: the opening of its pre-grant in the store is one.
				time.AfterFunc(wait, func() {
					l.mu.Lock()
					defer l.mu.Unlock()
					if l.quotas[q.name] == q {
						q.nextPoll = l.clock.Now()
						q.changed()
					}
				})
			}
		}
	}
	if exhausted {
		l.markExhausted(ctx, eng, q)
	}
}

// depositBound is how long one deposit attempt may take: a chunk's store
// TTL leaves it unused. The caller holds l.mu.
func (l *leases) depositBound() time.Duration {
	return max(4*l.storeDelay, l.cfg.DepositTimeout)
}

// unsureDeposit settles a deposit of g that failed, as its attempts in d
// tell. It returns how many of g's tokens certainly are not, and never will
// be, spendable in the store, so they may be handed back; whether nothing of
// g is spendable in the store after at (out); and at.
//
// A deposit no attempt of which reached the store (every one Unsent) left
// all of them out. One that may have (a timeout; an answer later than the
// deposit's bound; a grant the store held already) is withdrawn, which
// also tombstones g until a second after its deadline, so a copy still on
// its way adds nothing. The withdrawal returns the tokens g still held;
// when the store does not hold g at all, g either never landed or landed,
// was spent from, expired and was pruned: its tokens are handed back only
// when the withdrawal ran before the earliest instant at which a copy that
// landed could have expired (a copy expires its TTL after its arrival, and
// arrives after its send), otherwise they stay granted, unreturned:
// stranded capacity, never spent twice.
//
// When the withdrawal fails too (or the pool left the policy, whose keys a
// later policy may read again), nothing is handed back and out is false:
// the outcome is unknown. A copy still on its way may then land later, and
// count its TTL from its arrival: it stays spendable past the lease's
// deadline by as long as it was late. So may a copy arriving after the
// tombstone ended, more than a second past the deadline. The agent cannot
// bound that: deposits carry a relative TTL, and it has no reading of the
// store's clock to cap the expiry with.
func (l *leases) unsureDeposit(ctx context.Context, eng *admission.Engine, g *allotv1.Grant, deadline time.Time, d depositTrace) (back int64, out bool, at time.Time) {
	if !d.reached {
		return g.Tokens, true, l.clock.Now()
	}
	z, h, err := eng.PoolKeys(g.Quota)
	if err == nil && !l.wd.enabled() {
		err = errNoWithdraw
	}
	if err != nil {
		l.m.renewFail.WithLabelValues("deposit_unknown").Inc()
		l.log.Warn("deposit outcome unknown and not withdrawable: its tokens stay leased, unreturned",
			zap.String("quota", g.Quota), zap.String("grant", g.GrantId), zap.Int64("tokens", g.Tokens), zap.Error(err))
		return 0, false, d.end
	}
	// The tombstone outlasts the lease by a second (and is never skipped,
	// even past the deadline).
	tomb := max(deadline.Sub(l.clock.Now()), 0) + time.Second
	wctx, cancel := context.WithTimeout(ctx, l.cfg.AcquireTimeout)
	defer cancel()
	toks, err := l.wd.withdraw(wctx, g.Quota, z, h, []string{g.GrantId}, tomb)
	wend := l.clock.Now()
	if err != nil {
		l.storeError("withdraw", err)
		l.m.renewFail.WithLabelValues("deposit_unknown").Inc()
		l.log.Warn("deposit outcome unknown: its tokens stay leased, unreturned, and a late copy may outlive the lease",
			zap.String("quota", g.Quota), zap.String("grant", g.GrantId), zap.Int64("tokens", g.Tokens), zap.Error(err))
		return 0, false, d.end
	}
	if toks[0] >= 0 {
		return toks[0], true, wend
	}
	// Not in the store. A copy that landed expires no sooner than its TTL
	// after its send, by the store's clock: less a slack for the store's
	// milliseconds and for the two clocks' rates.
	if wend.Before(d.landedSent.Add(d.ttl - d.ttl/100 - 2*time.Millisecond)) {
		return g.Tokens, true, wend // it never landed, and the tombstone keeps it out
	}
	return 0, true, wend
}

// errUnsureDeposit: a deposit was answered, but not in a way that bounds its
// chunk's expiry by the lease (see unsureDeposit).
var errUnsureDeposit = errors.New("deposit outcome unsure")

// overBound is errUnsureDeposit for deposit id sent at sent and answered at
// done when that took longer than bound (its TTL then bounds nothing), nil
// otherwise.
func overBound(id string, sent, done time.Time, bound time.Duration) error {
	if took := done.Sub(sent); took > bound {
		return fmt.Errorf("deposit of %s answered after %s, beyond its bound %s: %w", id, took, bound, errUnsureDeposit)
	}
	return nil
}

// markExhausted tells the store the pool is exhausted until the window's
// end, so requests it cannot serve get Retry-After to the window's end.
func (l *leases) markExhausted(ctx context.Context, eng *admission.Engine, q *quota) {
	l.mu.Lock()
	d := q.exhaustedUntil.Sub(l.clock.Now()).Truncate(time.Millisecond)
	name := q.name
	q.changed()
	l.mu.Unlock()
	if d < time.Millisecond {
		return
	}
	if err := eng.MarkExhausted(ctx, name, d); err != nil {
		l.storeError("exhaust", err)
	}
}

// handBack returns a grant's tokens to the allocator and reports how many
// it credited back (0 when the grant's window has ended), or why the
// release failed: tokens not handed back stay granted and unspent,
// stranded, never overspent, until their lease expires.
func (l *leases) handBack(ctx context.Context, quotaName, grantID string, tokens int64, q *quota) (int64, error) {
	if l.client == nil || tokens <= 0 {
		return 0, nil
	}
	cctx, cancel := context.WithTimeout(ctx, l.cfg.AcquireTimeout)
	defer cancel()
	// One release per grant (the whole remainder), so the grant id names it:
	// the client's retries of it cannot hand the tokens back twice.
	sent := l.clock.Now()
	resp, err := l.client.Release(cctx, &allotv1.ReleaseRequest{Region: l.region, GrantId: grantID, Tokens: tokens, RequestId: "release-" + grantID})
	l.journalRelease(quotaName, grantID, tokens, sent, resp, err)
	if err != nil {
		return 0, err
	}
	if q != nil {
		l.mu.Lock()
		q.released += resp.GetReturned()
		l.mu.Unlock()
	}
	return resp.GetReturned(), nil
}

// giveBack is handBack of one grant, with a failure logged.
func (l *leases) giveBack(ctx context.Context, quotaName, grantID string, tokens int64, q *quota) {
	if _, err := l.handBack(ctx, quotaName, grantID, tokens, q); err != nil {
		l.log.Warn("tokens not handed back: the allocator did not acknowledge their release; they return to its pool when their lease expires",
			zap.String("quota", quotaName), zap.String("grant", grantID), zap.Int64("tokens", tokens), zap.Error(err))
	}
}

// shutdownReleases is how many Release calls shutdown keeps in flight.
const shutdownReleases = 16

// shutdownWithdrawals is how many withdrawals (one store call per quota)
// shutdown keeps in flight.
const shutdownWithdrawals = 16

// shutdown hands back what this agent holds: it withdraws its live grants
// from the store (atomically, so nothing withdrawn can be spent), then
// resolves calls whose answer never arrived and releases what they granted,
// then releases the withdrawn tokens to the allocator. Only a failed
// withdrawal is an error: an unreachable allocator lets the tokens it
// granted expire with their leases.
func (l *leases) shutdown(ctx context.Context) error {
	if l.client == nil {
		return nil
	}
	l.mu.Lock()
	pend := l.pending
	l.pending = nil
	type job struct {
		q      *quota
		name   string
		grants []string
	}
	var jobs []job
	now := l.clock.Now()
	for name, q := range l.quotas {
		var ids []string
		for id, h := range q.grants {
			if now.Before(h.deadline) {
				ids = append(ids, id)
			}
		}
		if len(ids) > 0 {
			slices.Sort(ids)
			jobs = append(jobs, job{q: q, name: name, grants: ids})
		}
	}
	l.mu.Unlock()
	// First the store, which is local and quick: withdrawn tokens can no
	// longer be spent. Only then the allocator, which may be unreachable:
	// its calls must not use up the time the withdrawals need.
	type back struct {
		q      *quota
		name   string
		grant  string
		tokens int64
	}
	var (
		mu          sync.Mutex // guards errs, backs and unreplayed while withdrawals and replays run side by side, then the releases' sums
		errs        []error
		backs       []back
		withdrawals errgroup.Group
	)
	// Side by side too: one quota after another, 10,000 quotas at a
	// store round trip each would take seconds of the shutdown budget.
	withdrawals.SetLimit(shutdownWithdrawals)
	if eng := l.eng.Load(); eng != nil {
		for _, j := range jobs {
			z, h, err := eng.PoolKeys(j.name)
			if err != nil { // the pool left the policy: its tokens expire unspent
				continue
			}
			withdrawals.Go(func() error {
				toks, err := l.wd.withdraw(ctx, j.name, z, h, j.grants, 0)
				if err != nil {
					l.storeError("withdraw", err)
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
					return nil
				}
				mu.Lock()
				for i, n := range toks {
					if n > 0 {
						backs = append(backs, back{q: j.q, name: j.name, grant: j.grants[i], tokens: n})
					}
				}
				mu.Unlock()
				l.mu.Lock()
				for _, id := range j.grants {
					delete(j.q.grants, id)
				}
				j.q.changed()
				l.mu.Unlock()
				return nil
			})
		}
	}
	_ = withdrawals.Wait() // each withdrawal reports into errs
	// Cut-short Acquires are replayed side by side as well: each may wait
	// up to AcquireTimeout for an allocator that is slow or gone, and one
	// after another they would leave the last ones no budget.
	var (
		unreplayed int
		replays    errgroup.Group
	)
	replays.SetLimit(shutdownReleases)
	for _, c := range pend {
		replays.Go(func() error {
			cctx, cancel := context.WithTimeout(ctx, l.cfg.AcquireTimeout)
			sent := l.clock.Now()
			resp, err := l.client.Acquire(cctx, c.req)
			cancel()
			l.journalAcquire(c, sent, l.clock.Now(), resp, err)
			if err != nil || validateAcquire(c.req, resp) != nil {
				mu.Lock()
				unreplayed++
				mu.Unlock()
				return nil
			}
			for _, g := range resp.Grants {
				if g.Tokens > 0 {
					l.mu.Lock()
					q := l.quotas[g.Quota]
					l.mu.Unlock()
					mu.Lock()
					backs = append(backs, back{q: q, name: g.Quota, grant: g.GrantId, tokens: g.Tokens})
					mu.Unlock()
				}
			}
			return nil
		})
	}
	_ = replays.Wait() // a failed replay is counted in unreplayed
	// Releases go out side by side: one at a time, a slow allocator (or
	// thousands of quotas) would run out the shutdown budget long before
	// the last one. Only what the allocator acknowledged counts as handed
	// back.
	var (
		unspent, returned, lost int64
		failed                  int
		firstErr                error
		g                       errgroup.Group
	)
	g.SetLimit(shutdownReleases)
	for _, b := range backs {
		unspent += b.tokens
		g.Go(func() error {
			n, err := l.handBack(ctx, b.name, b.grant, b.tokens, b.q)
			mu.Lock()
			defer mu.Unlock()
			if err != nil {
				lost += b.tokens
				failed++
				if firstErr == nil {
					firstErr = err
				}
				return nil
			}
			returned += n
			return nil
		})
	}
	_ = g.Wait() // failures are counted above: their tokens expire with their leases
	l.log.Info("unspent tokens handed back", zap.Int64("tokens", returned), zap.Int64("unspent", unspent), zap.Int("quotas", len(jobs)))
	if failed > 0 {
		l.log.Warn("unspent tokens not handed back: the allocator did not acknowledge their release; they return to its pool when their leases expire",
			zap.Int64("tokens", lost), zap.Int("releases", failed), zap.Error(firstErr))
	}
	if unreplayed > 0 {
		l.log.Warn("Acquire calls cut short could not be replayed: what they granted returns to the allocator's pool when the leases expire",
			zap.Int("calls", unreplayed))
	}
	if len(errs) > 0 {
		return fmt.Errorf("shutdown: %w", errors.Join(errs...))
	}
	return nil
}

// errTooLate: the lease ends too soon after the send for a deposit to be
// worth it (less than MinUsefulTTL left).
var errTooLate = errors.New("the lease ends too soon to deposit")
