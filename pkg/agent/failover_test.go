package agent_test

import (
	"io"
	"net"
	"testing"
	"time"

	"github.com/allot-dev/allot/pkg/agent"
)

// blackHole listens on a loopback port, accepts connections and reads
// them, and never answers: an allocator endpoint behind a connection a
// partition left half-dead, or a stopped node.
func blackHole(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			t.Cleanup(func() { c.Close() })
			go func() { _, _ = io.Copy(io.Discard, c) }()
		}
	}()
	return ln.Addr().String()
}

// TestAcquireFailsOverWithinTheCall: the first allocator endpoint never
// answers; the agent's own client (no WithAllocatorClient) gives one
// endpoint a third of the 2 s AcquireTimeout, so the Acquire fails over to
// the endpoint that answers within the call, and a starving request is
// served within its starve wait, the region not cut off. The client used to
// give one endpoint 2 s: the whole call went to the silent one, the region
// was cut off, and the request was answered 503.
func TestAcquireFailsOverWithinTheCall(t *testing.T) {
	rdb, fa, doc, cfg := threeQuotasAgent(t)
	cfg.AllocatorEndpoints = []string{blackHole(t), fa.addr}
	cfg.Lease.AcquireTimeout = 2 * time.Second // the default
	cfg.StarveWait = 1500 * time.Millisecond
	a, err := agent.New(cfg, rdb, agent.WithPolicy(doc, 1), agent.WithLogger(testLogger(t)))
	if err != nil {
		t.Fatal(err)
	}
	r := runAgent(t, a)
	v := mustCheck(t, r.Agent, tenant("a"))
	if !v.Allowed || r.CutOff() {
		t.Fatalf("first request with the first endpoint silent: %+v (cut off: %t); want allowed after a failover within the Acquire call", v, r.CutOff())
	}
}
