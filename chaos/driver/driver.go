// Package driver is the chaos suite's region: a process that offers load for
// a region's leased quotas, spends only tokens it holds under unexpired
// leases, renews them from the allocator by demand, and records every grant,
// admission, denial, release and stranded chunk by the suite's true clock.
//
// It stands where the region agent, its Redis and the gateways will stand.
// It follows the rules the agent must follow:
//
//  1. A lease's deadline is measured from the moment the Acquire was first
//     SENT: lease.Deadline(firstSend, expires, leaderNow, margin). Only
//     intervals of one clock are used, so a skewed wall clock cannot move it.
//  2. An Acquire that got no answer is retried with the SAME request id until
//     it is answered (the allocator replays a recorded grant) or RetryFor
//     passes; the first send time stays the one deadlines are measured from.
//  3. A chunk is released (its whole unspent rest, once) only after the
//     region has stopped spending it, so a retried Release cannot return
//     tokens twice.
//
// Two deliberately broken modes exist for the checkers' own tests:
// QuotaConfig.Independent (admit the full limit without the allocator) and
// QuotaConfig.WallDeadline (trust the wall clock for lease deadlines).
package driver

import (
	"context"
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"net"
	"net/http"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	"github.com/allot-dev/allot/chaos/history"
	"github.com/allot-dev/allot/pkg/allocator"
	"github.com/allot-dev/allot/pkg/lease"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// QuotaConfig is one leased quota the region offers load for.
type QuotaConfig struct {
	// Name is the quota.
	Name string `json:"name"`
	// WindowMs is the quota's window length.
	WindowMs int64 `json:"window_ms"`
	// Rate is the offered requests per second.
	Rate float64 `json:"rate"`
	// FloodRate, when positive, makes the demand alternate by window (by the
	// region's wall clock): Rate in even windows, FloodRate in odd ones.
	FloodRate float64 `json:"flood_rate,omitempty"`
	// Sizing sizes renewals from the demand.
	Sizing lease.Sizing `json:"sizing"`
	// Clamp says the policy clamps the quota's leases to the window end.
	Clamp bool `json:"clamp"`
	// Independent, when positive, is a deliberately broken region: it admits
	// up to this many requests per window on its own, never asking the
	// allocator.
	Independent int64 `json:"independent,omitempty"`
	// WallDeadline is a deliberately broken deadline rule: stop spending at
	// expiry - margin read on the region's own wall clock, which a skewed
	// clock moves.
	WallDeadline bool `json:"wall_deadline,omitempty"`
}

// Config configures a Driver.
type Config struct {
	// Region is the region's name as the policy declares it.
	Region string `json:"region"`
	// Endpoints are the allocators' API addresses.
	Endpoints []string `json:"endpoints"`
	// Quotas are the quotas the region offers load for.
	Quotas []QuotaConfig `json:"quotas"`
	// Margin is subtracted from every lease deadline (the allocator's stated
	// lease margin).
	Margin time.Duration `json:"margin"`
	// Tick is how often load is offered (default 10ms).
	Tick time.Duration `json:"tick"`
	// CallTimeout bounds one Acquire or Release call (default 1.5s).
	CallTimeout time.Duration `json:"call_timeout"`
	// RetryFor is how long an unanswered request id is retried (default
	// 4s; it must stay below the allocator's idempotency retention of two
	// windows, or a late retry could be granted anew).
	RetryFor time.Duration `json:"retry_for"`
	// ReleaseBefore releases a chunk's unspent rest when its deadline is
	// this close and a later chunk of the quota is held (default 150ms).
	ReleaseBefore time.Duration `json:"release_before"`
	// ProbeEvery re-sends every Nth answered request id once, to check that
	// the allocator replays it (0: never).
	ProbeEvery int `json:"probe_every"`
	// Seed seeds the driver's randomness (probe delays).
	Seed uint64 `json:"seed"`
	// ClockOffset is the suite's true-clock offset (history.TrueClock).
	ClockOffset int64 `json:"clock_offset"`
}

// ErrUnknownQuota is returned by commands naming a quota the region does not drive.
var ErrUnknownQuota = errors.New("driver: unknown quota")

// ErrStopped is returned by commands sent after Stop.
var ErrStopped = errors.New("driver: stopped")

func (c *Config) defaults() {
	if c.Tick <= 0 {
		c.Tick = 10 * time.Millisecond
	}
	if c.CallTimeout <= 0 {
		c.CallTimeout = 1500 * time.Millisecond
	}
	if c.RetryFor <= 0 {
		c.RetryFor = 4 * time.Second
	}
	if c.ReleaseBefore <= 0 {
		c.ReleaseBefore = 150 * time.Millisecond
	}
}

// NewHTTPClient returns the driver's HTTP client: cleartext HTTP/2 with
// health pings, so a connection that a partition left half-dead is dropped
// within about two seconds instead of hanging calls after the heal.
func NewHTTPClient() *http.Client {
	var p http.Protocols
	p.SetHTTP1(true)
	p.SetUnencryptedHTTP2(true)
	return &http.Client{Transport: &http.Transport{
		Protocols:       &p,
		IdleConnTimeout: 30 * time.Second,
		DialContext:     (&net.Dialer{Timeout: time.Second, KeepAlive: 5 * time.Second}).DialContext,
		HTTP2:           &http.HTTP2Config{SendPingTimeout: time.Second, PingTimeout: time.Second},
	}}
}

// Driver is one region. Run owns its state; the other methods talk to Run.
type Driver struct {
	cfg    Config
	clock  history.Clock
	client *allocator.Client
	emit   func(history.Event)

	skew    atomic.Int64
	cmds    chan func(*state)
	results chan result
	stopped chan struct{}
	quit    chan struct{} // closed when Run abandons pending requests
	reqCtx  context.Context
	stopReq chan chan struct{}
	bg      sync.WaitGroup // request and probe goroutines
	idSeq   atomic.Int64
	start   int64

	rngMu sync.Mutex
	rng   *rand.Rand
}

type chunk struct {
	grantID   string
	window    int64
	left      int64
	deadline  int64 // true ns
	expiresMs int64
}

type quotaState struct {
	cfg       QuotaConfig
	rate      float64
	owed      float64
	chunks    []*chunk
	noAskTrue int64 // true ns: minimum pause after an exhausted answer
	cutOff    bool
	exhausted bool
	// clampEndMs and clampDeadline are the window end (allocator clock) and
	// the deadline (true ns) of the latest grant clamped to its window's end:
	// every later grant of that window dies at the same moment.
	clampEndMs    int64
	clampDeadline int64
	localWindow   int64
	localCount    int64
	normalFlight  bool
}

type state struct {
	quotas   map[string]*quotaState
	names    []string
	lastTick int64
	stopping bool
}

type want struct {
	quota string
	asked int64
	rate  float64
}

type request struct {
	id     string
	wants  []want
	normal bool
	call   int64 // true ns of the first send
}

type result struct {
	req     request
	resp    *allotv1.AcquireResponse
	outcome history.Outcome
	err     error
	at      int64
}

// New returns a driver. emit receives every event and must be safe for
// concurrent use.
func New(cfg Config, clock history.Clock, client *allocator.Client, emit func(history.Event)) (*Driver, error) {
	cfg.defaults()
	if cfg.Region == "" || len(cfg.Quotas) == 0 {
		return nil, errors.New("driver: region and quotas are required")
	}
	for _, q := range cfg.Quotas {
		if q.WindowMs <= 0 {
			return nil, fmt.Errorf("driver: quota %s: window_ms must be positive", q.Name)
		}
		if q.Independent == 0 {
			if err := q.Sizing.Validate(); err != nil {
				return nil, fmt.Errorf("driver: quota %s: %w", q.Name, err)
			}
		}
	}
	return &Driver{
		cfg: cfg, clock: clock, client: client, emit: emit,
		cmds: make(chan func(*state)), results: make(chan result, 64),
		stopped: make(chan struct{}), stopReq: make(chan chan struct{}), quit: make(chan struct{}),
		rng:   rand.New(rand.NewPCG(cfg.Seed, 0x5eed)),
		start: clock.Now(),
	}, nil
}

// wallMs is the region's notion of wall time: true time plus the skew.
func (d *Driver) wallMs(trueNs int64) int64 { return (trueNs + d.skew.Load()) / 1e6 }

// SetSkew skews the region's wall clock by skew from the true clock.
func (d *Driver) SetSkew(skew time.Duration) { d.skew.Store(int64(skew)) }

// SetDemand sets quota's offered requests per second (the alternating
// pattern, if configured, is replaced by a steady rate).
func (d *Driver) SetDemand(ctx context.Context, quota string, rate float64) error {
	return d.do(ctx, func(s *state) error {
		q, ok := s.quotas[quota]
		if !ok {
			return fmt.Errorf("%w: %s", ErrUnknownQuota, quota)
		}
		q.cfg.FloodRate = 0
		q.cfg.Rate = rate
		return nil
	})
}

// Storm fires n concurrent extra Acquires for every leased quota with demand.
func (d *Driver) Storm(ctx context.Context, n int) error {
	return d.do(ctx, func(s *state) error {
		for _, name := range s.names {
			q := s.quotas[name]
			if q.cfg.Independent > 0 || q.rate <= 0 {
				continue
			}
			ask := max(1, q.cfg.Sizing.Chunk(q.rate)/int64(max(n, 1)))
			for range n {
				d.send(request{id: d.newID(), wants: []want{{quota: name, asked: ask, rate: q.rate}}})
			}
		}
		return nil
	})
}

func (d *Driver) do(ctx context.Context, fn func(*state) error) error {
	errc := make(chan error, 1)
	select {
	case d.cmds <- func(s *state) { errc <- fn(s) }:
	case <-d.stopped:
		return ErrStopped
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case err := <-errc:
		return err
	case <-ctx.Done():
		return ctx.Err()
	}
}

func (d *Driver) newID() string {
	return fmt.Sprintf("%s-%d-%d", d.cfg.Region, d.start, d.idSeq.Add(1))
}

// Run offers load until ctx ends or Stop is called. On Stop it releases
// what it holds, waits (up to RetryFor) for pending requests to be answered,
// and returns.
func (d *Driver) Run(ctx context.Context) error {
	defer close(d.stopped)
	d.reqCtx = ctx
	abandon := func() {
		close(d.quit)
		d.bg.Wait()
	}
	s := &state{quotas: map[string]*quotaState{}, lastTick: d.clock.Now()}
	for _, qc := range d.cfg.Quotas {
		s.quotas[qc.Name] = &quotaState{cfg: qc}
		s.names = append(s.names, qc.Name)
	}
	sort.Strings(s.names)
	t := time.NewTicker(d.cfg.Tick)
	defer t.Stop()
	var stopDone chan struct{}
	for stopDone == nil {
		select {
		case <-ctx.Done():
			abandon()
			return nil
		case done := <-d.stopReq:
			stopDone = done
		case fn := <-d.cmds:
			fn(s)
		case r := <-d.results:
			d.apply(s, r)
		case <-t.C:
			d.tick(s)
		}
	}
	// Stopping: no more load; release held chunks (every Release starts
	// here, before the wait below), then settle pending requests. Grants
	// that arrive now are left to expire: they count as stranded.
	s.stopping = true
	d.tick(s)
	d.releaseAll(s)
	pending := make(chan struct{})
	go func() { d.bg.Wait(); close(pending) }()
	for {
		select {
		case r := <-d.results:
			d.apply(s, r)
		case <-pending:
			for {
				select {
				case r := <-d.results:
					d.apply(s, r)
				default:
					close(stopDone)
					return nil
				}
			}
		case <-ctx.Done():
			abandon()
			close(stopDone)
			return nil
		}
	}
}

// Stop asks Run to stop and waits until it has settled (or ctx ends).
func (d *Driver) Stop(ctx context.Context) error {
	done := make(chan struct{})
	select {
	case d.stopReq <- done:
	case <-d.stopped:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// currentRate is the quota's demand now, by the region's wall clock.
func (d *Driver) currentRate(q *quotaState, now int64) float64 {
	if q.cfg.FloodRate > 0 && lease.WindowIndex(d.wallMs(now), q.cfg.WindowMs)%2 != 0 {
		return q.cfg.FloodRate
	}
	return q.cfg.Rate
}

func (d *Driver) tick(s *state) {
	now := d.clock.Now()
	dt := float64(min(now-s.lastTick, int64(time.Second))) / 1e9
	s.lastTick = now
	var need []want
	for _, name := range s.names {
		q := s.quotas[name]
		q.rate = d.currentRate(q, now)
		if s.stopping {
			q.rate = 0
		}
		q.owed += q.rate * max(dt, 0)
		n := int64(q.owed)
		q.owed -= float64(n)
		if q.cfg.Independent > 0 {
			d.spendLocal(q, now, n)
			continue
		}
		d.expire(q, now)
		d.spend(q, now, n)
		if w, ok := d.needsRenewal(q, now); ok && !s.stopping {
			need = append(need, w)
		}
	}
	if len(need) > 0 {
		for _, w := range need {
			s.quotas[w.quota].normalFlight = true
		}
		d.send(request{id: d.newID(), wants: need, normal: true})
	}
	if !s.stopping {
		d.releaseSoon(s, now)
	}
}

// expire drops chunks whose deadline passed, recording unspent tokens as stranded.
func (d *Driver) expire(q *quotaState, now int64) {
	live := q.chunks[:0]
	for _, c := range q.chunks {
		if now >= c.deadline {
			if c.left > 0 {
				d.emit(history.Event{Kind: history.KindStrand, Region: d.cfg.Region, Quota: q.cfg.Name, At: now,
					GrantID: c.grantID, Tokens: c.left, Window: c.window, Deadline: c.deadline, ExpiresMs: c.expiresMs})
			}
			continue
		}
		live = append(live, c)
	}
	clear(q.chunks[len(live):])
	q.chunks = live
}

// spend admits up to n from held chunks, earliest deadline first, and denies the rest.
func (d *Driver) spend(q *quotaState, now, n int64) {
	sort.SliceStable(q.chunks, func(i, j int) bool { return q.chunks[i].deadline < q.chunks[j].deadline })
	for _, c := range q.chunks {
		if n == 0 {
			break
		}
		if c.left == 0 || now >= c.deadline {
			continue
		}
		take := min(n, c.left)
		c.left -= take
		n -= take
		d.emit(history.Event{Kind: history.KindAdmit, Region: d.cfg.Region, Quota: q.cfg.Name, At: now,
			GrantID: c.grantID, Tokens: take, Window: c.window, Deadline: c.deadline, ExpiresMs: c.expiresMs})
	}
	if n > 0 {
		reason := history.ReasonNoTokens
		switch {
		case q.cutOff:
			reason = history.ReasonCutOff
		case q.exhausted:
			reason = history.ReasonExhausted
		}
		d.emit(history.Event{Kind: history.KindDeny, Region: d.cfg.Region, Quota: q.cfg.Name, At: now, Tokens: n, Reason: reason})
	}
}

// spendLocal is the broken Independent mode: a per-window local limit.
func (d *Driver) spendLocal(q *quotaState, now, n int64) {
	w := lease.WindowIndex(d.wallMs(now), q.cfg.WindowMs)
	if w != q.localWindow {
		q.localWindow, q.localCount = w, 0
	}
	take := min(n, q.cfg.Independent-q.localCount)
	if take > 0 {
		q.localCount += take
		d.emit(history.Event{Kind: history.KindAdmit, Region: d.cfg.Region, Quota: q.cfg.Name, At: now, Tokens: take, Window: w})
	}
	if n-take > 0 {
		d.emit(history.Event{Kind: history.KindDeny, Region: d.cfg.Region, Quota: q.cfg.Name, At: now, Tokens: n - take, Reason: history.ReasonLocalLimit})
	}
}

// needsRenewal says whether q should ask for a chunk now, and how much: when
// the tokens that will still be spendable Lead from now fall to what Lead of
// demand takes. Near the end of a window with clamped leases, no new grant
// can outlive the clamped deadline, so the horizon shrinks to it, and after
// it the region waits for the next window (by its own wall clock) instead of
// taking grants that would die unspent.
func (d *Driver) needsRenewal(q *quotaState, now int64) (want, bool) {
	if q.rate <= 0 || q.normalFlight || now < q.noAskTrue {
		return want{}, false
	}
	if now >= q.clampDeadline && d.wallMs(now) < q.clampEndMs {
		return want{}, false
	}
	horizon := now + int64(q.cfg.Sizing.Lead)
	if q.clampDeadline > now && q.clampDeadline < horizon {
		horizon = q.clampDeadline
	}
	var usable int64
	for _, c := range q.chunks {
		if c.deadline >= horizon {
			usable += c.left
		}
	}
	need := int64(math.Ceil(q.rate * float64(horizon-now) / 1e9))
	if usable > need {
		return want{}, false
	}
	ask := q.cfg.Sizing.Chunk(q.rate)
	if q.cfg.Clamp {
		// A clamped grant dies a margin before the window ends: ask only
		// for what can be spent by then (by this region's wall clock).
		left := d.clampLeftMs(q, now)
		if left <= 0 {
			return want{}, false
		}
		ask = min(ask, max(1, int64(math.Ceil(q.rate*float64(left)/1000))))
	}
	return want{quota: q.cfg.Name, asked: ask, rate: q.rate}, true
}

// clampLeftMs is how long, by the region's wall clock, a grant of q's
// current window could be spent if it were clamped: to the window end minus
// the margin.
func (d *Driver) clampLeftMs(q *quotaState, now int64) int64 {
	wall := d.wallMs(now)
	end := lease.WindowEnd(lease.WindowIndex(wall, q.cfg.WindowMs), q.cfg.WindowMs)
	return end - wall - d.cfg.Margin.Milliseconds()
}

// send starts a goroutine that resolves req: it retries the same request
// id until an answer comes or RetryFor passes.
func (d *Driver) send(req request) {
	req.call = d.clock.Now()
	d.bg.Add(1)
	go func() {
		defer d.bg.Done()
		r := d.resolve(req)
		select {
		case d.results <- r:
		case <-d.quit:
			return
		}
		if r.outcome == history.OK && d.cfg.ProbeEvery > 0 {
			d.maybeProbe(req)
		}
	}()
}

func (d *Driver) resolve(req request) result {
	msg := &allotv1.AcquireRequest{Region: d.cfg.Region, RequestId: req.id}
	for _, w := range req.wants {
		msg.Wants = append(msg.Wants, &allotv1.Want{Quota: w.quota, Tokens: w.asked, DemandPerSecond: w.rate})
	}
	giveUp := req.call + int64(d.cfg.RetryFor)
	var lastErr error
	for attempt := 0; ; attempt++ {
		ctx, cancel := context.WithTimeout(d.reqCtx, d.cfg.CallTimeout)
		resp, err := d.client.Acquire(ctx, msg)
		cancel()
		now := d.clock.Now()
		if err == nil {
			return result{req: req, resp: resp, outcome: history.OK, at: now}
		}
		lastErr = err
		if definite(err) {
			return result{req: req, outcome: history.Failed, err: err, at: now}
		}
		if now >= giveUp || d.reqCtx.Err() != nil {
			return result{req: req, outcome: history.Unknown, err: lastErr, at: now}
		}
		select {
		case <-time.After(min(200*time.Millisecond, time.Duration(giveUp-now))):
		case <-d.reqCtx.Done():
		}
	}
}

// definite reports whether err means the request was not applied.
func definite(err error) bool {
	switch connect.CodeOf(err) {
	case connect.CodeInvalidArgument, connect.CodeNotFound, connect.CodeFailedPrecondition, connect.CodeResourceExhausted:
		return true
	}
	return false
}

// apply takes a resolved request into the state and records it.
func (d *Driver) apply(s *state, r result) {
	byQuota := map[string]*allotv1.Grant{}
	if r.resp != nil {
		for _, g := range r.resp.GetGrants() {
			byQuota[g.GetQuota()] = g
		}
	}
	for _, w := range r.req.wants {
		q := s.quotas[w.quota]
		if r.req.normal {
			q.normalFlight = false
		}
		ev := history.Event{Kind: history.KindAcquire, Region: d.cfg.Region, Quota: w.quota, At: r.at, Call: r.req.call,
			Outcome: r.outcome, RequestID: r.req.id, Asked: w.asked}
		if r.err != nil {
			ev.Err = r.err.Error()
		}
		q.cutOff = r.outcome != history.OK
		g := byQuota[w.quota]
		if r.outcome == history.OK && g == nil {
			ev.Outcome, ev.Err = history.Failed, "no grant for the quota in the response"
		}
		if g != nil {
			ev.GrantID, ev.Tokens, ev.Window = g.GetGrantId(), g.GetTokens(), g.GetWindowIndex()
			ev.ExpiresMs, ev.LeaderNowMs, ev.Replayed, ev.Exhausted = g.GetExpiresUnixMs(), r.resp.GetLeaderNowUnixMs(), r.resp.GetReplayed(), g.GetPoolExhausted()
			q.exhausted = g.GetPoolExhausted() && g.GetTokens() < w.asked
			if q.exhausted {
				// Ask again in 300 ms: other regions hand back what they
				// cannot spend, and the next window opens a new pool.
				q.noAskTrue = r.at + int64(300*time.Millisecond)
			}
			if g.GetTokens() > 0 {
				ev.Deadline = d.deadline(q, r.req.call, g.GetExpiresUnixMs(), r.resp.GetLeaderNowUnixMs())
				if q.cfg.Clamp && g.GetExpiresUnixMs() == g.GetWindowEndUnixMs() && g.GetWindowEndUnixMs() >= q.clampEndMs {
					q.clampEndMs, q.clampDeadline = g.GetWindowEndUnixMs(), ev.Deadline
				}
				q.chunks = append(q.chunks, &chunk{grantID: g.GetGrantId(), window: g.GetWindowIndex(), left: g.GetTokens(),
					deadline: ev.Deadline, expiresMs: g.GetExpiresUnixMs()})
			}
		}
		d.emit(ev)
	}
}

// deadline is the true-clock instant after which a grant must not be spent.
func (d *Driver) deadline(q *quotaState, sentTrue, expiresMs, leaderNowMs int64) int64 {
	if q.cfg.WallDeadline {
		// Broken on purpose: "stop at expiry - margin" on the region's wall
		// clock, which is true time + skew.
		return expiresMs*1e6 - int64(d.cfg.Margin) - d.skew.Load()
	}
	return lease.Deadline(time.Unix(0, sentTrue), expiresMs, leaderNowMs, d.cfg.Margin).UnixNano()
}

// releaseSoon hands back the unspent rest of chunks about to die when a
// later chunk of the same quota is held, and, for clamped quotas, whole
// chunks the region cannot spend before the window ends (so other regions
// can have them).
func (d *Driver) releaseSoon(s *state, now int64) {
	for _, name := range s.names {
		q := s.quotas[name]
		var latest int64
		for _, c := range q.chunks {
			latest = max(latest, c.deadline)
		}
		for _, c := range q.chunks {
			if c.left > 0 && c.deadline-now < int64(d.cfg.ReleaseBefore) && c.deadline < latest {
				d.release(q, c, now)
			}
		}
		if !q.cfg.Clamp || q.rate <= 0 {
			continue
		}
		var held int64
		for _, c := range q.chunks {
			held += c.left
		}
		// Keep what the rest of the window can spend plus one lead of
		// demand; give back whole chunks beyond that, latest deadline first.
		keep := int64(math.Ceil(q.rate*float64(max(d.clampLeftMs(q, now), 0))/1000)) + q.cfg.Sizing.LowWatermark(q.rate)
		sort.SliceStable(q.chunks, func(i, j int) bool { return q.chunks[i].deadline > q.chunks[j].deadline })
		for _, c := range q.chunks {
			if c.left > 0 && held-c.left >= keep {
				held -= c.left
				d.release(q, c, now)
			}
		}
	}
}

// releaseAll hands back every chunk's unspent rest (on stop).
func (d *Driver) releaseAll(s *state) {
	now := d.clock.Now()
	for _, name := range s.names {
		q := s.quotas[name]
		for _, c := range q.chunks {
			if c.left > 0 && now < c.deadline {
				d.release(q, c, now)
			}
		}
	}
}

// release stops spending c, then sends one Release for its whole rest.
func (d *Driver) release(q *quotaState, c *chunk, now int64) {
	tokens := c.left
	c.left = 0 // spending stops before the tokens go back
	d.bg.Add(1)
	go func() {
		defer d.bg.Done()
		ctx, cancel := context.WithTimeout(d.reqCtx, d.cfg.CallTimeout)
		resp, err := d.client.Release(ctx, &allotv1.ReleaseRequest{Region: d.cfg.Region, GrantId: c.grantID, Tokens: tokens, RequestId: "release-" + c.grantID})
		cancel()
		ev := history.Event{Kind: history.KindRelease, Region: d.cfg.Region, Quota: q.cfg.Name, Call: now, At: d.clock.Now(),
			GrantID: c.grantID, Tokens: tokens, Window: c.window, Outcome: history.OK}
		switch {
		case err == nil:
			ev.Returned = resp.GetReturned()
		case definite(err):
			ev.Outcome, ev.Err = history.Failed, err.Error()
			if connect.CodeOf(err) == connect.CodeNotFound {
				ev.Reason = "not_found"
			}
		default:
			ev.Outcome, ev.Err = history.Unknown, err.Error()
		}
		d.emit(ev)
	}()
}

func (d *Driver) maybeProbe(req request) {
	d.rngMu.Lock()
	hit := d.rng.IntN(d.cfg.ProbeEvery) == 0
	wait := time.Duration(50+d.rng.IntN(450)) * time.Millisecond
	d.rngMu.Unlock()
	if !hit {
		return
	}
	select {
	case <-time.After(wait):
	case <-d.reqCtx.Done():
		return
	}
	msg := &allotv1.AcquireRequest{Region: d.cfg.Region, RequestId: req.id}
	for _, w := range req.wants {
		msg.Wants = append(msg.Wants, &allotv1.Want{Quota: w.quota, Tokens: w.asked, DemandPerSecond: w.rate})
	}
	call := d.clock.Now()
	ctx, cancel := context.WithTimeout(d.reqCtx, d.cfg.CallTimeout)
	resp, err := d.client.Acquire(ctx, msg)
	cancel()
	at := d.clock.Now()
	for _, w := range req.wants {
		ev := history.Event{Kind: history.KindProbe, Region: d.cfg.Region, Quota: w.quota, Call: call, At: at, RequestID: req.id, Asked: w.asked, Outcome: history.OK}
		if err != nil {
			ev.Outcome, ev.Err = history.Unknown, err.Error()
		} else {
			for _, g := range resp.GetGrants() {
				if g.GetQuota() == w.quota {
					ev.GrantID, ev.Tokens, ev.Window, ev.Replayed = g.GetGrantId(), g.GetTokens(), g.GetWindowIndex(), resp.GetReplayed()
				}
			}
		}
		d.emit(ev)
	}
}
