package admission_test

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/allot-dev/allot/internal/redistest"
	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/policy"
)

// shardLimit is the tenant window of shardPolicy: never reached, so that a
// tenant's counter says how many of its calls ran.
const shardLimit = 10_000_000

var shardPolicy = fmt.Sprintf(`
name: shards
rules:
  - {name: tenant, scope: tenant, match: [{key: tenant}], kind: fixed_window, limit: %d, window: 1h, fail_mode: closed}
`, shardLimit)

// tenantsByMaster returns, for each master address of client's cluster,
// perMaster tenants whose keys it serves.
func tenantsByMaster(t *testing.T, client *redis.ClusterClient, masters, perMaster int) map[string][]string {
	t.Helper()
	by := make(map[string][]string)
	full := 0
	for i := 0; full < masters; i++ {
		if i > 10_000 {
			t.Fatalf("found tenants for %d of %d masters", full, masters)
		}
		tn := fmt.Sprintf("tn%d", i)
		m, err := client.MasterForKey(context.Background(), "{t:"+tn+"}")
		if err != nil {
			t.Fatal(err)
		}
		addr := m.Options().Addr
		if len(by[addr]) < perMaster {
			by[addr] = append(by[addr], tn)
			if len(by[addr]) == perMaster {
				full++
			}
		}
	}
	return by
}

func tenantReq(tenant string) *admission.Request {
	return &admission.Request{Descriptors: []policy.Entry{{Key: "tenant", Value: tenant}}}
}

// tenantCount returns how many calls of tenant's the store ran, from the
// remaining count a decision reads (the decision itself excluded). It
// tries for a few seconds while the tenant's master recovers.
func tenantCount(t *testing.T, e *admission.Engine, tenant string) int64 {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for {
		d, err := e.Decide(context.Background(), tenantReq(tenant))
		if err != nil {
			t.Fatal(err)
		}
		if d.Source == admission.SourceStore {
			return shardLimit - d.Rules[0].Remaining - 1
		}
		if time.Now().After(deadline) {
			t.Fatalf("tenant %s: no decision from the store: %v %v", tenant, d.Source, d.Outcome)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TestStoppedMasterHoldsOnlyItsOwnCalls: one master of three stops (SIGSTOP)
// for two seconds under load over tenants on all of them. Its tenants'
// calls time out and their fail mode decides; the other masters' tenants go
// on being decided by the store, each call counted once in Redis (none ran
// after its caller took the fail mode), and only the stopped master's
// breaker opens. With one batcher for all masters, every pipeline soon held
// a call for the stopped one and waited for it: the other tenants timed out
// too (~97% of their decisions by fail mode), their calls still ran when
// the pipelines returned (charged and refused), and the one breaker opened
// for all.
func TestStoppedMasterHoldsOnlyItsOwnCalls(t *testing.T) {
	redistest.Require(t, shared.err)
	ctx := context.Background()
	cl := redistest.NewCluster(t)
	for _, n := range cl.Nodes {
		// The other masters keep serving their slots while one is down.
		c := n.Client()
		err := c.ConfigSet(ctx, "cluster-require-full-coverage", "no").Err()
		c.Close()
		if err != nil {
			t.Fatal(err)
		}
	}
	client := redis.NewClusterClient(&redis.ClusterOptions{Addrs: cl.Addrs(), ContextTimeoutEnabled: true})
	t.Cleanup(func() { client.Close() })
	st, err := admission.NewRedisStore(client, admission.DefaultRedisConfig())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	if err := st.Load(ctx); err != nil {
		t.Fatal(err)
	}
	cfg := admission.DefaultConfig()
	cfg.Namespace = namespace()
	// Long enough that a call to a serving master never times out on a
	// loaded machine (its Redis counter must match), far shorter than the
	// pause and the pipeline timeout (1 s).
	cfg.StoreTimeout = 300 * time.Millisecond
	e, err := admission.New(cfg, st, parse(t, shardPolicy), 1)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })

	victim := cl.Nodes[0]
	by := tenantsByMaster(t, client, len(cl.Nodes), 3)
	type tally struct {
		admitted              int64 // by the store
		pauseTotal, pauseByDB int64 // decisions started during the pause; those the store made
	}
	var (
		tenants []string
		healthy = map[string]bool{}
		tallies = map[string]*tally{}
	)
	for addr, ts := range by {
		for _, tn := range ts {
			tenants = append(tenants, tn)
			healthy[tn] = addr != victim.Addr()
			tallies[tn] = &tally{}
		}
	}
	for _, tn := range tenants { // one decision each: the store learns its slot map
		if d, _ := e.Decide(ctx, tenantReq(tn)); d == nil || d.Source != admission.SourceStore {
			t.Fatalf("warm-up decision of %s not made by the store: %+v", tn, d)
		}
		tallies[tn].admitted++
	}
	victimShard := admission.ShardOf(st, "{t:"+by[victim.Addr()][0]+"}")

	var (
		mu              sync.Mutex
		pausedAt, until time.Time // the pause, once it began
		stop            = make(chan struct{})
		wg              sync.WaitGroup
	)
	for _, tn := range tenants {
		wg.Add(1)
		go func() {
			defer wg.Done()
			ta := tallies[tn]
			for {
				select {
				case <-stop:
					return
				default:
				}
				start := time.Now()
				d, err := e.Decide(ctx, tenantReq(tn))
				if err != nil {
					t.Error(err)
					return
				}
				store := d.Source == admission.SourceStore
				if store && d.Allowed() {
					ta.admitted++
				}
				mu.Lock()
				if !pausedAt.IsZero() && !start.Before(pausedAt) && start.Before(until) {
					ta.pauseTotal++
					if store {
						ta.pauseByDB++
					}
				}
				mu.Unlock()
				time.Sleep(2 * time.Millisecond)
			}
		}()
	}
	time.Sleep(300 * time.Millisecond)
	mu.Lock()
	if err := victim.Pause(); err != nil {
		mu.Unlock()
		t.Fatal(err)
	}
	const pause = 2 * time.Second
	pausedAt = time.Now()
	until = pausedAt.Add(pause)
	mu.Unlock()
	time.Sleep(pause)
	if err := victim.Resume(); err != nil {
		t.Fatal(err)
	}
	time.Sleep(300 * time.Millisecond)
	close(stop)
	wg.Wait()

	var total, byDB int64
	for _, tn := range tenants {
		if ta := tallies[tn]; healthy[tn] {
			total += ta.pauseTotal
			byDB += ta.pauseByDB
		}
	}
	t.Logf("during the pause the store decided %d of %d decisions of the serving masters' tenants", byDB, total)
	if total < 100 || float64(byDB) < 0.9*float64(total) {
		t.Errorf("during the pause the store decided %d of %d decisions of the serving masters' tenants; want at least 90%%", byDB, total)
	}
	for _, tn := range tenants {
		if !healthy[tn] {
			continue
		}
		if got, want := tenantCount(t, e, tn), tallies[tn].admitted; got != want {
			t.Errorf("tenant %s: Redis counted %d calls, the store admitted %d: %d ran after their callers gave up", tn, got, want, got-want)
		}
	}
	opens := admission.BreakerOpensByShard(e)
	if opens[victimShard] == 0 {
		t.Errorf("the stopped master's breaker (shard %d) never opened: opens by shard %v", victimShard, opens)
	}
	var others []int
	for i, n := range opens {
		if i != victimShard && n > 0 {
			others = append(others, i)
		}
	}
	if len(others) > 0 {
		t.Errorf("the breakers of shards %v opened; only the stopped master's (shard %d) should have: opens by shard %v", others, victimShard, opens)
	}
}

// TestSlotMoveOpensNoBreaker: while a tenant's slot is half moved, its
// decisions are refused with TRYAGAIN (the store sends each again twice,
// then the fail mode decides). Redis refused them for where their keys
// live, not for trouble of the node's: however many there are, no breaker
// opens, and the node's other tenants are decided by the store meanwhile.
// With TRYAGAIN counted as a failure, five of them opened the breaker for
// every tenant (an ordinary reshard sees dozens).
func TestSlotMoveOpensNoBreaker(t *testing.T) {
	redistest.Require(t, shared.err)
	cl := redistest.NewCluster(t)
	client := cl.Client()
	t.Cleanup(func() { client.Close() })
	b := redisBackend("cluster", func(*testing.T) redis.UniversalClient { return client })
	h := newHarness(t, b, parse(t, reshardPolicy), nil)
	wantAllowed(t, h.decide("tenant", "birch", "user", "u1"), "before the move")
	keys := h.keys(h.ns)
	m, rest := moveHalf(t, cl, keys)

	// A tenant on the same master, in another slot.
	src, err := client.MasterForKey(context.Background(), "{t:birch}")
	if err != nil {
		t.Fatal(err)
	}
	neighbour := ""
	for i := 0; neighbour == ""; i++ {
		tn := fmt.Sprintf("n%d", i)
		if n, err := client.MasterForKey(context.Background(), "{t:"+tn+"}"); err == nil && n == src && tn != "birch" {
			neighbour = tn
		}
	}

	failures := 2 * admission.DefaultConfig().BreakerFailures
	for i := 0; i < failures; i++ {
		if d := h.decide("tenant", "birch", "user", "u1"); d.Outcome != admission.Unavailable {
			t.Fatalf("decision %d while the slot is split: %v by %q; want unavailable (TRYAGAIN, fail mode closed)", i, d.Outcome, d.Rule)
		}
	}
	if got := cmdStat(t, m.Src, "eval", "rejected_calls"); got < int64(failures) {
		t.Fatalf("the old node refused %d EVAL; want at least %d (TRYAGAIN)", got, failures)
	}
	if st := h.e.Stats(); st.BreakerOpens != 0 || h.e.BreakerOpen() {
		t.Errorf("after %d TRYAGAIN refusals: %d breaker openings, open now %v; want none", failures, st.BreakerOpens, h.e.BreakerOpen())
	}
	if d := h.decide("tenant", neighbour, "user", "u1"); d.Source != admission.SourceStore || !d.Allowed() {
		t.Errorf("tenant %s on the same master: %v from %v; want allowed by the store", neighbour, d.Outcome, d.Source)
	}

	// Callers whose timeout passes while their refused calls wait for a
	// resend (here every time: the pause is longer than the timeout) gave
	// up on a serving node too.
	rc := admission.DefaultRedisConfig()
	rc.MaxPipelines = 2 * failures // every call in a pipeline of its own, none left waiting to be sent
	st, err := admission.NewRedisStore(client, rc, admission.WithResendPause(200*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	cfg := admission.DefaultConfig()
	cfg.Namespace, cfg.NegativeCacheTTL = h.ns, 0 // the tenant's keys, split
	cfg.StoreTimeout = 25 * time.Millisecond
	e, err := admission.New(cfg, st, parse(t, reshardPolicy), 1, admission.WithClock(h.clock))
	if err != nil {
		t.Fatal(err)
	}
	admission.UseStoreClock(e)
	for i := 0; i < failures; i++ {
		d, err := e.Decide(context.Background(), &admission.Request{Descriptors: entries("tenant", "birch", "user", "u1")})
		if err != nil || d.Outcome != admission.Unavailable {
			t.Fatalf("decision %d while the slot is split, with a short timeout: %+v, %v; want unavailable", i, d, err)
		}
	}
	if s := e.Stats(); s.BreakerOpens != 0 || e.BreakerOpen() || s.StoreErrors != uint64(failures) {
		t.Errorf("after %d callers gave up during TRYAGAIN resends: stats %+v, open now %v; want %[1]d store errors and no breaker opening", failures, s, e.BreakerOpen())
	}
	e.Close()
	st.Close() // waits for the resends, which must not land after the move

	// A resend that went out to a node that then stopped answering: the
	// caller gave up on the node, not on the move, and its breaker counts
	// it (one failure opens it here).
	st, err = admission.NewRedisStore(client, rc, admission.WithResendPause(150*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	cfg.StoreTimeout, cfg.BreakerFailures = 600*time.Millisecond, 1
	e, err = admission.New(cfg, st, parse(t, reshardPolicy), 1, admission.WithClock(h.clock))
	if err != nil {
		t.Fatal(err)
	}
	admission.UseStoreClock(e)
	paused := make(chan error, 1)
	go func() {
		time.Sleep(60 * time.Millisecond) // after the TRYAGAIN, before the resend
		paused <- m.Src.Pause()
	}()
	d, err := e.Decide(context.Background(), &admission.Request{Descriptors: entries("tenant", "birch", "user", "u1")})
	if perr := <-paused; perr != nil {
		t.Fatal(perr)
	}
	if rerr := m.Src.Resume(); rerr != nil {
		t.Fatal(rerr)
	}
	if err != nil || d.Outcome != admission.Unavailable {
		t.Fatalf("a decision whose resend met a stopped node: %+v, %v; want unavailable", d, err)
	}
	if s := e.Stats(); s.BreakerOpens != 1 {
		t.Errorf("a caller gave up on a resend sent to a stopped node: %d breaker openings; want 1 (the node's failure counts)", s.BreakerOpens)
	}
	e.Close()
	st.Close()

	if err := m.Finish(context.Background(), rest); err != nil {
		t.Fatal(err)
	}
	if d := h.decide("tenant", "birch", "user", "u1"); !d.Allowed() || d.Remaining != 8 {
		t.Errorf("after the move: %v, %d remaining; want allowed with 8", d.Outcome, d.Remaining)
	}
}
