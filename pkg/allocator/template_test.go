package allocator

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	"go.uber.org/zap"
	"google.golang.org/protobuf/proto"

	"github.com/allot-dev/allot/fsm"
	"github.com/allot-dev/allot/pkg/policy"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
)

const templatePolicy = `
name: plans
regions: [eu, us]
rules:
  - name: standard
    scope: tenant
    match: [{key: tenant}]
    kind: global_quota
    limit: 1000
    window: 1h
    lease: {chunk: 100, ttl: 15s, clamp: true}
  - name: atlas
    scope: tenant
    match: [{key: tenant, value: atlas}]
    kind: global_quota
    limit: 500
    window: 1h
    lease: {chunk: 50, ttl: 15s, clamp: true}
`

// TestTemplateInstancesOverTheAPI: instances of a template are acquired,
// viewed, bounded and replicated like single pools, through a follower.
func TestTemplateInstancesOverTheAPI(t *testing.T) {
	tc := newTestCluster(t, 3)
	l := tc.leader()
	follower := tc.addrs[(tc.index(l)+1)%3]
	publishTest(t, []string{follower}, templatePolicy, 1)
	c, err := NewClient([]string{follower}, WithAttempts(1))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	birch := policy.InstanceName("standard", []string{"birch"})
	resp, err := c.Acquire(ctx, &allotv1.AcquireRequest{Region: "eu", RequestId: "r1", Wants: []*allotv1.Want{
		{Quota: birch, Tokens: 100}, {Quota: "standard/atlas", Tokens: 30}, {Quota: "atlas", Tokens: 50},
	}})
	if err != nil {
		t.Fatalf("acquire instances: %v", err)
	}
	if g := resp.GetGrants()[0]; g.GetQuota() != birch || g.GetTokens() != 100 {
		t.Fatalf("birch: %v", g)
	}
	op := c.Operator()
	w, err := op.GetWindow(ctx, &allotv1.GetWindowRequest{Quota: birch})
	if err != nil || w.GetQuota() != birch || w.GetGranted() != 100 || w.GetRemaining() != 900 {
		t.Fatalf("GetWindow(%s) = %v, %v", birch, w, err)
	}
	if w, err := op.GetWindow(ctx, &allotv1.GetWindowRequest{Quota: "standard/cedar"}); err != nil || w.GetRemaining() != 1000 {
		t.Fatalf("GetWindow of an instance not acquired yet = %v, %v; want its full pool", w, err)
	}
	for _, tt := range []struct {
		quota string
		code  connect.Code
	}{
		{"standard", connect.CodeInvalidArgument},
		{"atlas/birch", connect.CodeNotFound},
		{"nope/birch", connect.CodeNotFound},
		{"standard/a/b", connect.CodeNotFound},
	} {
		if _, err := op.GetWindow(ctx, &allotv1.GetWindowRequest{Quota: tt.quota}); connect.CodeOf(err) != tt.code || !strings.Contains(err.Error(), tt.quota) {
			t.Errorf("GetWindow(%q) = %v, want code %v naming the quota", tt.quota, err, tt.code)
		}
	}

	b, err := op.GetBound(ctx, &allotv1.GetBoundRequest{Quota: birch})
	if err != nil || len(b.GetBounds()) != 1 || b.GetBounds()[0].GetQuota() != birch || b.GetBounds()[0].GetLimit() != 1000 {
		t.Fatalf("GetBound(instance) = %v, %v", b, err)
	}
	tb, err := op.GetBound(ctx, &allotv1.GetBoundRequest{Quota: "standard"})
	if err != nil || tb.GetBounds()[0].GetOvershoot() != b.GetBounds()[0].GetOvershoot() {
		t.Fatalf("GetBound(template) = %v, %v; want the instance's bound", tb, err)
	}
	if _, err := op.GetBound(ctx, &allotv1.GetBoundRequest{Quota: "atlas/x"}); connect.CodeOf(err) != connect.CodeNotFound {
		t.Fatalf("GetBound of an instance of a single pool = %v, want NotFound", err)
	}

	for _, tt := range []struct {
		quota string
		code  connect.Code
		msg   string
	}{
		{"standard", connect.CodeInvalidArgument, `wants[0].quota "standard": a template`},
		{"atlas/x", connect.CodeNotFound, `"atlas" is a single pool`},
		{"standard/a{b", connect.CodeInvalidArgument, `wants[0].quota "standard/a{b"`},
	} {
		_, err := c.Acquire(ctx, &allotv1.AcquireRequest{Region: "eu", RequestId: "bad-" + tt.quota, Wants: []*allotv1.Want{{Quota: tt.quota}}})
		if connect.CodeOf(err) != tt.code || !strings.Contains(err.Error(), tt.msg) {
			t.Errorf("Acquire(%q) = %v, want %v with %q", tt.quota, err, tt.code, tt.msg)
		}
	}

	if _, err := c.Release(ctx, &allotv1.ReleaseRequest{Region: "eu", GrantId: resp.GetGrants()[0].GetGrantId(), Tokens: 40, RequestId: "rel"}); err != nil {
		t.Fatalf("release an instance's grant: %v", err)
	}
	tc.waitSame()
	for _, n := range tc.nodes {
		if w := n.FSM().CurrentWindow(birch, n.FSM().Now()); w.Granted != 100 || w.Released != 40 {
			t.Errorf("%s: birch granted %d released %d, want 100 and 40", n.ID(), w.Granted, w.Released)
		}
	}
}

func TestResourceExhaustedMapsToItsCode(t *testing.T) {
	s := &Server{log: zap.NewNop(), metrics: NewMetrics(nil)}
	err := s.toConnect("Acquire", fmt.Errorf("acquire: %w", fmt.Errorf("wants[3].quota %q: at most %d: %w", "standard/x", 1, fsm.ErrResourceExhausted)))
	var ce *connect.Error
	if !errors.As(err, &ce) || ce.Code() != connect.CodeResourceExhausted || !strings.Contains(ce.Message(), "wants[3].quota") {
		t.Fatalf("toConnect = %v, want ResourceExhausted naming the want", err)
	}
}

// TestLargestAcquireFitsTheBody measures the largest Acquire the default
// config admits (MaxWantsPerCall wants, every quota name of the longest
// allowed length, every number at its widest) and its answer against the
// default body limit: one batched call per tick must always be sendable.
func TestLargestAcquireFitsTheBody(t *testing.T) {
	cfg := DefaultConfig()
	name := func(i int) string {
		s := fmt.Sprintf("%s/%d", strings.Repeat("t", 64), i)
		return s + strings.Repeat("v", fsm.MaxQuotaNameBytes-len(s))
	}
	req := &allotv1.AcquireRequest{Region: strings.Repeat("r", fsm.MaxRegionBytes), RequestId: strings.Repeat("i", fsm.MaxRequestIDBytes)}
	resp := &allotv1.AcquireResponse{LeaderNowUnixMs: fsm.MaxNowUnixMs, Replayed: true}
	for i := range cfg.MaxWantsPerCall {
		q := name(i)
		if len(q) != fsm.MaxQuotaNameBytes {
			t.Fatalf("name of %d bytes", len(q))
		}
		req.Wants = append(req.Wants, &allotv1.Want{Quota: q, Tokens: fsm.MaxLimit, DemandPerSecond: 1e300})
		resp.Grants = append(resp.Grants, &allotv1.Grant{
			Quota: q, GrantId: fmt.Sprintf("%d-%d", uint64(1)<<63, fsm.MaxWants*fsm.MaxBatch), Tokens: fsm.MaxLimit,
			WindowIndex: fsm.MaxNowUnixMs, WindowEndUnixMs: fsm.MaxNowUnixMs, ExpiresUnixMs: fsm.MaxNowUnixMs,
			TtlMs: fsm.MaxWindowMs, PoolExhausted: true,
		})
	}
	rq, rs := proto.Size(req), proto.Size(resp)
	t.Logf("%d wants of %d-byte names: request %d bytes, answer %d bytes, body limit %d", cfg.MaxWantsPerCall, fsm.MaxQuotaNameBytes, rq, rs, cfg.MaxBodyBytes)
	if rq > cfg.MaxBodyBytes || rs > cfg.MaxBodyBytes {
		t.Fatalf("the largest Acquire does not fit: request %d, answer %d, limit %d", rq, rs, cfg.MaxBodyBytes)
	}
}
