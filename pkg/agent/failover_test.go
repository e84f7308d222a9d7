package agent_test

import (
	"testing"
	"time"

	"github.com/allot-dev/allot/internal/loopback"
	"github.com/allot-dev/allot/pkg/agent"
)

// TestAcquireFailsOverWithinTheCall: the first allocator endpoint never
// answers; the agent's own client (no WithAllocatorClient) gives one
// endpoint a third of the 2 s AcquireTimeout, so the Acquire fails over to
// the endpoint that answers within the call, and a starving request is
// served within its starve wait, the region not cut off. The client used to
// give one endpoint 2 s: the whole call went to the silent one, the region
// was cut off, and the request was answered 503.
func TestAcquireFailsOverWithinTheCall(t *testing.T) {
	rdb, fa, doc, cfg := threeQuotasAgent(t)
	cfg.AllocatorEndpoints = []string{loopback.BlackHole(t), fa.addr}
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
