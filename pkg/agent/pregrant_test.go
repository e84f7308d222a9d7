package agent_test

import (
	"testing"
	"time"

	"github.com/allot-dev/allot/pkg/agent"
)

// turnPolicy is one clamped leased pool with a 2 s window, so a test sees
// several window turns in seconds.
const turnPolicy = `
name: turn
regions: [eu, us]
rules:
  - name: q-turn
    scope: tenant
    match: [{key: tenant, value: t}]
    kind: global_quota
    limit: 100000
    window: 2s
    lease: {chunk: 50, ttl: 2s}
`

// turnRun drives steady demand on q-turn through three window turns and
// reports, for each window that opened during the load, whether the
// region's first grant of it was made before the window started (a
// pre-grant), and the verdicts.
func turnRun(t *testing.T, lead time.Duration) (pregranted map[int64]bool, denied int, slowest time.Duration) {
	t.Helper()
	rdb := sharedRedis(t)
	fa := startFakeAllocator(t)
	doc := mustParse(t, turnPolicy)
	fa.publish(doc)
	cfg := testConfig("eu", fa.addr)
	cfg.Lease.PregrantLead = lead
	// In the last Margin + deposit bound (550 ms here) of a clamped window
	// the region holds nothing spendable, by design, so every turn's
	// requests wait that long, with or without pre-grants; testConfig's 1 s
	// starve wait left a renewal 450 ms, which a CPU-starved machine
	// running the whole suite overran once (a Check waited out its 1 s and
	// got 503, slowest 1.26 s).
	// As in TestNorthstarScenario, a renewal delayed by the machine must not
	// turn a request into a refusal; the wait stays bounded, and a turn with
	// no renewal still fails.
	cfg.StarveWait = 3 * time.Second
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(doc, 1)))

	const window = 2000
	// The first window to open at least 1 s into the load: demand is
	// measured by then.
	first := (time.Now().UnixMilli()+1000)/window + 1
	stop := time.Now().Add(10 * time.Second) // bound: three turns take 4-6 s
	pregranted = map[int64]bool{}
	for n := 0; n < 5000 && time.Now().Before(stop) && time.Now().UnixMilli()/window < first+3; n++ {
		t0 := time.Now()
		v := mustCheck(t, a.Agent, tenant("t"))
		slowest = max(slowest, time.Since(t0))
		if !v.Allowed {
			denied++
		}
		cur := time.Now().UnixMilli() / window
		if _, seen := pregranted[cur]; cur >= first && !seen {
			fa.mu.Lock()
			w, ok := fa.f.Window("q-turn", cur)
			fa.mu.Unlock()
			if ok && len(w.Grants) > 0 {
				pregranted[cur] = w.Grants[0].Region == "eu" && w.Grants[0].GrantedUnixMs < w.StartUnixMs
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
	if len(pregranted) < 2 {
		t.Fatalf("saw %d window turns with grants, want at least 2", len(pregranted))
	}
	return pregranted, denied, slowest
}

// TestPregrantAtTheWindowTurn: with clamp on every chunk ends with its
// window; the agent takes a chunk of the next window shortly before the turn
// (a pre-grant) so requests at the turn find tokens without a renewal round
// trip. Every turn under steady demand is served from a pre-grant, and no
// request is refused. With PregrantLead 0 the first grant of each window is
// made after it opened, as before.
func TestPregrantAtTheWindowTurn(t *testing.T) {
	t.Run("on", func(t *testing.T) {
		pre, denied, slowest := turnRun(t, agent.DefaultLeaseConfig().PregrantLead)
		for w, ok := range pre {
			if !ok {
				t.Errorf("window %d: the region's first grant was not a pre-grant", w)
			}
		}
		if denied > 0 {
			t.Errorf("%d requests refused across the turns", denied)
		}
		t.Logf("turns %v, slowest Check %s", pre, slowest)
	})
	t.Run("off", func(t *testing.T) {
		pre, denied, slowest := turnRun(t, 0)
		for w, ok := range pre {
			if ok {
				t.Errorf("window %d: pre-granted with PregrantLead 0", w)
			}
		}
		if denied > 0 {
			t.Errorf("%d requests refused across the turns", denied)
		}
		t.Logf("turns %v, slowest Check %s", pre, slowest)
	})
}

// TestFirstRequestNearTheWindowEnd: the first request for a pool, sent when
// its window is too close to its end for a chunk to be worth depositing,
// waits for the renewal at the turn and is served; it used to wait out its
// starve wait and get 503, because the turn's round saw no demand yet and
// had forgotten that a request was starving.
func TestFirstRequestNearTheWindowEnd(t *testing.T) {
	rdb := sharedRedis(t)
	fa := startFakeAllocator(t)
	doc := mustParse(t, turnPolicy)
	fa.publish(doc)
	ag := newAgent(t, testConfig("eu", fa.addr), rdb, agent.WithPolicy(doc, 1))
	// Start the agent and send its first request 300 ms before a turn:
	// inside the last Margin + deposit bound + MinUsefulTTL (570 ms with
	// the test config) of the 2 s window, before its first pool reading.
	const window = 2000
	wait := time.Duration((window-300-time.Now().UnixMilli()%window+window)%window) * time.Millisecond
	time.Sleep(wait)
	a := runAgent(t, ag)
	v := mustCheck(t, a.Agent, tenant("t"))
	if !v.Allowed {
		t.Fatalf("the first request, 300 ms before a turn: %+v, want it served after the turn", v)
	}
}
