package agent_test

import (
	"context"
	"flag"
	"net"
	"slices"
	"testing"
	"time"

	"github.com/allot-dev/allot/pkg/agent"
	"github.com/allot-dev/allot/pkg/faultproxy"
)

var turnRTT = flag.Duration("bench.turn-rtt", 100*time.Millisecond, "BenchmarkWindowTurn: round trip added between the agent and the allocator")

// BenchmarkWindowTurn measures what a window turn costs requests of a pool
// with clamp on, with the agent's shipped lease settings (100 ms tick,
// 250 ms margin, 50 ms deposit bound) and the allocator behind a fault proxy
// adding -bench.turn-rtt: one caller sends a Check every 5 ms through six
// turns of a 2 s window, and the benchmark reports, per turn, how long
// requests were held (the longest Check around the turn) and how many were
// refused, with pre-grants (PregrantLead 1 s, capped at 500 ms by the
// window) and without (PregrantLead 0). Run it with:
//
//	go test -run '^$' -bench BenchmarkWindowTurn -benchtime 1x ./pkg/agent
func BenchmarkWindowTurn(b *testing.B) {
	for _, tc := range []struct {
		name string
		lead time.Duration
	}{{"pregrant", agent.DefaultLeaseConfig().PregrantLead}, {"no-pregrant", 0}} {
		b.Run(tc.name, func(b *testing.B) {
			for range b.N {
				benchTurns(b, tc.lead)
			}
		})
	}
}

func benchTurns(b *testing.B, lead time.Duration) {
	rdb := sharedRedis(b)
	fa := startFakeAllocator(b)
	doc := mustParse(b, turnPolicy)
	fa.publish(doc)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	var d net.Dialer
	half := *turnRTT / 2
	px := faultproxy.New(ln, func(ctx context.Context) (net.Conn, error) { return d.DialContext(ctx, "tcp", fa.addr) },
		faultproxy.Config{DelayMin: half, DelayMax: half}, 1)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = px.Run(ctx) }()
	b.Cleanup(func() { cancel(); <-done })

	cfg := testConfig("eu", px.Addr().String())
	def := agent.DefaultConfig()
	cfg.Lease = def.Lease // the shipped lease settings
	cfg.Lease.PregrantLead = lead
	cfg.StarveWait = def.StarveWait
	a := runAgent(b, newAgent(b, cfg, rdb, agent.WithPolicy(doc, 1)))

	const window, turns = 2000, 6
	first := (time.Now().UnixMilli()+1000)/window + 1 // demand is measured by then
	worst := map[int64]time.Duration{}                // per turn: the longest Check within 1 s of it
	refused := 0
	stop := time.Now().Add(20 * time.Second)
	for n := 0; n < 10_000 && time.Now().Before(stop) && time.Now().UnixMilli()/window < first+turns; n++ {
		t0 := time.Now()
		v := mustCheck(b, a.Agent, tenant("t"))
		took := time.Since(t0)
		turn := (t0.UnixMilli() + window/2) / window // the nearest turn
		if turn >= first && !v.Allowed {
			refused++
		}
		if turn >= first {
			worst[turn] = max(worst[turn], took)
		}
		time.Sleep(5 * time.Millisecond)
	}
	if len(worst) < turns-1 {
		b.Fatalf("measured %d turns, want %d", len(worst), turns)
	}
	held := make([]time.Duration, 0, len(worst))
	for _, w := range worst {
		held = append(held, w)
	}
	slices.Sort(held)
	b.ReportMetric(float64(held[len(held)/2].Milliseconds()), "median-held-ms")
	b.ReportMetric(float64(held[len(held)-1].Milliseconds()), "max-held-ms")
	b.ReportMetric(float64(refused), "refused")
	b.ReportMetric(0, "ns/op")
}
