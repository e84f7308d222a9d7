package allocator_test

import (
	"bufio"
	"context"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"

	"github.com/allot-dev/allot/pkg/allocator"
	"github.com/allot-dev/allot/pkg/topology"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// stormPolicy has a roomy quota the storm keeps drawing from, and a tight one
// the storm exhausts, so both Σ granted <= G and exhaustion are exercised.
const stormPolicy = `
name: storm
regions: [eu, us]
rules:
  - name: roomy
    scope: global
    match: [{key: route, value: storm}]
    kind: global_quota
    limit: 10000000
    window: 1h
    fail_mode: closed
    lease: {chunk: 10, ttl: 10m, clamp: true}
  - name: tight
    scope: tenant
    match: [{key: tenant, value: atlas}]
    kind: global_quota
    limit: 500
    window: 1h
    fail_mode: closed
    lease: {chunk: 10, ttl: 10m, clamp: true}
`

var (
	buildOnce sync.Once
	buildDir  string // allocatorBin's temporary directory
	buildBin  string
	buildErr  error
)

func TestMain(m *testing.M) {
	code := m.Run()
	if buildDir != "" {
		os.RemoveAll(buildDir) // 26 MB a run, left in the temporary directory otherwise
	}
	os.Exit(code)
}

// allocatorBin builds cmd/allocator once per test binary; TestMain removes
// it.
func allocatorBin(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		wd, err := os.Getwd()
		if err != nil {
			buildErr = err
			return
		}
		root, err := topology.ModuleRoot(wd)
		if err != nil {
			buildErr = err
			return
		}
		dir, err := os.MkdirTemp("", "allot-bin-")
		if err != nil {
			buildErr = err
			return
		}
		buildDir = dir
		bins, err := topology.Build(context.Background(), root, dir, "./cmd/allocator")
		buildBin, buildErr = bins["./cmd/allocator"], err
	})
	if buildErr != nil {
		t.Fatal(buildErr)
	}
	return buildBin
}

type procCluster struct {
	*topology.Allocators
	t *testing.T
}

// startProcCluster starts n real allocator processes that bootstrap a
// cluster; they are killed when the test ends, and their output is printed
// when it failed.
func startProcCluster(t *testing.T, n int) *procCluster {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	a, err := topology.StartAllocators(ctx, topology.AllocatorConfig{
		Nodes: n, Bin: allocatorBin(t), Dir: t.TempDir(), ExtraArgs: []string{"-log-level", "warn"},
	})
	if err != nil {
		t.Fatal(err)
	}
	pc := &procCluster{Allocators: a, t: t}
	t.Cleanup(pc.cleanup)
	return pc
}

func (pc *procCluster) cleanup() {
	for _, n := range pc.Nodes {
		if n.Proc == nil {
			continue
		}
		n.Proc.Kill()
		if pc.t.Failed() {
			pc.t.Logf("--- output of %s ---\n%s", n.ID, n.Proc.Output())
		}
	}
}

func (pc *procCluster) start(n *topology.AllocatorNode) {
	pc.t.Helper()
	if err := pc.Start(n); err != nil {
		pc.t.Fatal(err)
	}
}

func (pc *procCluster) waitUp(ctx context.Context, n *topology.AllocatorNode) {
	pc.t.Helper()
	if err := pc.WaitUp(ctx, n); err != nil {
		pc.t.Fatal(err)
	}
}

func (pc *procCluster) waitLeader(ctx context.Context) (*topology.AllocatorNode, time.Time) {
	pc.t.Helper()
	n, err := pc.WaitLeader(ctx)
	if err != nil {
		pc.t.Fatal(err)
	}
	return n, time.Now()
}

func (pc *procCluster) endpoints() []string { return pc.Endpoints() }

type ack struct {
	region string
	resp   *allotv1.AcquireResponse
}

// TestProcessClusterStormFailoverRestart is the allocator's integration test:
// three real allocator processes on loopback, an Acquire storm from concurrent
// clients, kill -9 of the leader mid-storm, then checks that every
// acknowledged grant survived (lost grants = 0), that retries are idempotent,
// that Σ granted <= G, and that a restart of all three from disk keeps state.
func TestProcessClusterStormFailoverRestart(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	pc := startProcCluster(t, 3)
	pc.waitLeader(ctx)

	client, err := allocator.NewClient(pc.endpoints(), allocator.WithAttempts(20), allocator.WithBackoff(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	op := client.Operator()
	pub, err := op.PublishPolicy(ctx, &allotv1.PublishPolicyRequest{Document: []byte(stormPolicy), ExpectedVersion: 1, Author: "test", Reason: "storm"})
	if err != nil {
		t.Fatalf("publish: %v", err)
	}

	// The storm: workers retry each request with the same id until it is
	// acknowledged, so every committed grant ends up acknowledged.
	var (
		mu       sync.Mutex
		acks     = map[string]ack{}
		stop     atomic.Bool
		wg       sync.WaitGroup
		failures atomic.Int64
	)
	const workers = 16
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			region := []string{"eu", "us"}[w%2]
			for i := 0; !stop.Load() && i < 100000; i++ {
				id := fmt.Sprintf("w%d-%d", w, i)
				req := &allotv1.AcquireRequest{Region: region, RequestId: id, Wants: []*allotv1.Want{
					{Quota: "roomy", Tokens: 10, DemandPerSecond: 100}, {Quota: "tight", Tokens: 10, DemandPerSecond: 100},
				}}
				for attempt := 0; ; attempt++ {
					cctx, ccancel := context.WithTimeout(ctx, 2*time.Second)
					resp, err := client.Acquire(cctx, req)
					ccancel()
					if err == nil {
						mu.Lock()
						acks[id] = ack{region: region, resp: resp}
						mu.Unlock()
						break
					}
					failures.Add(1)
					if ctx.Err() != nil || attempt > 200 {
						t.Errorf("request %s never acknowledged: %v", id, err)
						return
					}
				}
			}
		}(w)
	}

	time.Sleep(1500 * time.Millisecond)
	leader, _ := pc.waitLeader(ctx)
	killedAt := time.Now()
	leader.Proc.Kill()
	_, electedAt := pc.waitLeader(ctx)
	t.Logf("leader %s killed; a new leader answered %s later", leader.ID, electedAt.Sub(killedAt).Round(time.Millisecond))
	time.Sleep(1500 * time.Millisecond)
	stop.Store(true)
	wg.Wait()
	if t.Failed() {
		return
	}
	t.Logf("%d acknowledged Acquire calls, %d retried attempts", len(acks), failures.Load())
	if len(acks) < 50 {
		t.Fatalf("storm too small to mean anything: %d acknowledged calls", len(acks))
	}

	// Every acknowledged grant is in the leader's ledger; nothing else is.
	ackedTokens := map[string]int64{}
	ackedIDs := map[string]map[string]int64{"roomy": {}, "tight": {}}
	for _, a := range acks {
		for _, g := range a.resp.GetGrants() {
			if g.GetTokens() == 0 {
				continue
			}
			if _, dup := ackedIDs[g.GetQuota()][g.GetGrantId()]; dup {
				t.Errorf("grant id %s acknowledged twice", g.GetGrantId())
			}
			ackedIDs[g.GetQuota()][g.GetGrantId()] = g.GetTokens()
			ackedTokens[g.GetQuota()] += g.GetTokens()
		}
	}
	ledgers := map[string]*allotv1.GetWindowResponse{}
	for _, q := range []string{"roomy", "tight"} {
		w, err := op.GetWindow(ctx, &allotv1.GetWindowRequest{Quota: q})
		if err != nil {
			t.Fatalf("GetWindow %s: %v", q, err)
		}
		ledgers[q] = w
		inLedger := map[string]int64{}
		for _, g := range w.GetGrants() {
			inLedger[g.GetGrantId()] = g.GetTokens()
		}
		for id, tok := range ackedIDs[q] {
			if inLedger[id] != tok {
				t.Errorf("%s: acknowledged grant %s (%d tokens) missing from the ledger after failover (ledger has %d)", q, id, tok, inLedger[id])
			}
		}
		if w.GetGranted() != ackedTokens[q] {
			t.Errorf("%s: ledger granted %d tokens, clients were acknowledged %d", q, w.GetGranted(), ackedTokens[q])
		}
		if w.GetGranted() > w.GetLimit() {
			t.Errorf("%s: granted %d exceeds G=%d", q, w.GetGranted(), w.GetLimit())
		}
	}
	if got := ledgers["tight"].GetGranted(); got != 500 {
		t.Errorf("tight: the storm should have exhausted the pool exactly: granted %d of 500", got)
	}

	// What the nodes export: the grants and tokens they handed out, the
	// exhausted pool, the new leader's applies, leadership change and pool
	// gauges, and the health endpoints.
	newLeader, _ := pc.waitLeader(ctx)
	var grants, tokens, exhausted float64
	for _, nd := range pc.Nodes {
		if nd == leader {
			continue // killed
		}
		m := scrape(t, ctx, nd.APIAddr)
		grants += m["allot_allocator_grants_total"]
		tokens += m["allot_allocator_tokens_granted_total"]
		exhausted += m["allot_allocator_pool_exhausted_total"]
		if nd == newLeader {
			for name, want := range map[string]float64{
				"allot_allocator_is_leader":                     1,
				`allot_allocator_pool_remaining{quota="tight"}`: float64(ledgers["tight"].GetRemaining()),
				`allot_allocator_pool_remaining{quota="roomy"}`: float64(ledgers["roomy"].GetRemaining()),
			} {
				if got, ok := m[name]; !ok || got != want {
					t.Errorf("leader %s: %s = %v (exported %v), want %v", nd.ID, name, got, ok, want)
				}
			}
			for _, name := range []string{"allot_allocator_apply_seconds_count", "allot_allocator_leader_changes_total", "allot_allocator_applied_index"} {
				if m[name] < 1 {
					t.Errorf("leader %s: %s = %v, want at least 1", nd.ID, name, m[name])
				}
			}
		}
		for path, want := range map[string]int{"/healthz": http.StatusOK, "/readyz": http.StatusOK} {
			if code := getStatus(t, ctx, nd.APIAddr, path); code != want {
				t.Errorf("%s %s: %d, want %d", nd.ID, path, code, want)
			}
		}
	}
	if grants < 1 || tokens < grants || exhausted < 1 {
		t.Errorf("live nodes exported %v grants, %v tokens granted, %v exhausted answers; want grants, tokens and the tight pool's exhaustion", grants, tokens, exhausted)
	}

	// Retries with the same request id return the recorded grants.
	checked := 0
	for id, a := range acks {
		if checked == 40 {
			break
		}
		checked++
		req := &allotv1.AcquireRequest{Region: a.region, RequestId: id, Wants: []*allotv1.Want{{Quota: "roomy", Tokens: 10}, {Quota: "tight", Tokens: 10}}}
		resp, err := client.Acquire(ctx, req)
		if err != nil {
			t.Fatalf("retry %s: %v", id, err)
		}
		if !resp.GetReplayed() || !sameGrants(resp.GetGrants(), a.resp.GetGrants()) {
			t.Errorf("retry of %s granted anew: replayed=%v %v vs %v", id, resp.GetReplayed(), resp.GetGrants(), a.resp.GetGrants())
		}
	}
	after, err := op.GetWindow(ctx, &allotv1.GetWindowRequest{Quota: "roomy"})
	if err != nil {
		t.Fatal(err)
	}
	if after.GetGranted() != ledgers["roomy"].GetGranted() {
		t.Errorf("retries changed the ledger: %d -> %d", ledgers["roomy"].GetGranted(), after.GetGranted())
	}

	// Restart all three from disk (the killed one first, then a rolling stop).
	pc.start(leader)
	pc.waitUp(ctx, leader)
	for _, nd := range pc.Nodes {
		if err := nd.Proc.Stop(10 * time.Second); err != nil {
			t.Errorf("graceful stop: %v", err)
		}
	}
	for _, nd := range pc.Nodes {
		pc.start(nd)
	}
	pc.waitLeader(ctx)
	for _, q := range []string{"roomy", "tight"} {
		w, err := op.GetWindow(ctx, &allotv1.GetWindowRequest{Quota: q, WindowIndex: ledgers[q].GetWindowIndex()})
		if err != nil {
			t.Fatalf("GetWindow %s after restart: %v", q, err)
		}
		if w.GetGranted() != ledgers[q].GetGranted() || len(w.GetGrants()) != len(ledgers[q].GetGrants()) {
			t.Errorf("%s after restart: granted %d in %d grants, before %d in %d", q, w.GetGranted(), len(w.GetGrants()), ledgers[q].GetGranted(), len(ledgers[q].GetGrants()))
		}
	}
	got, err := op.GetPolicy(ctx, &allotv1.GetPolicyRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if got.GetPolicy().GetVersion() != pub.GetPolicy().GetVersion() || got.GetPolicy().GetDigest() != pub.GetPolicy().GetDigest() {
		t.Errorf("policy after restart: v%d %s, before v%d %s", got.GetPolicy().GetVersion(), got.GetPolicy().GetDigest(), pub.GetPolicy().GetVersion(), pub.GetPolicy().GetDigest())
	}
}

// scrape reads a node's /metrics into a map from series (name and labels,
// as written) to value.
func scrape(t *testing.T, ctx context.Context, addr string) map[string]float64 {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+"/metrics", nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("scrape %s: %v", addr, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("scrape %s: %s", addr, resp.Status)
	}
	out := map[string]float64{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			continue
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			t.Fatalf("scrape %s: bad line %q", addr, line)
		}
		out[line[:i]] = v
	}
	if err := sc.Err(); err != nil {
		t.Fatalf("scrape %s: %v", addr, err)
	}
	return out
}

// getStatus returns the status code of GET path on addr.
func getStatus(t *testing.T, ctx context.Context, addr, path string) int {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, "http://"+addr+path, nil)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("GET %s%s: %v", addr, path, err)
	}
	resp.Body.Close()
	return resp.StatusCode
}

func sameGrants(a, b []*allotv1.Grant) bool {
	return slices.EqualFunc(a, b, func(x, y *allotv1.Grant) bool {
		return x.GetGrantId() == y.GetGrantId() && x.GetTokens() == y.GetTokens() && x.GetExpiresUnixMs() == y.GetExpiresUnixMs()
	})
}

// TestProcessBadInput checks the codes and messages bad input gets from a
// real process, and that it leaves state untouched.
func TestProcessBadInput(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	pc := startProcCluster(t, 1)
	pc.waitLeader(ctx)
	client, _ := allocator.NewClient(pc.endpoints())
	op := client.Operator()
	if _, err := op.PublishPolicy(ctx, &allotv1.PublishPolicyRequest{Document: []byte(stormPolicy), ExpectedVersion: 1, Author: "t", Reason: "r"}); err != nil {
		t.Fatal(err)
	}
	huge := make([]byte, 5<<20)
	tests := []struct {
		name string
		call func() error
		code connect.Code
		msg  string
	}{
		{"unknown quota", func() error {
			_, err := client.Acquire(ctx, &allotv1.AcquireRequest{Region: "eu", RequestId: "x1", Wants: []*allotv1.Want{{Quota: "nope", Tokens: 1}}})
			return err
		}, connect.CodeNotFound, "nope"},
		{"empty region", func() error {
			_, err := client.Acquire(ctx, &allotv1.AcquireRequest{RequestId: "x2", Wants: []*allotv1.Want{{Quota: "roomy"}}})
			return err
		}, connect.CodeInvalidArgument, "region"},
		{"negative tokens", func() error {
			_, err := client.Acquire(ctx, &allotv1.AcquireRequest{Region: "eu", RequestId: "x3", Wants: []*allotv1.Want{{Quota: "roomy", Tokens: -5}}})
			return err
		}, connect.CodeInvalidArgument, "tokens"},
		{"huge tokens", func() error {
			_, err := client.Acquire(ctx, &allotv1.AcquireRequest{Region: "eu", RequestId: "x4", Wants: []*allotv1.Want{{Quota: "tight", Tokens: 1 << 40}}})
			return err
		}, connect.CodeInvalidArgument, "tokens"},
		{"too many wants", func() error {
			ws := make([]*allotv1.Want, allocator.DefaultConfig().MaxWantsPerCall+1)
			for i := range ws {
				ws[i] = &allotv1.Want{Quota: "roomy"}
			}
			_, err := client.Acquire(ctx, &allotv1.AcquireRequest{Region: "eu", RequestId: "x5", Wants: ws})
			return err
		}, connect.CodeInvalidArgument, "wants"},
		{"oversized body", func() error {
			_, err := op.PublishPolicy(ctx, &allotv1.PublishPolicyRequest{Document: huge, ExpectedVersion: 2, Author: "t", Reason: "r"})
			return err
		}, connect.CodeResourceExhausted, ""},
		{"malformed policy", func() error {
			_, err := op.PublishPolicy(ctx, &allotv1.PublishPolicyRequest{Document: []byte("rules: [ {"), ExpectedVersion: 2, Author: "t", Reason: "r"})
			return err
		}, connect.CodeInvalidArgument, "document"},
		{"stale policy version", func() error {
			_, err := op.PublishPolicy(ctx, &allotv1.PublishPolicyRequest{Document: []byte(stormPolicy), ExpectedVersion: 1, Author: "t", Reason: "r"})
			return err
		}, connect.CodeFailedPrecondition, "version"},
		{"unknown grant", func() error {
			_, err := client.Release(ctx, &allotv1.ReleaseRequest{Region: "eu", GrantId: "no-such", Tokens: 1})
			return err
		}, connect.CodeNotFound, "grant"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.call()
			if connect.CodeOf(err) != tt.code {
				t.Fatalf("got %v (code %v), want code %v", err, connect.CodeOf(err), tt.code)
			}
			if tt.msg != "" && !containsFold(err.Error(), tt.msg) {
				t.Errorf("message %q does not name %q", err.Error(), tt.msg)
			}
		})
	}
	w, err := op.GetWindow(ctx, &allotv1.GetWindowRequest{Quota: "tight"})
	if err != nil {
		t.Fatal(err)
	}
	if w.GetGranted() != 0 || w.GetRemaining() != 500 {
		t.Errorf("bad input changed state: granted %d remaining %d", w.GetGranted(), w.GetRemaining())
	}
	if p, err := op.GetPolicy(ctx, &allotv1.GetPolicyRequest{}); err != nil || p.GetPolicy().GetVersion() != 1 {
		t.Errorf("bad publishes changed the policy: %v %v", p, err)
	}
}

func containsFold(s, sub string) bool {
	return strings.Contains(strings.ToLower(s), strings.ToLower(sub))
}

// TestProcessRollingRestartAndMembership restarts every node in turn (the
// leader transfers leadership before it stops) while a caller keeps calling:
// the caller sees no failed call. Then a fourth node joins through -join and
// is removed again.
func TestProcessRollingRestartAndMembership(t *testing.T) {
	if testing.Short() {
		t.Skip("starts real processes")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	pc := startProcCluster(t, 3)
	pc.waitLeader(ctx)
	client, err := allocator.NewClient(pc.endpoints())
	if err != nil {
		t.Fatal(err)
	}
	op := client.Operator()
	if _, err := op.PublishPolicy(ctx, &allotv1.PublishPolicyRequest{Document: []byte(stormPolicy), ExpectedVersion: 1, Author: "t", Reason: "rolling"}); err != nil {
		t.Fatal(err)
	}

	var (
		stop   atomic.Bool
		calls  atomic.Int64
		failed atomic.Int64
		wg     sync.WaitGroup
	)
	wg.Add(1)
	go func() {
		defer wg.Done()
		for i := 0; !stop.Load() && i < 1_000_000; i++ {
			req := &allotv1.AcquireRequest{Region: "eu", RequestId: fmt.Sprintf("roll-%d", i), Wants: []*allotv1.Want{{Quota: "roomy", Tokens: 1}}}
			cctx, ccancel := context.WithTimeout(ctx, 10*time.Second)
			_, err := client.Acquire(cctx, req)
			ccancel()
			calls.Add(1)
			if err != nil {
				failed.Add(1)
				t.Logf("call %d failed: %v", i, err)
			}
			time.Sleep(2 * time.Millisecond)
		}
	}()

	// Leader last, so at least one restart is of a leader... and each node in turn.
	// restart stops n gracefully and starts it again, and checks that calls
	// completed while it was down or catching up.
	restart := func(n *topology.AllocatorNode) {
		t.Helper()
		before := calls.Load()
		if err := n.Proc.Stop(15 * time.Second); err != nil {
			t.Errorf("graceful stop of %s: %v", n.ID, err)
		}
		pc.start(n)
		pc.waitUp(ctx, n)
		pc.waitLeader(ctx)
		for calls.Load() < before+5 && ctx.Err() == nil {
			time.Sleep(10 * time.Millisecond)
		}
	}
	for _, nd := range pc.Nodes {
		restart(nd)
	}
	leader, _ := pc.waitLeader(ctx)
	restart(leader) // certainly a leader, whatever the order above did

	// Membership: a fourth node joins through a follower, then is removed.
	n4 := &topology.AllocatorNode{ID: "a4", RaftAddr: freePort(t), APIAddr: freePort(t), DataDir: filepath.Join(t.TempDir(), "a4")}
	n4.Args = []string{"-id", n4.ID, "-raft-addr", n4.RaftAddr, "-api-addr", n4.APIAddr, "-data-dir", n4.DataDir, "-join", pc.Nodes[0].APIAddr, "-log-level", "warn"}
	pc.start(n4)
	pc.Nodes = append(pc.Nodes, n4) // so cleanup kills it
	waitMembers := func(want int, has4 bool) {
		t.Helper()
		for {
			cl, err := op.GetCluster(ctx, &allotv1.GetClusterRequest{})
			if err == nil && len(cl.GetMembers()) == want {
				found := false
				for _, m := range cl.GetMembers() {
					// The join ends with a4 a voter (added as a
					// non-voter, promoted once it caught up).
					found = found || (m.GetId() == "a4" && m.GetApiAddress() == n4.APIAddr && (!has4 || m.GetSuffrage() == "Voter"))
				}
				if found == has4 {
					return
				}
			}
			select {
			case <-ctx.Done():
				t.Fatalf("membership did not reach %d members (a4 present: %v): %v", want, has4, cl)
			case <-time.After(50 * time.Millisecond):
			}
		}
	}
	waitMembers(4, true)
	// The new member serves reads from replicated state.
	c4, _ := allocator.NewClient([]string{n4.APIAddr})
	for {
		p, err := c4.Operator().GetCluster(ctx, &allotv1.GetClusterRequest{})
		if err == nil && p.GetPolicyVersion() == 1 {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatal("a4 never applied the policy")
		case <-time.After(50 * time.Millisecond):
		}
	}
	if _, err := op.RemoveMember(ctx, &allotv1.RemoveMemberRequest{Id: "a4"}); err != nil {
		t.Fatalf("remove a4: %v", err)
	}
	waitMembers(3, false)
	if _, err := op.RemoveMember(ctx, &allotv1.RemoveMemberRequest{Id: "a4"}); connect.CodeOf(err) != connect.CodeNotFound {
		t.Errorf("removing a non-member: got %v, want NotFound", err)
	}

	stop.Store(true)
	wg.Wait()
	t.Logf("%d calls during the rolling restart, %d failed", calls.Load(), failed.Load())
	if failed.Load() != 0 {
		t.Errorf("%d calls failed during a rolling restart", failed.Load())
	}
}

func freePort(t *testing.T) string {
	t.Helper()
	a, err := topology.FreePort("127.0.0.1")
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// TestProcessGRPCListener runs Acquire and Release on the processes'
// -grpc-addr listeners through a Client with WithGRPCEndpoints, across a
// graceful stop of the leader: the stop hands leadership over and drains
// the gRPC calls in flight, so no call fails.
func TestProcessGRPCListener(t *testing.T) {
	pc := startProcCluster(t, 3)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	leader, _ := pc.waitLeader(ctx)
	client, err := allocator.NewClient(pc.endpoints(), allocator.WithGRPCEndpoints(pc.GRPCEndpoints()...),
		allocator.WithAttempts(20), allocator.WithBackoff(50*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	defer client.Close()
	if _, err := client.Operator().PublishPolicy(ctx, &allotv1.PublishPolicyRequest{Document: []byte(stormPolicy), ExpectedVersion: 1, Author: "t", Reason: "grpc"}); err != nil {
		t.Fatal(err)
	}
	acquire := func(id string) *allotv1.Grant {
		t.Helper()
		resp, err := client.Acquire(ctx, &allotv1.AcquireRequest{Region: "eu", RequestId: id, Wants: []*allotv1.Want{{Quota: "roomy", Tokens: 10}}})
		if err != nil {
			t.Fatalf("acquire %s: %v", id, err)
		}
		return resp.GetGrants()[0]
	}
	g := acquire("before")
	if g.GetTokens() != 10 {
		t.Fatalf("granted %v", g)
	}
	// Calls keep flowing while the leader stops gracefully.
	var (
		wg     sync.WaitGroup
		failed atomic.Int64
		calls  atomic.Int64
	)
	stop := make(chan struct{})
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				_, err := client.Acquire(ctx, &allotv1.AcquireRequest{Region: "eu", RequestId: fmt.Sprintf("w%d-%d", w, i), Wants: []*allotv1.Want{{Quota: "roomy", Tokens: 1}}})
				calls.Add(1)
				if err != nil {
					failed.Add(1)
					t.Errorf("acquire during the leader's stop: %v", err)
				}
			}
		}()
	}
	time.Sleep(200 * time.Millisecond)
	if err := leader.Proc.Stop(15 * time.Second); err != nil {
		t.Errorf("graceful stop: %v", err)
	}
	time.Sleep(300 * time.Millisecond)
	close(stop)
	wg.Wait()
	if calls.Load() == 0 || failed.Load() > 0 {
		t.Fatalf("%d of %d calls failed", failed.Load(), calls.Load())
	}
	if _, err := client.Release(ctx, &allotv1.ReleaseRequest{Region: "eu", GrantId: g.GetGrantId(), Tokens: 10, RequestId: "rel"}); err != nil {
		t.Fatalf("release after the stop: %v", err)
	}
	w, err := client.Operator().GetWindow(ctx, &allotv1.GetWindowRequest{Quota: "roomy"})
	if err != nil {
		t.Fatal(err)
	}
	if w.GetGranted() != 10+calls.Load() || w.GetReleased() != 10 {
		t.Fatalf("window granted %d released %d; want %d and 10", w.GetGranted(), w.GetReleased(), 10+calls.Load())
	}
}
