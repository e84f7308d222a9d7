package chaos

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/allot-dev/allot/chaos/history"
	"github.com/allot-dev/allot/chaos/loadgen"
	"github.com/allot-dev/allot/pkg/agent"
	"github.com/allot-dev/allot/pkg/allocator"
	"github.com/allot-dev/allot/pkg/topology"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// AgentRegion is a Region run by the real thing: the region's redis-server
// and regionagent (cmd/regionagent) inside the region's network namespace
// (topology.StartRegion with Netns), and a load generator process there too
// (chaosregion -mode load, package chaos/loadgen) that sends each quota's
// requests to the agent's Check API and reports every decision over the
// control socket.
//
// The agent reports what it leased through its lease journal
// (regionagent -lease-journal), which AgentRegion follows and turns into
// history events (journalConv): every Acquire with its grants, the deadline
// each deposit gave Redis, every Release. AgentRegion also re-sends one in
// eight of the agent's answered request ids itself, from the region's
// namespace through the same WAN proxies (a probe: the allocator must
// replay the recorded grant).
//
// Faults: SetClockSkew restarts the agent with -clock-offset (the agent
// has no runtime clock control: the restart, which hands its tokens back
// and takes new ones, is part of the fault); RestartStore kills
// redis-server with SIGKILL and starts it again on the same address (its
// tokens are lost); Storm makes the load generator fire a burst that
// drains every pool at once.
type AgentRegion struct {
	name     string
	agentBin string
	loadBin  string
	ctl      *control

	env     RegionEnv
	region  *topology.Region
	journal *journalTail
	load    *topology.Process
	conn    *driverConn

	mu      sync.Mutex // serializes agent restarts, store restarts and Stop
	skew    time.Duration
	stopped bool

	probeMu  sync.Mutex // guards probeRng and probe starts against Stop
	probes   *allocator.Client
	probeRng *rand.Rand
	probeSem chan struct{}
	probeWg  sync.WaitGroup
	probeCtx context.Context
	probeEnd context.CancelFunc
}

var _ Region = (*AgentRegion)(nil)

// newAgentRegion returns an agent region; agentBin is the regionagent
// binary, loadBin the chaosregion binary.
func newAgentRegion(name, agentBin, loadBin string, ctl *control) *AgentRegion {
	return &AgentRegion{name: name, agentBin: agentBin, loadBin: loadBin, ctl: ctl}
}

// Name implements Region.
func (a *AgentRegion) Name() string { return a.name }

// probeEvery is one in how many answered request ids are re-sent.
const probeEvery = 8

// agentArgs are the regionagent flags of a chaos region: the allocator's
// lease margin, renewals half a TTL ahead (like the driver: a renewal may
// take several WAN round trips), the journal, and quiet logs.
func agentArgs(env RegionEnv, journal string) ([]string, error) {
	if len(env.Quotas) == 0 {
		return nil, errors.New("no quotas")
	}
	ttl := env.Quotas[0].TTL
	for _, q := range env.Quotas {
		if q.Independent > 0 || q.WallDeadline {
			return nil, fmt.Errorf("quota %s: the broken modes Independent and WallDeadline exist only in the region driver", q.Quota)
		}
		ttl = min(ttl, q.TTL)
	}
	args := []string{
		"-log-level", "warn",
		"-lease-margin", env.Margin.String(),
		"-lease-lead", (ttl / 2).String(),
		"-lease-journal", journal,
		// Three regions of three processes, the allocators and the suite
		// share two cores: a Redis call can take longer than the default
		// 50 ms under load, and a fail-closed quota would answer 503. The
		// suite checks the lease protocol, not the store's latency.
		"-store-timeout", "500ms",
	}
	if len(env.AllocatorsGRPC) > 0 {
		// Leases over the allocators' gRPC listeners, as the demo does.
		args = append(args, "-allocators-grpc", strings.Join(env.AllocatorsGRPC, ","))
	}
	return args, nil
}

// Start implements Region: it starts Redis and the agent in env.Host, waits
// until the agent has the policy, then starts following its journal and
// the load generator.
func (a *AgentRegion) Start(ctx context.Context, env RegionEnv) error {
	a.env = env
	dir := filepath.Join(env.Dir, "region-"+a.name)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	jdir := env.LogDir
	if jdir == "" {
		jdir = dir
	}
	jpath, err := filepath.Abs(filepath.Join(jdir, a.name+"-lease-journal.jsonl"))
	if err != nil {
		return err
	}
	if err := os.Remove(jpath); err != nil && !errors.Is(err, os.ErrNotExist) { // a previous run's
		return err
	}
	args, err := agentArgs(env, jpath)
	if err != nil {
		return fmt.Errorf("region %s: %w", a.name, err)
	}
	conv := newJournalConv(a.name, env.Record)
	conv.probe = a.maybeProbe
	a.probeRng = rand.New(rand.NewPCG(env.Seed, 0x9a0be))
	a.probeSem = make(chan struct{}, 4)
	a.probeCtx, a.probeEnd = context.WithCancel(context.Background())
	hc := allocator.NewHTTPClient()
	if t, ok := hc.Transport.(*http.Transport); ok {
		t.DialContext = func(ctx context.Context, network, addr string) (net.Conn, error) {
			return env.Host.DialContext(ctx, &net.Dialer{Timeout: time.Second}, network, addr)
		}
	}
	if a.probes, err = allocator.NewClient(env.Allocators, allocator.WithHTTPClient(hc), allocator.WithAttempts(2),
		allocator.WithAttemptTimeout(time.Second)); err != nil {
		return err
	}
	a.journal = startJournalTail(jpath, conv)
	a.region, err = topology.StartRegion(ctx, topology.RegionConfig{
		Name: a.name, AgentBin: a.agentBin, Dir: dir, AllocatorEndpoints: env.Allocators,
		AgentArgs: args, Output: env.Log, Netns: env.Host,
	})
	if err != nil {
		return fmt.Errorf("region %s: %w", a.name, err)
	}
	if err := a.region.WaitReady(ctx); err != nil {
		return fmt.Errorf("region %s: %w", a.name, err)
	}

	cfg := loadgen.Config{Region: a.name, Agent: a.region.APIAddr, ClockOffset: env.Clock.Offset}
	for _, q := range env.Quotas {
		cfg.Quotas = append(cfg.Quotas, loadgen.QuotaConfig{Name: q.Quota, WindowMs: q.Window.Milliseconds(), Chunk: q.Chunk, Rate: q.Rate, FloodRate: q.FloodRate})
	}
	a.load, a.conn, err = a.ctl.start(ctx, env.Host, "chaosload-"+a.name, a.loadBin, []string{"-mode", "load"}, filepath.Join(dir, "load.json"), cfg,
		a.name+loadgen.HelloSuffix, "region "+a.name+": load generator", env.Log)
	return err
}

// SetDemand implements Region.
func (a *AgentRegion) SetDemand(ctx context.Context, quota string, perSecond float64) error {
	return a.conn.call(ctx, history.Command{Op: history.OpDemand, Quota: quota, Rate: perSecond})
}

// SetClockSkew implements Region: it restarts the agent with its clock
// skew from true time (regionagent -clock-offset). SIGTERM first, so the
// agent hands back what it holds; the load generator's requests meanwhile
// are retried with their request ids.
func (a *AgentRegion) SetClockSkew(ctx context.Context, skew time.Duration) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.stopped {
		return fmt.Errorf("region %s: stopped", a.name)
	}
	if skew == a.skew {
		return nil
	}
	a.logMetrics(ctx, "before the restart with clock offset "+skew.String())
	stopErr := a.region.Agent.Stop(10 * time.Second)
	args := slices.Clone(a.region.Args)
	if i := slices.Index(args, "-clock-offset"); i >= 0 {
		args = slices.Delete(args, i, i+2)
	}
	if skew != 0 {
		args = append(args, "-clock-offset", skew.String())
	}
	a.region.Args = args
	if err := a.region.StartAgent(ctx); err != nil {
		return fmt.Errorf("region %s: restart the agent with clock offset %s: %w", a.name, skew, errors.Join(stopErr, err))
	}
	if err := a.region.WaitReady(ctx); err != nil {
		return fmt.Errorf("region %s: %w", a.name, err)
	}
	a.skew = skew
	if stopErr != nil {
		return fmt.Errorf("region %s: the agent did not stop cleanly before the skew: %w", a.name, stopErr)
	}
	return nil
}

// Storm implements Region: n x chunk/4 extra requests per quota at once,
// more than the agent holds, so every pool starves and the agent renews
// all of them in one batched Acquire (the agent's closest equivalent of n
// concurrent renewals: it never sends more than one Acquire per tick).
func (a *AgentRegion) Storm(ctx context.Context, n int) error {
	return a.conn.call(ctx, history.Command{Op: history.OpStorm, N: n})
}

// StormDetail describes Storm for the fault timeline.
func (a *AgentRegion) StormDetail(n int) string {
	return fmt.Sprintf("request burst: %d x chunk/4 extra Checks per quota at once from every region (drains every pool: one batched renewal each)", n)
}

// RestartStore implements Region: kill -9 the region's redis-server and
// start it again on the same address. Everything deposited is lost: the
// region can only under-admit until its agent renews.
func (a *AgentRegion) RestartStore(ctx context.Context) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.stopped {
		return fmt.Errorf("region %s: stopped", a.name)
	}
	return a.region.RestartRedis(ctx)
}

// maybeProbe re-sends an answered request id of the agent, one time in
// probeEvery, 50-500 ms later, from the region's namespace: the allocator
// must replay the recorded grant.
func (a *AgentRegion) maybeProbe(id string, wants []agent.JournalWant) {
	a.probeMu.Lock()
	defer a.probeMu.Unlock()
	if a.probeCtx.Err() != nil || a.probeRng.IntN(probeEvery) != 0 {
		return
	}
	wait := time.Duration(50+a.probeRng.IntN(450)) * time.Millisecond
	select {
	case a.probeSem <- struct{}{}:
	default:
		return // enough probes in flight
	}
	a.probeWg.Add(1)
	go func() {
		defer a.probeWg.Done()
		defer func() { <-a.probeSem }()
		select {
		case <-time.After(wait):
		case <-a.probeCtx.Done():
			return
		}
		msg := &allotv1.AcquireRequest{Region: a.name, RequestId: id}
		for _, w := range wants {
			msg.Wants = append(msg.Wants, &allotv1.Want{Quota: w.Quota, Tokens: w.Tokens, DemandPerSecond: w.DemandPerSecond, NextWindow: w.Next})
		}
		call := a.env.Clock.Now()
		ctx, cancel := context.WithTimeout(a.probeCtx, 2*time.Second)
		resp, err := a.probes.Acquire(ctx, msg)
		cancel()
		at := a.env.Clock.Now()
		for _, w := range wants {
			ev := history.Event{Kind: history.KindProbe, Region: a.name, Quota: w.Quota, Call: call, At: at, RequestID: id, Asked: w.Tokens, Next: w.Next, Outcome: history.OK}
			if err != nil {
				ev.Outcome, ev.Err = history.Unknown, err.Error()
			} else {
				for _, g := range resp.GetGrants() {
					if g.GetQuota() == w.Quota {
						ev.GrantID, ev.Tokens, ev.Window, ev.Replayed = g.GetGrantId(), g.GetTokens(), g.GetWindowIndex(), resp.GetReplayed()
						ev.NotBeforeMs = g.GetNotBeforeUnixMs()
					}
				}
			}
			a.env.Record(ev)
		}
	}()
}

// agentMetrics are the agent metrics logged before the agent stops: why it
// answered what it answered.
var agentMetrics = []string{
	"allot_agent_decisions_total", "allot_agent_fail_mode_total", "allot_agent_starve_waits_total",
	"allot_agent_store_errors_total", "allot_agent_renewal_failures_total", "allot_agent_acquire_calls_total",
}

// logMetrics writes the agent's decision and failure counters to the
// region's log (best effort: a diagnostic, not a check).
func (a *AgentRegion) logMetrics(ctx context.Context, when string) {
	if a.region == nil || a.env.Log == nil {
		return
	}
	hc := &http.Client{Timeout: 2 * time.Second, Transport: &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		return a.env.Host.DialContext(ctx, nil, network, addr)
	}}}
	defer hc.CloseIdleConnections()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+a.region.APIAddr+"/metrics", nil)
	if err != nil {
		return
	}
	resp, err := hc.Do(req)
	if err != nil {
		fmt.Fprintf(a.env.Log, "region %s agent metrics %s: %v\n", a.name, when, err)
		return
	}
	defer resp.Body.Close()
	var b strings.Builder
	sc := bufio.NewScanner(io.LimitReader(resp.Body, 4<<20))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		for _, m := range agentMetrics {
			if strings.HasPrefix(line, m) {
				b.WriteString("  " + line + "\n")
			}
		}
	}
	fmt.Fprintf(a.env.Log, "region %s agent metrics %s:\n%s", a.name, when, b.String())
}

// Stop implements Region: the load generator stops (and settles its
// requests), then the agent gets SIGTERM (it withdraws its unspent tokens
// from Redis and releases them), then Redis is killed and the journal read
// to its end. It is safe to call more than once.
func (a *AgentRegion) Stop(ctx context.Context) error {
	a.mu.Lock()
	if a.stopped {
		a.mu.Unlock()
		return nil
	}
	a.stopped = true
	a.mu.Unlock()
	var errs []error
	if a.load != nil {
		if a.conn != nil && !a.load.Exited() {
			errs = append(errs, a.conn.call(ctx, history.Command{Op: history.OpStop}))
		}
		select {
		case <-a.load.Done():
		case <-ctx.Done():
			a.load.Kill()
			errs = append(errs, fmt.Errorf("region %s: load generator killed after %w", a.name, ctx.Err()))
		}
		if a.conn != nil {
			a.conn.wait(time.Second)
		}
	}
	if a.probeEnd != nil {
		a.probeMu.Lock()
		a.probeEnd()
		a.probeMu.Unlock()
		a.probeWg.Wait()
	}
	if a.region != nil {
		if a.region.Agent != nil && !a.region.Agent.Exited() {
			a.logMetrics(ctx, "at the end")
			if err := a.region.Agent.Stop(10 * time.Second); err != nil {
				errs = append(errs, fmt.Errorf("region %s: %w", a.name, err))
			}
		}
		if a.region.Redis != nil {
			a.region.Redis.Kill()
		}
	}
	if a.journal != nil {
		errs = append(errs, a.journal.close(ctx))
	}
	return errors.Join(errs...)
}
