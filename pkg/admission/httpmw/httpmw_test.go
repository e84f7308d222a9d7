package httpmw_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
	"unicode/utf8"

	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"

	"github.com/allot-dev/allot/examples"
	"github.com/allot-dev/allot/internal/redistest"
	"github.com/allot-dev/allot/internal/testclock"
	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/admission/httpmw"
	"github.com/allot-dev/allot/pkg/policy"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

type ctxKey struct{}

// auth stands for the gateway's authentication middleware: it verifies a
// token and puts the identity in the context. Here the "token" is the
// Authorization header "tenant/user", trusted only because this is a test.
func auth(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if tok, ok := strings.CutPrefix(r.Header.Get("Authorization"), "Bearer "); ok {
			tenant, user, _ := strings.Cut(tok, "/")
			r = r.WithContext(context.WithValue(r.Context(), ctxKey{}, httpmw.Identity{Tenant: tenant, User: user, Authenticated: true}))
		}
		next.ServeHTTP(w, r)
	})
}

func identify(r *http.Request) httpmw.Identity {
	id, _ := r.Context().Value(ctxKey{}).(httpmw.Identity)
	return id
}

type gateway struct {
	srv *httptest.Server
	e   *admission.Engine
}

func newGateway(t *testing.T, store admission.Store, cfg admission.Config, opts ...admission.Option) *gateway {
	t.Helper()
	return newGatewayWith(t, examples.Northstar, nil, store, cfg, opts...)
}

// newGatewayWith is newGateway with policy src and middleware options mw.
func newGatewayWith(t *testing.T, src []byte, mw []httpmw.Option, store admission.Store, cfg admission.Config, opts ...admission.Option) *gateway {
	t.Helper()
	doc, err := policy.Parse(src)
	if err != nil {
		t.Fatal(err)
	}
	e, err := admission.New(cfg, store, doc, 7, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	g := &gateway{e: e}
	m, err := httpmw.New(e, httpmw.DefaultConfig(), append([]httpmw.Option{httpmw.WithIdentity(identify)}, mw...)...)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })
	g.srv = httptest.NewServer(auth(m(mux)))
	t.Cleanup(g.srv.Close)
	return g
}

// memGateway is a gateway on the in-memory store whose store and engine
// share one stopped clock, so that what a test counts cannot straddle a
// fixed window's edge or gain a refilled token on a slow machine.
func memGateway(t *testing.T) *gateway {
	t.Helper()
	clock := windowClock()
	return newGateway(t, memStore(t, clock), admission.DefaultConfig(), admission.WithClock(clock))
}

// windowClock is a stopped clock 1 s into a 10 s window aligned to the
// epoch, as P-ANON's windows are.
func windowClock() *testclock.Manual {
	return testclock.New(time.Now().Truncate(10 * time.Second).Add(time.Second))
}

func memStore(t *testing.T, clock admission.Clock) admission.Store {
	s, err := admission.NewMemoryStore(admission.DefaultMemoryConfig(), clock)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func (g *gateway) do(t *testing.T, method, path, token string, header ...string) *http.Response {
	t.Helper()
	req, _ := http.NewRequest(method, g.srv.URL+path, nil)
	if token != "" {
		req.Header.Set("Authorization", "Bearer "+token)
	}
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	return resp
}

func decode(t *testing.T, resp *http.Response) map[string]any {
	t.Helper()
	var m map[string]any
	if err := json.NewDecoder(resp.Body).Decode(&m); err != nil {
		t.Fatal(err)
	}
	return m
}

func TestAuthenticatedRead(t *testing.T) {
	g := memGateway(t)
	if _, err := g.e.DepositChunk(context.Background(), "p-global", "g1", 1000, time.Hour); err != nil {
		t.Fatal(err)
	}
	resp := g.do(t, "GET", "/catalog", "cedar/U-17")
	if resp.StatusCode != 200 {
		t.Fatalf("status %d", resp.StatusCode)
	}
	if got, want := resp.Header.Get("RateLimit-Policy"), `"p-read";q=20;w=10`; got != want {
		t.Errorf("RateLimit-Policy = %q, want %q", got, want)
	}
	if got, want := resp.Header.Get("RateLimit"), `"p-read";r=19;t=1`; got != want {
		t.Errorf("RateLimit = %q, want %q", got, want)
	}
	for i := 0; i < 7; i++ {
		resp = g.do(t, "GET", "/catalog", "cedar/U-17")
	}
	if got, want := resp.Header.Get("RateLimit"), `"p-read";r=12;t=4`; got != want {
		t.Errorf("after 8 reads RateLimit = %q, want %q", got, want)
	}
	for i := 0; i < 12; i++ {
		g.do(t, "GET", "/catalog", "cedar/U-17")
	}
	resp = g.do(t, "GET", "/catalog", "cedar/U-17")
	if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") != "1" {
		t.Fatalf("21st read: %d Retry-After %q; want 429 and 1", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
	b := decode(t, resp)
	if b["error"] != "rate_limited" || b["scope"] != "user" || !strings.HasPrefix(b["decisionId"].(string), "d-") {
		t.Fatalf("body %v", b)
	}
	for k := range b {
		if k != "error" && k != "scope" && k != "decisionId" {
			t.Errorf("body field %q: a refusal names the scope and the decision, no counters", k)
		}
	}
	// Headers on the 429 are the caller's own numbers.
	if got := resp.Header.Get("RateLimit"); got != `"p-read";r=0;t=10` {
		t.Errorf("429 RateLimit = %q", got)
	}
	// Another user of the same tenant is unaffected.
	if resp := g.do(t, "GET", "/catalog", "cedar/U-18"); resp.StatusCode != 200 {
		t.Fatalf("another user: %d", resp.StatusCode)
	}
}

func TestAnonymousGetsNoLimits(t *testing.T) {
	g := memGateway(t)
	for i := 0; i < 20; i++ {
		// A forged X-Forwarded-For changes nothing: the address is the
		// connection's.
		resp := g.do(t, "GET", "/login", "", "X-Forwarded-For", "198.51.100."+strings.Repeat("1", 1+i%3))
		if resp.StatusCode != 200 {
			t.Fatalf("anonymous %d: %d", i, resp.StatusCode)
		}
		if resp.Header.Get("RateLimit") != "" || resp.Header.Get("RateLimit-Policy") != "" {
			t.Fatal("limits advertised to an anonymous caller")
		}
	}
	resp := g.do(t, "GET", "/login", "")
	if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("21st anonymous request: %d", resp.StatusCode)
	}
	if b := decode(t, resp); b["scope"] != "ip" {
		t.Fatalf("body %v", b)
	}
	if resp.Header.Get("RateLimit") != "" {
		t.Fatal("limits advertised to an anonymous caller on a 429")
	}
}

// TestExportSlots: slots are held while the handler runs and released when
// it returns; the fourth concurrent export is refused by scope tenant.
func TestExportSlots(t *testing.T) {
	clock := testclock.New(time.Now())
	store, err := admission.NewMemoryStore(admission.DefaultMemoryConfig(), clock)
	if err != nil {
		t.Fatal(err)
	}
	doc, _ := policy.Parse(examples.Northstar)
	e, err := admission.New(admission.DefaultConfig(), store, doc, 1, admission.WithClock(clock))
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	block := make(chan struct{})
	mw, _ := httpmw.New(e, httpmw.DefaultConfig(), httpmw.WithIdentity(identify))
	srv := httptest.NewServer(auth(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		<-block
	}))))
	defer srv.Close()
	post := func() int {
		req, _ := http.NewRequest("POST", srv.URL+"/reports/export", nil)
		req.Header.Set("Authorization", "Bearer cedar/ops")
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Error(err)
			return 0
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	var wg sync.WaitGroup
	codes := make(chan int, 3)
	for i := 0; i < 3; i++ {
		wg.Add(1)
		go func() { defer wg.Done(); codes <- post() }()
		// Let the export get its slot, then 5 s pass: enough rate tokens.
		waitFor(t, func() bool { return e.Stats().Allowed == uint64(i+1) })
		clock.Advance(5 * time.Second)
	}
	if got := post(); got != http.StatusTooManyRequests {
		t.Fatalf("fourth concurrent export: %d, want 429", got)
	}
	close(block)
	wg.Wait()
	close(codes)
	for c := range codes {
		if c != 200 {
			t.Fatalf("export: %d", c)
		}
	}
	// All released: another export runs.
	clock.Advance(5 * time.Second)
	if got := post(); got != 200 {
		t.Fatalf("export after the others finished: %d", got)
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not reached")
		}
		time.Sleep(time.Millisecond)
	}
}

// TestUnavailable: with the store unreachable, a fail-closed rule answers
// 503 with Retry-After; a fallback rule keeps serving, except for a global
// quota (P-GLOBAL, 1 s windows) in the first and last PoolFallbackMargin of
// its window, where it answers 503 too. The clock is placed: on the wall
// clock, the catalog read failed whenever the test ran in such a stretch
// (half of every second).
func TestUnavailable(t *testing.T) {
	addr, err := redistest.ClosedAddr()
	if err != nil {
		t.Fatal(err)
	}
	client := redis.NewClient(&redis.Options{Addr: addr, MaxRetries: -1, DialerRetries: 1, DialTimeout: 100 * time.Millisecond})
	defer client.Close()
	store, err := admission.NewRedisStore(client, admission.DefaultRedisConfig())
	if err != nil {
		t.Fatal(err)
	}
	defer store.Close()
	cfg := admission.DefaultConfig()
	cfg.StoreTimeout = 200 * time.Millisecond
	clock := testclock.New(time.Now().Truncate(time.Second).Add(500 * time.Millisecond)) // mid-window
	g := newGateway(t, store, cfg, admission.WithClock(clock))
	resp := g.do(t, "POST", "/reports/export", "cedar/ops")
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("export with the store down: %d Retry-After %q; want 503 with Retry-After", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
	if b := decode(t, resp); b["error"] != "limiter_unavailable" {
		t.Fatalf("body %v", b)
	}
	if resp := g.do(t, "GET", "/catalog", "cedar/U-1"); resp.StatusCode != 200 {
		t.Fatalf("catalog read on fallback: %d", resp.StatusCode)
	}
	clock.Advance(400 * time.Millisecond) // 100 ms before the window's end
	if resp := g.do(t, "GET", "/catalog", "cedar/U-1"); resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" {
		t.Fatalf("catalog read on fallback at a window's end: %d Retry-After %q; want 503 with Retry-After", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
}

// TestBadRequest: a client's bad input is a 400 naming the field but no
// rule or limit; a descriptor the gateway adds that no rule uses is the
// gateway's fault, a 500.
func TestBadRequest(t *testing.T) {
	clock := windowClock()
	hits := httpmw.WithHits(func(r *http.Request) int64 {
		n, _ := strconv.ParseInt(r.URL.Query().Get("n"), 10, 64)
		return n
	})
	g := newGatewayWith(t, examples.Northstar, []httpmw.Option{hits}, memStore(t, clock), admission.DefaultConfig(), admission.WithClock(clock))
	for _, n := range []string{"-1", "21"} {
		resp := g.do(t, "GET", "/catalog?n="+n, "")
		if resp.StatusCode != http.StatusBadRequest {
			t.Fatalf("hits %s: %d, want 400", n, resp.StatusCode)
		}
		msg := decode(t, resp)["message"].(string)
		if !strings.HasPrefix(msg, "hits") || strings.Contains(msg, "p-anon") || strings.Contains(msg, "20") {
			t.Fatalf("hits %s: message %q; want one naming hits and no rule or limit", n, msg)
		}
	}

	plan := httpmw.WithDescriptors(func(*http.Request) []policy.Entry { return []policy.Entry{{Key: "plan", Value: "gold"}} })
	g = newGatewayWith(t, examples.Northstar, []httpmw.Option{plan}, memStore(t, clock), admission.DefaultConfig(), admission.WithClock(clock))
	resp := g.do(t, "GET", "/catalog", "cedar/U-1")
	if resp.StatusCode != http.StatusInternalServerError {
		t.Fatalf("a gateway descriptor no rule uses: %d, want 500", resp.StatusCode)
	}
	if b := decode(t, resp); b["error"] != "limiter_misconfigured" {
		t.Fatalf("body %v", b)
	}
	// A tenant or user the engine refuses comes from verified credentials,
	// not from the client: a logged 500 that names no internal descriptor.
	g = memGateway(t)
	for _, token := range []string{strings.Repeat("t", admission.MaxValueLen+1) + "/U-1", "cedar/" + strings.Repeat("u", admission.MaxValueLen+1), "cedar/U\xff"} {
		resp := g.do(t, "GET", "/catalog", token)
		b := decode(t, resp)
		if resp.StatusCode != http.StatusInternalServerError || b["error"] != "limiter_misconfigured" || b["message"] != nil {
			t.Fatalf("identity %.12q...: %d %v; want 500 limiter_misconfigured without a message", token, resp.StatusCode, b)
		}
	}
	// So is a bad entry of the gateway's own WithDescriptors.
	for _, extra := range [][]policy.Entry{{{Key: "plan tier", Value: "gold"}}, {{Key: "tenant", Value: "cedar"}}} {
		bad := httpmw.WithDescriptors(func(*http.Request) []policy.Entry { return extra })
		g = newGatewayWith(t, examples.Northstar, []httpmw.Option{bad}, memStore(t, clock), admission.DefaultConfig(), admission.WithClock(clock))
		resp := g.do(t, "GET", "/catalog", "cedar/U-1")
		b := decode(t, resp)
		if resp.StatusCode != http.StatusInternalServerError || b["error"] != "limiter_misconfigured" || b["message"] != nil {
			t.Fatalf("gateway descriptor %v: %d %v; want 500 limiter_misconfigured without a message", extra, resp.StatusCode, b)
		}
	}
	if _, err := httpmw.New(nil, httpmw.DefaultConfig()); err == nil {
		t.Fatal("nil decider accepted")
	}
	if _, err := httpmw.New(g.e, httpmw.Config{}); err == nil {
		t.Fatal("zero config accepted")
	}
}

// decideOnly hides the engine's DecideInto: the middleware then takes
// Decide's fresh Decisions, as with any other Decider.
type decideOnly struct{ e *admission.Engine }

func (d decideOnly) Decide(ctx context.Context, req *admission.Request) (*admission.Decision, error) {
	return d.e.Decide(ctx, req)
}

func (d decideOnly) Release(ctx context.Context, dec *admission.Decision) error {
	return d.e.Release(ctx, dec)
}

// TestPooledDecisionsAnswerAsDecide: with the engine (pooled Decisions) and
// with a Decider that only has Decide, the same requests get the same
// statuses and headers, and the pooled path allocates less per request.
func TestPooledDecisionsAnswerAsDecide(t *testing.T) {
	doc, err := policy.Parse(examples.Northstar)
	if err != nil {
		t.Fatal(err)
	}
	handler := func(pooled bool) http.Handler {
		clock := windowClock()
		e, err := admission.New(admission.DefaultConfig(), memStore(t, clock), doc, 7, admission.WithClock(clock))
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { e.Close() })
		var d httpmw.Decider = e
		if !pooled {
			d = decideOnly{e}
		}
		mw, err := httpmw.New(d, httpmw.DefaultConfig(), httpmw.WithIdentity(identify))
		if err != nil {
			t.Fatal(err)
		}
		return auth(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") })))
	}
	serve := func(h http.Handler, path, token string) *httptest.ResponseRecorder {
		req := httptest.NewRequest("GET", path, nil)
		req.RemoteAddr = "192.0.2.7:4000"
		if token != "" {
			req.Header.Set("Authorization", "Bearer "+token)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		return rec
	}
	pooled, plain := handler(true), handler(false)
	for i := 0; i < 25; i++ { // U-17 is denied after 20 reads
		for _, tok := range []string{"cedar/U-17", ""} {
			a, b := serve(pooled, "/catalog", tok), serve(plain, "/catalog", tok)
			if a.Code != b.Code || a.Header().Get("RateLimit") != b.Header().Get("RateLimit") ||
				a.Header().Get("Retry-After") != b.Header().Get("Retry-After") {
				t.Fatalf("read %d (token %q): pooled %d %v, plain %d %v", i, tok, a.Code, a.Header(), b.Code, b.Header())
			}
		}
	}
	if got := serve(pooled, "/catalog", "cedar/U-17").Code; got != http.StatusTooManyRequests {
		t.Fatalf("26th read: %d, want 429", got)
	}
	// Allocations per allowed request (a fresh user each run, so each is allowed).
	n := 0
	allocs := func(h http.Handler) float64 {
		return testing.AllocsPerRun(200, func() {
			n++
			serve(h, "/catalog", fmt.Sprintf("birch/u%d", n))
		})
	}
	if p, q := allocs(pooled), allocs(plain); p >= q {
		t.Fatalf("pooled path: %.0f allocations per request, Decide's path %.0f: want fewer", p, q)
	}
}

// TestPolicyWithoutAddressRules: the middleware sends ip and auth with every
// request. A policy that limits only tenants and routes (examples/plans.yaml
// has no ip rule) must still decide them, not answer 400.
func TestPolicyWithoutAddressRules(t *testing.T) {
	doc, err := policy.Parse([]byte(`
name: tenants-only
rules:
  - name: p-tenant
    scope: tenant
    match: [{key: tenant}]
    kind: token_bucket
    capacity: 2
    refill_per_second: 1
`))
	if err != nil {
		t.Fatal(err)
	}
	clock := windowClock()
	e, err := admission.New(admission.DefaultConfig(), memStore(t, clock), doc, 1, admission.WithClock(clock))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { e.Close() })
	mw, err := httpmw.New(e, httpmw.DefaultConfig(), httpmw.WithIdentity(identify))
	if err != nil {
		t.Fatal(err)
	}
	g := &gateway{e: e, srv: httptest.NewServer(auth(mw(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "ok") }))))}
	t.Cleanup(g.srv.Close)
	for i, want := range []int{200, 200, 429} {
		if resp := g.do(t, "GET", "/catalog", "atlas/U-1"); resp.StatusCode != want {
			t.Fatalf("request %d: %d, want %d", i+1, resp.StatusCode, want)
		}
	}
	if resp := g.do(t, "GET", "/catalog", ""); resp.StatusCode != 200 {
		t.Fatalf("anonymous request (no rule matches it): %d, want 200", resp.StatusCode)
	}
}

// TestDefaultRoute: HEAD counts as GET (net/http serves it with the GET
// handler), and a path too long or odd for a descriptor is still a route,
// not a 400 from the limiter.
func TestDefaultRoute(t *testing.T) {
	req := func(method, target string) *http.Request { return httptest.NewRequest(method, target, nil) }
	if got := httpmw.DefaultRoute(req("HEAD", "/catalog")); got != "GET /catalog" {
		t.Fatalf("HEAD /catalog: %q, want GET /catalog", got)
	}
	if got := httpmw.DefaultRoute(req("GET", "/a%0Ab")); got != "GET /a%0Ab" {
		t.Fatalf("a control character: %q, want the escaped path", got)
	}
	long1 := httpmw.DefaultRoute(req("GET", "/"+strings.Repeat("x", 400)+"1"))
	long2 := httpmw.DefaultRoute(req("GET", "/"+strings.Repeat("x", 400)+"2"))
	if len(long1) > admission.MaxValueLen || long1 == long2 {
		t.Fatalf("long paths: %q and %q; want distinct labels of at most %d bytes", long1, long2, admission.MaxValueLen)
	}
	if got := httpmw.DefaultRoute(req("GET", "/"+strings.Repeat("é", 150))); len(got) > admission.MaxValueLen || !utf8.ValidString(got) {
		t.Fatalf("a long multibyte path: %q; want valid UTF-8 of at most %d bytes", got, admission.MaxValueLen)
	}

	g := memGateway(t)
	if _, err := g.e.DepositChunk(context.Background(), "p-global", "g1", 1000, time.Hour); err != nil {
		t.Fatal(err)
	}
	for _, path := range []string{"/" + strings.Repeat("x", 400), "/a%0Ab", "/a%FFb"} {
		if resp := g.do(t, "GET", path, "cedar/U-1"); resp.StatusCode != http.StatusOK {
			t.Fatalf("GET %.40s: %d, want 200", path, resp.StatusCode)
		}
	}
	// P-READ: 20 reads per user, HEAD included.
	for i := 0; i < 20; i++ {
		if resp := g.do(t, "HEAD", "/catalog", "cedar/U-7"); resp.StatusCode != http.StatusOK {
			t.Fatalf("HEAD %d: %d", i, resp.StatusCode)
		}
	}
	if resp := g.do(t, "GET", "/catalog", "cedar/U-7"); resp.StatusCode != http.StatusTooManyRequests {
		t.Fatalf("GET after 20 HEADs: %d, want 429 (HEAD spends P-READ)", resp.StatusCode)
	}
}

// TestAuthenticatedWithoutTenant: an identity function that authenticates
// a caller but names no tenant leaves it limited as anonymous, by address
// (P-ANON: 20 per 10 s), never unlimited and never a 400 blaming the client.
func TestAuthenticatedWithoutTenant(t *testing.T) {
	for _, token := range []string{"/", "/U-1"} {
		t.Run(token, func(t *testing.T) {
			g := memGateway(t)
			for i := 0; i < 20; i++ {
				resp := g.do(t, "GET", "/orders", token)
				if resp.StatusCode != http.StatusOK || resp.Header.Get("RateLimit") != "" {
					t.Fatalf("request %d: %d RateLimit %q; want 200 without RateLimit", i, resp.StatusCode, resp.Header.Get("RateLimit"))
				}
			}
			resp := g.do(t, "GET", "/orders", token)
			if b := decode(t, resp); resp.StatusCode != http.StatusTooManyRequests || b["scope"] != "ip" {
				t.Fatalf("21st request: %d %v; want 429 by the ip scope", resp.StatusCode, b)
			}
		})
	}
}

const advertisePolicy = `
name: advertise
rules:
  - name: trial
    scope: tenant
    match: [{key: tenant}]
    kind: token_bucket
    capacity: 1
    refill_per_second: 0
    zero_refill_reason: a trial of one request
  - name: big
    scope: user
    match: [{key: tenant}, {key: user}]
    kind: token_bucket
    capacity: 1000000000000
    refill_per_second: 0.001
`

// TestAdvertiseEdges: a rule that never refills is advertised without a
// reset time and denies without Retry-After; integers beyond the 15 digits
// of a structured-field Integer are clamped.
func TestAdvertiseEdges(t *testing.T) {
	clock := windowClock()
	g := newGatewayWith(t, []byte(advertisePolicy), nil, memStore(t, clock), admission.DefaultConfig(), admission.WithClock(clock))
	resp := g.do(t, "GET", "/x", "cedar/U-1")
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("first request: %d", resp.StatusCode)
	}
	if got, want := resp.Header.Get("RateLimit-Policy"), `"trial";q=1, "big";q=1000000000000;w=999999999999999`; got != want {
		t.Fatalf("RateLimit-Policy %q, want %q", got, want)
	}
	if got, want := resp.Header.Get("RateLimit"), `"trial";r=0, "big";r=999999999999;t=1000`; got != want {
		t.Fatalf("RateLimit %q, want %q", got, want)
	}
	resp = g.do(t, "GET", "/x", "cedar/U-1")
	if resp.StatusCode != http.StatusTooManyRequests || resp.Header.Get("Retry-After") != "" {
		t.Fatalf("second request: %d Retry-After %q; want 429 without Retry-After", resp.StatusCode, resp.Header.Get("Retry-After"))
	}
}
