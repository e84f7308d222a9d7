package agent_test

import (
	"context"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"connectrpc.com/connect"
	commonrl "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"github.com/redis/go-redis/v9"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/allot-dev/allot/pkg/agent"
	allotv1 "github.com/allot-dev/allot/proto/allot/v1"
	"github.com/allot-dev/allot/proto/allot/v1/allotv1connect"
)

// apiPolicy: a bucket that never refills (so remaining counts every debit
// exactly), a daily window per route, two export slots, and a leased pool
// that is closed and never leased in these tests.
const apiPolicy = `
name: api
regions: [eu]
rules:
  - name: bucket
    scope: user
    match: [{key: tenant}, {key: user}]
    kind: token_bucket
    capacity: 100
    refill_per_second: 0
    zero_refill_reason: counts every debit exactly in tests
  - name: daily
    scope: route
    match: [{key: tenant}, {key: route, value: GET /daily}]
    kind: fixed_window
    limit: 3
    window: 24h
  - name: exports
    scope: route
    match: [{key: tenant}, {key: route, value: POST /export}]
    kind: concurrency
    max_in_flight: 2
    slot_ttl: 1h
  - name: pool
    scope: tenant
    match: [{key: tenant, value: pooled}]
    kind: global_quota
    limit: 100
    window: 1m
    lease: {chunk: 10, ttl: 1m}
  - name: anon
    scope: ip
    match: [{key: ip}]
    kind: fixed_window
    limit: 1000000
    window: 24h
`

// standalone returns an agent on apiPolicy with no allocator: the pool
// quota is always cut off.
func standalone(t testing.TB, mut func(*agent.Config)) (*agent.Agent, *served) {
	t.Helper()
	clearOfDailyTurn(t)
	cfg := testConfig("eu")
	cfg.EnvoyDomain = "allot"
	if mut != nil {
		mut(&cfg)
	}
	// Running, so that the test's end closes its store and the store's
	// pipeline workers with it.
	a := runAgent(t, newAgent(t, cfg, sharedRedis(t), agent.WithPolicy(mustParse(t, apiPolicy), 0))).Agent
	return a, serve(t, a)
}

// TestConnectBadInputIsRefusedWithoutDebit: on the Connect API and on the
// same service over the gRPC listener, bad input gets the right code and a
// message naming the field, and debits nothing.
func TestConnectBadInputIsRefusedWithoutDebit(t *testing.T) {
	onBothListeners(t, badInput)
}

// onBothListeners runs f against a fresh standalone agent's Connect API and,
// in another subtest, against the same service on its gRPC listener.
func onBothListeners(t *testing.T, f func(t *testing.T, c allotv1connect.AdmissionServiceClient)) {
	for _, api := range []string{"connect", "grpc"} {
		t.Run(api, func(t *testing.T) {
			_, s := standalone(t, nil)
			c := s.connect
			if api == "grpc" {
				c = s.grpc
			}
			f(t, c)
		})
	}
}

func badInput(t *testing.T, c allotv1connect.AdmissionServiceClient) {
	good := &allotv1.CheckRequest{Entries: entries("tenant", "acme", "user", "u1")}
	if r := check(t, c, good); !r.Allowed || r.Remaining != 99 || r.Rule != "bucket" {
		t.Fatalf("first check: %+v, want allowed by bucket with 99 left", r)
	}
	many := entries("tenant", "acme")
	for i := 0; i < 40; i++ {
		many = append(many, &allotv1.DescriptorEntry{Key: "k" + string(rune('a'+i%26)) + string(rune('a'+i/26)), Value: "v"})
	}
	tests := []struct {
		name     string
		give     *allotv1.CheckRequest
		wantCode connect.Code
		wantMsg  string
	}{
		{"no entries", &allotv1.CheckRequest{RequestId: "r1"}, connect.CodeInvalidArgument, "entries: must not be empty"},
		{"unknown descriptor", &allotv1.CheckRequest{Entries: entries("tenant", "acme", "user", "u1", "colour", "red")}, connect.CodeInvalidArgument, "entries[2].key"},
		{"negative cost", &allotv1.CheckRequest{Entries: good.Entries, Cost: -1}, connect.CodeInvalidArgument, "cost: must not be negative"},
		{"huge cost", &allotv1.CheckRequest{Entries: good.Entries, Cost: 1 << 50}, connect.CodeInvalidArgument, "cost:"},
		{"cost above capacity", &allotv1.CheckRequest{Entries: good.Entries, Cost: 101}, connect.CodeInvalidArgument, "can ever admit"},
		{"user without tenant", &allotv1.CheckRequest{Entries: entries("user", "u1")}, connect.CodeInvalidArgument, "tenant"},
		{"duplicate key", &allotv1.CheckRequest{Entries: entries("tenant", "acme", "tenant", "beta")}, connect.CodeInvalidArgument, "entries[1].key: \"tenant\" also at entries[0]"},
		{"unprintable value", &allotv1.CheckRequest{Entries: entries("tenant", "acme", "user", "u\x01")}, connect.CodeInvalidArgument, "entries[1].value"},
		{"long request id", &allotv1.CheckRequest{Entries: good.Entries, RequestId: strings.Repeat("r", 200)}, connect.CodeInvalidArgument, "request_id"},
		{"too many descriptors", &allotv1.CheckRequest{Entries: many}, connect.CodeInvalidArgument, "entries: 41 entries"},
		{"oversized body", &allotv1.CheckRequest{Entries: entries("tenant", "acme", "user", strings.Repeat("x", 100<<10))}, connect.CodeResourceExhausted, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			_, err := c.Check(ctx, connect.NewRequest(tt.give))
			if connect.CodeOf(err) != tt.wantCode || !strings.Contains(err.Error(), tt.wantMsg) {
				t.Fatalf("error %v, want %s containing %q", err, tt.wantCode, tt.wantMsg)
			}
		})
	}
	if r := check(t, c, good); !r.Allowed || r.Remaining != 98 {
		t.Fatalf("after the bad requests: %+v, want 98 left (nothing debited by them)", r)
	}
	ctx := context.Background()
	if _, err := c.ReleaseSlot(ctx, connect.NewRequest(&allotv1.ReleaseSlotRequest{Entries: good.Entries})); connect.CodeOf(err) != connect.CodeInvalidArgument ||
		!strings.Contains(err.Error(), "request_id") {
		t.Fatalf("ReleaseSlot without request_id: %v, want InvalidArgument naming request_id", err)
	}
	// Without entries no slot can be found: "0 released" would leave the
	// caller's slots held until their slot_ttl.
	if _, err := c.ReleaseSlot(ctx, connect.NewRequest(&allotv1.ReleaseSlotRequest{RequestId: "r1"})); connect.CodeOf(err) != connect.CodeInvalidArgument ||
		!strings.Contains(err.Error(), "entries: must not be empty") {
		t.Fatalf("ReleaseSlot without entries: %v, want InvalidArgument naming entries", err)
	}
}

func TestNotReadyWithoutPolicy(t *testing.T) {
	fa := startFakeAllocator(t) // nothing published
	a := runAgent(t, newAgent(t, testConfig("eu", fa.addr), sharedRedis(t)))
	s := serve(t, a.Agent)
	_, err := s.connect.Check(context.Background(), connect.NewRequest(&allotv1.CheckRequest{Entries: entries("tenant", "acme")}))
	if connect.CodeOf(err) != connect.CodeUnavailable {
		t.Fatalf("Check without a policy: %v, want Unavailable", err)
	}
	resp, err := http.Get("http://" + s.addr + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable {
		t.Fatalf("/readyz without a policy: %d %s, want 503", resp.StatusCode, body)
	}
}

// TestReleaseSlotFromAnyAgent: slots are released by request id from the
// store, so ReleaseSlot works on an agent that did not make the decision
// (several agents behind one address, or a restarted one).
func TestReleaseSlotFromAnyAgent(t *testing.T) {
	cfg := testConfig("eu")
	rdb := sharedRedis(t)
	doc := mustParse(t, apiPolicy)
	// Running, so that the test's end closes their stores' pipeline workers.
	a := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(doc, 0))).Agent
	b := runAgent(t, newAgent(t, cfg, rdb, agent.WithPolicy(doc, 0))).Agent // same region, same store
	sa, sb := serve(t, a), serve(t, b)
	export := entries("tenant", "acme", "route", "POST /export")
	for _, id := range []string{"r1", "r2"} {
		if r := check(t, sa.connect, &allotv1.CheckRequest{Entries: export, RequestId: id}); !r.Allowed {
			t.Fatalf("export %s: %+v, want allowed", id, r)
		}
	}
	if r := check(t, sa.connect, &allotv1.CheckRequest{Entries: export, RequestId: "r3"}); r.Allowed || r.Rule != "exports" || r.Unavailable {
		t.Fatalf("third export: %+v, want a 429 by exports (2 in flight)", r)
	}
	ctx := context.Background()
	for i, want := range []int64{1, 0} { // idempotent
		resp, err := sb.connect.ReleaseSlot(ctx, connect.NewRequest(&allotv1.ReleaseSlotRequest{Entries: export, RequestId: "r1"}))
		if err != nil || resp.Msg.Released != want {
			t.Fatalf("release %d on the other agent: %v %v, want %d released", i, resp, err, want)
		}
	}
	if r := check(t, sa.connect, &allotv1.CheckRequest{Entries: export, RequestId: "r3"}); !r.Allowed {
		t.Fatalf("export after the release: %+v, want allowed", r)
	}
}

func rlsReq(hits uint32, descs ...[]string) *rlsv3.RateLimitRequest {
	r := &rlsv3.RateLimitRequest{Domain: "allot", HitsAddend: hits}
	for _, kv := range descs {
		d := &commonrl.RateLimitDescriptor{}
		for i := 0; i+1 < len(kv); i += 2 {
			d.Entries = append(d.Entries, &commonrl.RateLimitDescriptor_Entry{Key: kv[i], Value: kv[i+1]})
		}
		r.Descriptors = append(r.Descriptors, d)
	}
	return r
}

func header(resp *rlsv3.RateLimitResponse, key string) string {
	for _, h := range resp.GetResponseHeadersToAdd() {
		if h.GetKey() == key {
			return h.GetValue()
		}
	}
	return ""
}

func TestEnvoyRateLimitService(t *testing.T) {
	_, s := standalone(t, func(cfg *agent.Config) { cfg.EnvoyRequestIDKey = agent.RequestIDKey })
	ctx := context.Background()
	should := func(req *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		defer cancel()
		return s.rls.ShouldRateLimit(cctx, req)
	}

	// Descriptors are merged into one request and decided at once; the
	// request_id entry (EnvoyRequestIDKey) is the request id.
	resp, err := should(rlsReq(0, []string{"tenant", "acme"}, []string{"tenant", "acme", "user", "u2"}, []string{"request_id", "x-1"}))
	if err != nil {
		t.Fatal(err)
	}
	if resp.GetOverallCode() != rlsv3.RateLimitResponse_OK || len(resp.GetStatuses()) != 3 || resp.GetStatuses()[1].GetLimitRemaining() != 99 {
		t.Fatalf("allowed request: %v, want OK with 3 statuses and 99 remaining", resp)
	}

	// A denial is OVER_LIMIT with guidance headers.
	daily := []string{"tenant", "acme", "route", "GET /daily"}
	for i := 0; i < 3; i++ {
		if resp, err := should(rlsReq(0, daily)); err != nil || resp.GetOverallCode() != rlsv3.RateLimitResponse_OK {
			t.Fatalf("daily %d: %v %v", i, resp, err)
		}
	}
	resp, err = should(rlsReq(0, daily))
	if err != nil {
		t.Fatal(err)
	}
	if resp.GetOverallCode() != rlsv3.RateLimitResponse_OVER_LIMIT || header(resp, "x-allot-rule") != "daily" ||
		header(resp, "retry-after") == "" || header(resp, "x-allot-decision-id") == "" || resp.GetStatuses()[0].GetDurationUntilReset() == nil {
		t.Fatalf("fourth daily request: %v, want OVER_LIMIT by daily with retry-after and a decision id", resp)
	}

	// A pool that cannot be refilled (no allocator): UNAVAILABLE, so Envoy
	// with failure_mode_deny answers 503.
	if _, err := should(rlsReq(0, []string{"tenant", "pooled"})); status.Code(err) != codes.Unavailable {
		t.Fatalf("cut-off pool: %v, want UNAVAILABLE", err)
	}

	// Bad input: INVALID_ARGUMENT naming the field, nothing debited.
	withLimit := rlsReq(0, []string{"tenant", "acme", "user", "u2"})
	withLimit.Descriptors[0].Limit = &commonrl.RateLimitDescriptor_RateLimitOverride{RequestsPerUnit: 5}
	negative := rlsReq(0, []string{"tenant", "acme", "user", "u2"})
	negative.Descriptors[0].IsNegativeHits = true
	mismatch := rlsReq(0, []string{"tenant", "acme"}, []string{"user", "u2"})
	mismatch.Descriptors[0].HitsAddend = wrapperspb.UInt64(2)
	mismatch.Descriptors[1].HitsAddend = wrapperspb.UInt64(3)
	noDomain := rlsReq(0, []string{"tenant", "acme"})
	noDomain.Domain = ""
	otherDomain := rlsReq(0, []string{"tenant", "acme"})
	otherDomain.Domain = "other"
	tests := []struct {
		name    string
		give    *rlsv3.RateLimitRequest
		code    codes.Code
		wantMsg string
	}{
		{"no domain", noDomain, codes.InvalidArgument, "domain"},
		{"other domain", otherDomain, codes.InvalidArgument, "domain"},
		{"no descriptors", rlsReq(0), codes.InvalidArgument, "descriptors: must not be empty"},
		{"empty descriptor", rlsReq(0, []string{}), codes.InvalidArgument, "descriptors[0].entries"},
		{"empty key", rlsReq(0, []string{"", "x"}), codes.InvalidArgument, "descriptors[0].entries[0].key"},
		{"conflicting values", rlsReq(0, []string{"tenant", "acme"}, []string{"tenant", "beta"}), codes.InvalidArgument, "conflicts"},
		{"limit override", withLimit, codes.InvalidArgument, "descriptors[0].limit"},
		{"negative hits", negative, codes.InvalidArgument, "is_negative_hits"},
		{"hits mismatch", mismatch, codes.InvalidArgument, "hits_addend"},
		{"unknown key", rlsReq(0, []string{"tenant", "acme", "colour", "red"}), codes.InvalidArgument, "colour"},
		// The engine's index of a merged entry is named as Envoy sent it.
		{"unknown key, named where Envoy sent it", rlsReq(0, []string{"tenant", "acme"}, []string{"tenant", "acme", "colour", "red"}), codes.InvalidArgument, "descriptors[1].entries[1].key"},
		{"cost above capacity", rlsReq(500, []string{"tenant", "acme", "user", "u2"}), codes.InvalidArgument, "can ever admit"},
		{"oversized", rlsReq(0, []string{"tenant", "acme", "user", strings.Repeat("x", 100<<10)}), codes.ResourceExhausted, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := should(tt.give)
			if status.Code(err) != tt.code || !strings.Contains(err.Error(), tt.wantMsg) {
				t.Fatalf("error %v, want %s containing %q", err, tt.code, tt.wantMsg)
			}
		})
	}
	resp, err = should(rlsReq(2, []string{"tenant", "acme", "user", "u2"}))
	if err != nil || resp.GetStatuses()[0].GetLimitRemaining() != 97 {
		t.Fatalf("after the bad requests: %v %v, want 97 left (99 - 2: nothing debited by them)", resp, err)
	}
}

// TestReleaseSlotReportsTheCallersEnd: a ReleaseSlot whose caller left or
// whose deadline passed is answered Canceled or DeadlineExceeded, on the
// Connect handler and on the gRPC one, not Unavailable: the store did not
// fail, the caller stopped waiting for it.
func TestReleaseSlotReportsTheCallersEnd(t *testing.T) {
	a, _ := standalone(t, nil)
	export := entries("tenant", "acme", "route", "POST /export")
	canceled, cancel := context.WithCancel(context.Background())
	cancel()
	expired, stop := context.WithDeadline(context.Background(), time.Now().Add(-time.Second))
	defer stop()
	for _, tt := range []struct {
		name string
		ctx  context.Context
		want connect.Code
	}{
		{"canceled", canceled, connect.CodeCanceled},
		{"deadline exceeded", expired, connect.CodeDeadlineExceeded},
	} {
		t.Run(tt.name, func(t *testing.T) {
			req := &allotv1.ReleaseSlotRequest{Entries: export, RequestId: "r1"}
			_, err := agent.NewAdmissionService(a).ReleaseSlot(tt.ctx, connect.NewRequest(req))
			if connect.CodeOf(err) != tt.want {
				t.Fatalf("Connect ReleaseSlot: %v, want %s", err, tt.want)
			}
			_, err = agent.NewGRPCAdmissionService(a).ReleaseSlot(tt.ctx, req)
			if status.Code(err) != codes.Code(tt.want) {
				t.Fatalf("gRPC ReleaseSlot: %v, want %s", err, tt.want)
			}
		})
	}
}

// TestCheckSaysWhenItReplays: a retry of an admitted request id gets the
// earlier decision back, uncharged, and says so (replayed, the earlier
// decision id), whichever agent of the region answers it; a new id is
// decided afresh.
func TestCheckSaysWhenItReplays(t *testing.T) {
	_, s := standalone(t, nil)
	user := entries("tenant", "acme", "user", "u1")
	first := check(t, s.connect, &allotv1.CheckRequest{Entries: user, RequestId: "retry-1"})
	if !first.Allowed || first.Replayed {
		t.Fatalf("first answer: %+v, want allowed and not replayed", first)
	}
	again := check(t, s.connect, &allotv1.CheckRequest{Entries: user, RequestId: "retry-1"})
	if !again.Allowed || !again.Replayed || again.DecisionId != first.DecisionId || again.Remaining != first.Remaining {
		t.Fatalf("retry: %+v, want the first decision (%s, %d remaining) replayed", again, first.DecisionId, first.Remaining)
	}
	other := check(t, s.connect, &allotv1.CheckRequest{Entries: user, RequestId: "retry-2"})
	if !other.Allowed || other.Replayed || other.Remaining != first.Remaining-1 {
		t.Fatalf("a new request id: %+v, want decided and charged (%d remaining)", other, first.Remaining-1)
	}
	for _, r := range []*allotv1.CheckResponse{first, again, other} {
		if r.Degraded {
			t.Errorf("%+v: degraded, but the store decided", r)
		}
	}
}

// degradedPolicy has a rule of each fail mode a store failure can show.
const degradedPolicy = `
name: degraded
regions: [eu]
rules:
  - name: open
    scope: user
    match: [{key: tenant}, {key: user}]
    kind: token_bucket
    capacity: 10
    refill_per_second: 1
    fail_mode: open
  - name: shut
    scope: route
    match: [{key: tenant}, {key: route}]
    kind: fixed_window
    limit: 5
    window: 1m
    fail_mode: closed
`

// TestCheckSaysWhenAFailModeDecided: when the store cannot answer, the
// answer says a fail mode made it (degraded), on the Connect API and the
// gRPC listener: admitted by an open rule, unavailable by a closed one. A
// gateway counts these, and the chaos checkers charge such admissions to
// the in-process share rather than to a lease.
func TestCheckSaysWhenAFailModeDecided(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	dead := ln.Addr().String()
	_ = ln.Close() // nothing listens there: every store call fails at once
	rdb := redis.NewClient(&redis.Options{Addr: dead, MaxRetries: -1})
	defer rdb.Close()
	a := runAgent(t, newAgent(t, testConfig("eu"), rdb, agent.WithPolicy(mustParse(t, degradedPolicy), 0))).Agent
	s := serve(t, a)
	for _, tt := range []struct {
		name string
		c    allotv1connect.AdmissionServiceClient
	}{{"connect", s.connect}, {"grpc", s.grpc}} {
		t.Run(tt.name, func(t *testing.T) {
			open := check(t, tt.c, &allotv1.CheckRequest{Entries: entries("tenant", "acme", "user", "u1")})
			if !open.Allowed || !open.Degraded || open.Unavailable {
				t.Errorf("an open rule without its store: %+v, want allowed and degraded", open)
			}
			shut := check(t, tt.c, &allotv1.CheckRequest{Entries: entries("tenant", "acme", "route", "GET /x")})
			if shut.Allowed || !shut.Unavailable || !shut.Degraded || shut.Rule != "shut" {
				t.Errorf("a closed rule without its store: %+v, want unavailable and degraded, naming shut", shut)
			}
		})
	}
}

// TestEnvoyRequestIDEntryIsADescriptorByDefault: without
// Config.EnvoyRequestIDKey, a request_id entry is a descriptor entry like
// any other: a client that controls it (x-request-id passed through) cannot
// replay an earlier admission uncharged. It used to be the idempotency id
// whatever the config.
func TestEnvoyRequestIDEntryIsADescriptorByDefault(t *testing.T) {
	_, s := standalone(t, func(cfg *agent.Config) {
		cfg.Engine.ExtraDescriptors = []string{"request_id"} // accepted although no rule uses it
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for i, want := range []uint32{99, 98, 97} {
		resp, err := s.rls.ShouldRateLimit(ctx, rlsReq(0, []string{"tenant", "acme", "user", "u1"}, []string{"request_id", "same"}))
		if err != nil || resp.GetOverallCode() != rlsv3.RateLimitResponse_OK || resp.GetStatuses()[0].GetLimitRemaining() != want {
			t.Fatalf("request %d with request_id=same: %v %v, want OK with %d left (each one charged)", i, resp, err, want)
		}
	}
	// Without the extra descriptor it is an unknown key, named where Envoy
	// sent it.
	_, s = standalone(t, nil)
	_, err := s.rls.ShouldRateLimit(ctx, rlsReq(0, []string{"tenant", "acme"}, []string{"request_id", "x-1"}))
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "descriptors[1].entries[0].key") {
		t.Fatalf("request_id entry without the opt-in: %v, want InvalidArgument naming descriptors[1].entries[0].key", err)
	}
}

// TestEnvoyHitsAddendPerDescriptor: a descriptor's hits_addend overrides
// the request's (0 meaning 1) for that descriptor, as in Envoy. allot
// decides one request with one cost, so every descriptor's effective hits
// must be equal; a descriptor override of 0 (check without consuming) is not
// supported. Refused requests debit nothing.
func TestEnvoyHitsAddendPerDescriptor(t *testing.T) {
	_, s := standalone(t, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	user := []string{"tenant", "acme", "user", "u1"}
	route := []string{"tenant", "acme", "route", "GET /other"}
	req := func(top uint32, over ...int) *rlsv3.RateLimitRequest { // over[i] < 0: no override
		r := rlsReq(top, user, route)
		for i, h := range over {
			if h >= 0 {
				r.Descriptors[i].HitsAddend = wrapperspb.UInt64(uint64(h))
			}
		}
		return r
	}
	left := uint32(100)
	tests := []struct {
		name    string
		give    *rlsv3.RateLimitRequest
		cost    uint32 // when accepted
		wantErr string
	}{
		{"no overrides, request 0 means 1", req(0), 1, ""},
		{"request's hits", req(3), 3, ""},
		{"every descriptor overrides the request's 0", req(0, 2, 2), 2, ""},
		{"every descriptor overrides the request's 1", req(1, 2, 2), 2, ""},
		{"an override equal to the request's", req(3, -1, 3), 3, ""},
		{"an override equal to the request's implicit 1", req(0, 1, -1), 1, ""},
		{"an override next to a descriptor of the request's implicit 1", req(0, -1, 2), 0, "descriptors[1].hits_addend"},
		{"an override next to a descriptor of the request's 1", req(1, 2, -1), 0, "descriptors[0].hits_addend"},
		{"different overrides", req(0, 2, 3), 0, "descriptors[1].hits_addend"},
		{"override 0", req(0, 0, -1), 0, "descriptors[0].hits_addend"},
		{"override 0 on every descriptor", req(0, 0, 0), 0, "descriptors[0].hits_addend"},
	}
	for _, tt := range tests {
		resp, err := s.rls.ShouldRateLimit(ctx, tt.give)
		if tt.wantErr != "" {
			if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), tt.wantErr) {
				t.Fatalf("%s: %v %v, want InvalidArgument naming %s", tt.name, resp, err, tt.wantErr)
			}
			continue
		}
		left -= tt.cost
		if err != nil || resp.GetOverallCode() != rlsv3.RateLimitResponse_OK || resp.GetStatuses()[0].GetLimitRemaining() != left {
			t.Fatalf("%s: %v %v, want OK with %d left (cost %d)", tt.name, resp, err, left, tt.cost)
		}
	}
	_, err := s.rls.ShouldRateLimit(ctx, req(0, -1, 2))
	if msg := status.Convert(err).Message(); !strings.Contains(msg, "one cost") {
		t.Fatalf("mixed hits: %q, want it to say that one request has one cost", msg)
	}
	_, err = s.rls.ShouldRateLimit(ctx, req(0, 0, -1))
	if msg := status.Convert(err).Message(); !strings.Contains(msg, "not supported") {
		t.Fatalf("override 0: %q, want it to say that it is not supported", msg)
	}
}

// TestEnvoyRequestIDKeyOptIn: with Config.EnvoyRequestIDKey set, the entry
// with that key is the request id, not an entry: a retry with the same id
// is the earlier admission, not charged again; any other key (request_id
// included) is an ordinary entry. Errors about the id name the entry it came
// from, as Envoy sent it. A request whose only entry is the id has nothing
// to decide by: InvalidArgument, as one without descriptors.
func TestEnvoyRequestIDKeyOptIn(t *testing.T) {
	_, s := standalone(t, func(cfg *agent.Config) {
		cfg.EnvoyRequestIDKey = "edge_id"
		cfg.Engine.ExtraDescriptors = []string{"request_id"}
	})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	user := []string{"tenant", "acme", "user", "u1"}
	for i, want := range []uint32{99, 99} {
		resp, err := s.rls.ShouldRateLimit(ctx, rlsReq(0, user, []string{"edge_id", "e-1"}))
		if err != nil || resp.GetOverallCode() != rlsv3.RateLimitResponse_OK || resp.GetStatuses()[0].GetLimitRemaining() != want {
			t.Fatalf("request %d with edge_id=e-1: %v %v, want OK with %d left (the retry is not charged)", i, resp, err, want)
		}
	}
	for i, want := range []uint32{98, 97} {
		resp, err := s.rls.ShouldRateLimit(ctx, rlsReq(0, user, []string{"request_id", "same"}))
		if err != nil || resp.GetStatuses()[0].GetLimitRemaining() != want {
			t.Fatalf("request %d with request_id=same: %v %v, want %d left (an ordinary entry: charged)", i, resp, err, want)
		}
	}
	for _, tt := range []struct {
		name, id, want string
	}{
		{"too long", strings.Repeat("r", 200), "descriptors[1].entries[0].value: 200 bytes"},
		{"unprintable", "r\x01", "descriptors[1].entries[0].value: not printable"},
	} {
		_, err := s.rls.ShouldRateLimit(ctx, rlsReq(0, user, []string{"edge_id", tt.id}))
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), tt.want) {
			t.Fatalf("%s request id: %v, want InvalidArgument containing %q", tt.name, err, tt.want)
		}
	}
	_, err := s.rls.ShouldRateLimit(ctx, rlsReq(0, user, []string{"edge_id", "e-2"}, []string{"edge_id", "e-3"}))
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "descriptors[2].entries[0].value") {
		t.Fatalf("two request ids: %v, want InvalidArgument naming the second", err)
	}
	// A request id alone is nothing to decide by, as no descriptor at all.
	for name, req := range map[string]*rlsv3.RateLimitRequest{
		"no descriptors":      rlsReq(0),
		"the request id only": rlsReq(0, []string{"edge_id", "e-4"}),
	} {
		if _, err := s.rls.ShouldRateLimit(ctx, req); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "descriptors: must not be empty") {
			t.Fatalf("%s: %v, want InvalidArgument: descriptors must not be empty", name, err)
		}
	}
	if resp, err := s.rls.ShouldRateLimit(ctx, rlsReq(0, user)); err != nil || resp.GetStatuses()[0].GetLimitRemaining() != 96 {
		t.Fatalf("after the bad requests: %v %v, want 96 left (nothing debited by them)", resp, err)
	}
}

// TestEnvoyDescriptorStatuses: each descriptor's status is about the rules
// whose keys it carries: the ip descriptor stays OK with its own remaining
// while the route descriptor is OVER_LIMIT; an allowed route descriptor
// carries its limit (3 a day) for Envoy's x-ratelimit headers; a rule
// whose keys span two descriptors is reported on both.
func TestEnvoyDescriptorStatuses(t *testing.T) {
	_, s := standalone(t, nil)
	should := func(req *rlsv3.RateLimitRequest) *rlsv3.RateLimitResponse {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		resp, err := s.rls.ShouldRateLimit(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}
	ip := []string{"ip", "10.0.0.1"}
	daily := []string{"tenant", "statuses", "route", "GET /daily"}
	for i := 0; i < 3; i++ {
		resp := should(rlsReq(0, ip, daily))
		st := resp.GetStatuses()
		if resp.GetOverallCode() != rlsv3.RateLimitResponse_OK || len(st) != 2 {
			t.Fatalf("request %d: %v, want OK with 2 statuses", i, resp)
		}
		if st[0].GetCode() != rlsv3.RateLimitResponse_OK || st[0].GetCurrentLimit() != nil || st[0].GetLimitRemaining() < 999_000 {
			t.Fatalf("request %d: ip status %v; want OK, the ip rule's remaining and no limit (ip rules are not advertised)", i, st[0])
		}
		l := st[1].GetCurrentLimit()
		if st[1].GetCode() != rlsv3.RateLimitResponse_OK || st[1].GetLimitRemaining() != uint32(2-i) ||
			l.GetRequestsPerUnit() != 3 || l.GetUnit() != rlsv3.RateLimitResponse_RateLimit_DAY || l.GetName() != "daily" {
			t.Fatalf("request %d: route status %v; want OK, %d remaining, daily's limit of 3 a day", i, st[1], 2-i)
		}
	}
	resp := should(rlsReq(0, ip, daily))
	st := resp.GetStatuses()
	if resp.GetOverallCode() != rlsv3.RateLimitResponse_OVER_LIMIT {
		t.Fatalf("fourth request: %v, want OVER_LIMIT", resp)
	}
	if st[0].GetCode() != rlsv3.RateLimitResponse_OK || st[0].GetLimitRemaining() < 999_000 {
		t.Fatalf("fourth request: ip status %v; want OK with the ip rule's remaining", st[0])
	}
	if st[1].GetCode() != rlsv3.RateLimitResponse_OVER_LIMIT || st[1].GetLimitRemaining() != 0 || st[1].GetDurationUntilReset() == nil {
		t.Fatalf("fourth request: route status %v; want OVER_LIMIT, 0 remaining, a reset", st[1])
	}

	// daily's keys in two descriptors: both report it.
	tenant, route := []string{"tenant", "statuses2"}, []string{"route", "GET /daily"}
	for i := 0; i < 3; i++ {
		should(rlsReq(0, tenant, route))
	}
	resp = should(rlsReq(0, tenant, route))
	if st := resp.GetStatuses(); resp.GetOverallCode() != rlsv3.RateLimitResponse_OVER_LIMIT ||
		st[0].GetCode() != rlsv3.RateLimitResponse_OVER_LIMIT || st[1].GetCode() != rlsv3.RateLimitResponse_OVER_LIMIT {
		t.Fatalf("a spanning rule's denial: %v; want both statuses OVER_LIMIT", resp)
	}
}
