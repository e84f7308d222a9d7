package allocator

import (
	"context"
	"strings"
	"testing"
	"time"

	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

// TestBoundConfigStatesGateways: the gateway count per region reaches the
// bound, which needs it for the tokens parked in gateways and states it in
// the store_fallback assumption.
func TestBoundConfigStatesGateways(t *testing.T) {
	c := validConfig()
	if got := c.BoundConfig().Gateways; got != 1 {
		t.Errorf("default Gateways %d, want 1", got)
	}
	c.GatewaysPerRegion = 40
	if got := c.BoundConfig().Gateways; got != 40 {
		t.Errorf("Gateways %d, want 40", got)
	}
}

// TestBoundConfigCarriesEveryAssumption: each assumption the allocator's
// flags state reaches the bound; a dropped one would state a smaller bound
// (StoreAsyncFailover, say) with nothing else noticing.
func TestBoundConfigCarriesEveryAssumption(t *testing.T) {
	c := validConfig()
	c.LeaseMargin = 700 * time.Millisecond
	c.MaxDriftPPM = 333
	c.MaxOneWayDelay = 77 * time.Millisecond
	c.MaxLeaderSkew = 55 * time.Millisecond
	c.StoreAsyncFailover = true
	c.StoreReplicationLag = 3 * time.Second
	c.GatewaysPerRegion = 6
	b := c.BoundConfig()
	for _, f := range []struct {
		name      string
		got, want any
	}{
		{"ExpiryMargin", b.ExpiryMargin, c.LeaseMargin},
		{"MaxDriftPPM", b.MaxDriftPPM, c.MaxDriftPPM},
		{"MaxOneWayDelay", b.MaxOneWayDelay, c.MaxOneWayDelay},
		{"MaxLeaderSkew", b.MaxLeaderSkew, c.MaxLeaderSkew},
		{"StoreAsyncFailover", b.StoreAsyncFailover, c.StoreAsyncFailover},
		{"StoreReplicationLag", b.StoreReplicationLag, c.StoreReplicationLag},
		{"Gateways", b.Gateways, c.GatewaysPerRegion},
		{"QuorumCommit", b.QuorumCommit, true},
	} {
		if f.got != f.want {
			t.Errorf("%s %v, want %v", f.name, f.got, f.want)
		}
	}
}

// TestGetBoundReportsParkedTokens: a policy with lease.gateway_chunk parks
// tokens in gateways' in-process chunks; GetBound reports them (regions x
// the stated gateways per region x the chunk), and for a fallback quota the
// gateways' in-process fallback as store_fallback, naming the gateway count.
func TestGetBoundReportsParkedTokens(t *testing.T) {
	tc := newTestCluster(t, 1, func(c *Config) { c.GatewaysPerRegion = 4 })
	publishTest(t, tc.addrs, strings.Replace(clusterPolicy, "lease: {chunk: 100, ttl: 15s, clamp: true}",
		"lease: {chunk: 100, ttl: 15s, clamp: true, gateway_chunk: 25, fallback_per_region: 50}\n    fail_mode: fallback", 1), 1)
	c, err := NewClient(tc.addrs)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := c.Operator().GetBound(ctx, &allotv1.GetBoundRequest{Quota: "atlas"})
	if err != nil {
		t.Fatal(err)
	}
	b := resp.GetBounds()[0]
	if got := b.GetStrandedParkedTokens(); got != 2*4*25 {
		t.Errorf("stranded_parked_tokens %d, want 2 regions x 4 gateways x 25 = 200", got)
	}
	var names []string
	for _, term := range b.GetTerms() {
		names = append(names, term.GetName())
		if term.GetName() == "store_fallback" {
			if term.GetTokens() != 100 || !strings.Contains(term.GetAssumption(), "states 4 per region (-gateways-per-region)") {
				t.Errorf("store_fallback %d: %s", term.GetTokens(), term.GetAssumption())
			}
		}
	}
	if got := strings.Join(names, ","); got != "carry_over,fallback,store_fallback,lost_grants,timing,store_rollback" {
		t.Errorf("terms %s", got)
	}
	// fallback 2 x 50 and store_fallback 2 x 50.
	if b.GetOvershoot() != 200 || b.GetMaxAdmittedPerWindow() != 1200 {
		t.Errorf("overshoot %d, ceiling %d, want 200 and 1200", b.GetOvershoot(), b.GetMaxAdmittedPerWindow())
	}
}
