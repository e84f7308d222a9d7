// Package loadgen is the chaos suite's load generator for agent-backed
// regions: a process inside the region's network namespace that offers each
// quota's requests to the region agent's Check API (allot.v1.AdmissionService)
// at the scenario's rates and records every decision, stamped with the
// suite's true clock, as a history event:
//
//   - allowed: history.KindAdmit;
//   - denied (429, the quota is exhausted or another rule denies):
//     history.KindDeny with history.ReasonLimited;
//   - unavailable (503, the limiter could not decide: cut off from the
//     allocator, no renewal within the agent's starve wait, the store down):
//     history.KindDeny with history.ReasonUnavailable;
//   - no answer from the agent after retries (only while the agent
//     restarts): history.KindDeny with history.ReasonNoAnswer.
//
// Every request carries a request id, and a request whose answer was lost is
// sent again with the same id until answered or RetryFor passes: the store
// remembers admitted request ids, so a retry replays an admission instead of
// admitting twice, and exactly one decision is recorded per request.
//
// An event is stamped when the answer arrives (At), after the store decided;
// Call is when the request was first sent.
package loadgen

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"connectrpc.com/connect"

	"github.com/allot-dev/allot/chaos/history"
	"github.com/allot-dev/allot/pkg/lease"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
	"github.com/allot-dev/allot/proto/allot/v1/allotv1connect"
)

// QuotaConfig is the load offered for one quota.
type QuotaConfig struct {
	// Name is the quota (it is also the tenant the request names).
	Name string `json:"name"`
	// WindowMs is the quota's window (FloodRate alternates by it).
	WindowMs int64 `json:"window_ms"`
	// Chunk is the policy's chunk: Storm offers n x Chunk/4 requests.
	Chunk int64 `json:"chunk"`
	// Rate is the offered requests per second.
	Rate float64 `json:"rate"`
	// FloodRate, when positive, makes the rate alternate by window of the
	// true clock: Rate in even windows, FloodRate in odd ones.
	FloodRate float64 `json:"flood_rate,omitempty"`
}

// Config configures a Generator.
type Config struct {
	// Region names the region in the events.
	Region string `json:"region"`
	// Agent is the agent's Connect API address (host:port).
	Agent string `json:"agent"`
	// Quotas are the loads.
	Quotas []QuotaConfig `json:"quotas"`
	// Tick is how often requests are started (default 10ms).
	Tick time.Duration `json:"tick"`
	// CallTimeout bounds one Check attempt (default 3s: above the agent's
	// starve wait).
	CallTimeout time.Duration `json:"call_timeout"`
	// RetryFor is how long a request without an answer is sent again
	// (default 4s).
	RetryFor time.Duration `json:"retry_for"`
	// MaxInFlight bounds the requests outstanding at once (default 2000);
	// requests beyond it are not offered and are counted as shed.
	MaxInFlight int `json:"max_in_flight"`
	// ClockOffset is the suite's true-clock offset (history.TrueClock).
	ClockOffset int64 `json:"clock_offset"`
}

func (c *Config) defaults() {
	if c.Tick <= 0 {
		c.Tick = 10 * time.Millisecond
	}
	if c.CallTimeout <= 0 {
		c.CallTimeout = 3 * time.Second
	}
	if c.RetryFor <= 0 {
		c.RetryFor = 4 * time.Second
	}
	if c.MaxInFlight <= 0 {
		c.MaxInFlight = 2000
	}
}

// ErrUnknownQuota is returned by commands naming a quota the generator does
// not offer load for.
var ErrUnknownQuota = errors.New("loadgen: unknown quota")

// Generator offers load and records decisions. Run owns the ticker; the
// other methods are safe for concurrent use.
type Generator struct {
	cfg    Config
	clock  history.Clock
	client allotv1connect.AdmissionServiceClient
	emit   func(history.Event)

	mu       sync.Mutex
	quotas   map[string]*quotaState
	names    []string
	stopping bool

	inflight atomic.Int64
	shed     atomic.Int64
	noAnswer atomic.Int64
	seq      atomic.Int64
	start    int64
	reqCtx   context.Context
	cancel   context.CancelFunc
	wg       sync.WaitGroup
	stopped  chan struct{}
}

type quotaState struct {
	cfg  QuotaConfig
	owed float64
}

// New returns a generator; emit receives every event and must be safe for
// concurrent use.
func New(cfg Config, clock history.Clock, client allotv1connect.AdmissionServiceClient, emit func(history.Event)) (*Generator, error) {
	cfg.defaults()
	if cfg.Region == "" || len(cfg.Quotas) == 0 {
		return nil, errors.New("loadgen: region and quotas are required")
	}
	g := &Generator{cfg: cfg, clock: clock, client: client, emit: emit, quotas: map[string]*quotaState{}, stopped: make(chan struct{}), start: clock.Now()}
	for _, q := range cfg.Quotas {
		if q.Name == "" || q.WindowMs <= 0 || q.Rate < 0 || q.FloodRate < 0 {
			return nil, fmt.Errorf("loadgen: quota %q: a name, a positive window and non-negative rates are required", q.Name)
		}
		g.quotas[q.Name] = &quotaState{cfg: q}
		g.names = append(g.names, q.Name)
	}
	sort.Strings(g.names)
	g.reqCtx, g.cancel = context.WithCancel(context.Background())
	return g, nil
}

// NewHTTPClient returns a client for the agent's API: cleartext HTTP/2
// with enough connections for thousands of concurrent requests.
func NewHTTPClient() *http.Client {
	var p http.Protocols
	p.SetUnencryptedHTTP2(true)
	return &http.Client{Transport: &http.Transport{
		Protocols:       &p,
		IdleConnTimeout: 30 * time.Second,
		DialContext:     (&net.Dialer{Timeout: time.Second, KeepAlive: 5 * time.Second}).DialContext,
		HTTP2:           &http.HTTP2Config{SendPingTimeout: time.Second, PingTimeout: time.Second},
	}}
}

// Run offers load until ctx ends or Stop is called, then waits for the
// requests in flight (each bounded by RetryFor plus a CallTimeout).
func (g *Generator) Run(ctx context.Context) error {
	defer close(g.stopped)
	t := time.NewTicker(g.cfg.Tick)
	defer t.Stop()
	last := g.clock.Now()
	for {
		select {
		case <-ctx.Done():
			g.cancel()
			g.wg.Wait()
			return nil
		case <-t.C:
		}
		now := g.clock.Now()
		dt := float64(min(now-last, int64(time.Second))) / 1e9
		last = now
		g.mu.Lock()
		if g.stopping {
			g.mu.Unlock()
			g.wg.Wait()
			return nil
		}
		type burst struct {
			quota string
			n     int64
		}
		var fire []burst
		for _, name := range g.names {
			q := g.quotas[name]
			q.owed += g.rate(q, now) * max(dt, 0)
			if n := int64(q.owed); n > 0 {
				q.owed -= float64(n)
				fire = append(fire, burst{name, n})
			}
		}
		g.mu.Unlock()
		for _, b := range fire {
			g.offer(b.quota, b.n)
		}
	}
}

// rate is q's offered rate at true instant now. The caller holds g.mu.
func (g *Generator) rate(q *quotaState, now int64) float64 {
	if q.cfg.FloodRate > 0 && lease.WindowIndex(now/1e6, q.cfg.WindowMs)%2 != 0 {
		return q.cfg.FloodRate
	}
	return q.cfg.Rate
}

// offer starts n requests for quota, each in its own goroutine, unless
// MaxInFlight is reached.
func (g *Generator) offer(quota string, n int64) {
	for range n {
		if g.inflight.Add(1) > int64(g.cfg.MaxInFlight) {
			g.inflight.Add(-1)
			g.shed.Add(1)
			continue
		}
		id := g.cfg.Region + "-" + strconv.FormatInt(g.start, 36) + "-" + strconv.FormatInt(g.seq.Add(1), 36)
		g.wg.Add(1)
		go func() {
			defer g.wg.Done()
			defer g.inflight.Add(-1)
			g.check(quota, id)
		}()
	}
}

// check sends one request (again with the same id while unanswered) and
// records its decision.
func (g *Generator) check(quota, id string) {
	req := connect.NewRequest(&allotv1.CheckRequest{
		Entries:   []*allotv1.DescriptorEntry{{Key: "tenant", Value: quota}},
		Cost:      1,
		RequestId: id,
	})
	call := g.clock.Now()
	giveUp := call + int64(g.cfg.RetryFor)
	ev := history.Event{Region: g.cfg.Region, Quota: quota, Call: call, Tokens: 1}
	for {
		ctx, cancel := context.WithTimeout(g.reqCtx, g.cfg.CallTimeout)
		resp, err := g.client.Check(ctx, req)
		cancel()
		now := g.clock.Now()
		if err == nil {
			ev.At = now
			switch m := resp.Msg; {
			case m.GetAllowed():
				// A replay repeats a decision an earlier attempt made,
				// whose answer was lost: the checkers place it anywhere
				// from the first send to this answer.
				ev.Kind, ev.Replayed, ev.Degraded = history.KindAdmit, m.GetReplayed(), m.GetDegraded()
			case m.GetUnavailable():
				ev.Kind, ev.Reason = history.KindDeny, history.ReasonUnavailable
			default:
				ev.Kind, ev.Reason = history.KindDeny, history.ReasonLimited
			}
			g.emit(ev)
			return
		}
		if connect.CodeOf(err) == connect.CodeInvalidArgument || now >= giveUp || g.reqCtx.Err() != nil {
			g.noAnswer.Add(1)
			ev.At, ev.Kind, ev.Reason, ev.Err = now, history.KindDeny, history.ReasonNoAnswer, err.Error()
			g.emit(ev)
			return
		}
		select {
		case <-time.After(100 * time.Millisecond):
		case <-g.reqCtx.Done():
		}
	}
}

// SetDemand sets quota's offered requests per second (an alternating flood
// is replaced by the steady rate).
func (g *Generator) SetDemand(quota string, rate float64) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	q, ok := g.quotas[quota]
	if !ok {
		return fmt.Errorf("%w: %s", ErrUnknownQuota, quota)
	}
	if rate < 0 {
		return fmt.Errorf("loadgen: rate %v: must not be negative", rate)
	}
	q.cfg.Rate, q.cfg.FloodRate = rate, 0
	return nil
}

// Storm offers, at once, n x Chunk/4 extra requests for every quota with
// demand: more than the agent holds, so every pool starves and the agent
// renews all of them in one batched Acquire.
func (g *Generator) Storm(n int) {
	g.mu.Lock()
	defer g.mu.Unlock() // held while offering: no request starts after Stop
	if g.stopping {
		return
	}
	for _, name := range g.names {
		q := g.quotas[name]
		if q.cfg.Rate <= 0 && q.cfg.FloodRate <= 0 {
			continue
		}
		g.offer(name, int64(max(n, 1))*max(q.cfg.Chunk/4, 1))
	}
}

// Stop stops offering load and waits (up to ctx) for the requests in flight.
func (g *Generator) Stop(ctx context.Context) error {
	g.mu.Lock()
	g.stopping = true
	g.mu.Unlock()
	select {
	case <-g.stopped:
		return nil
	case <-ctx.Done():
		g.cancel()
		return ctx.Err()
	}
}

// Counts returns the requests shed (MaxInFlight reached) and those never
// answered.
func (g *Generator) Counts() (shed, noAnswer int64) { return g.shed.Load(), g.noAnswer.Load() }
