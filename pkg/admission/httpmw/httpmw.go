// Package httpmw is net/http middleware that puts the admission engine in
// front of a handler.
//
// It runs after authentication: the caller's identity comes from a function
// the gateway supplies, which reads verified claims (typically a value the
// auth middleware put in the request context), never a header the client
// sets. 401 and 403 remain the auth layer's answers.
//
// For each request the middleware builds descriptors — ip (from the trusted
// connection, not X-Forwarded-For, unless the gateway says otherwise), auth
// ("anonymous" or "token"), tenant, user and route — and asks the engine:
//
//   - Allow: the handler runs; concurrency slots are released when it returns.
//   - Deny: 429 Too Many Requests, an integer Retry-After (rounded up), and a
//     JSON body naming the denying scope and the decision id — never another
//     tenant's numbers.
//   - Unavailable: 503 Service Unavailable with Retry-After, when a
//     fail-closed rule could not be decided.
//
// Authenticated callers also get the RateLimit-Policy and RateLimit fields
// of the IETF httpapi draft (draft-ietf-httpapi-ratelimit-headers) for their
// own tenant, user and route rules, e.g.
//
//	RateLimit-Policy: "p-read";q=20;w=10
//	RateLimit: "p-read";r=12;t=4
//
// Anonymous callers get none: quotas and reset times would leak plan details.
// A rule that never refills (zero_refill_reason) denies without Retry-After
// and is advertised without a reset time: waiting will not help.
//
// An authenticated identity without a tenant is a fault of the identity
// function: such a caller is limited as anonymous (by address), never left
// unlimited, and the fault is logged. Likewise a descriptor the gateway adds
// (WithDescriptors) that no rule uses is the gateway's fault: 500, logged,
// not a 400 blaming the client; so is any descriptor the gateway built that
// the engine refuses (a tenant or user over MaxValueLen bytes or not
// printable UTF-8, a bad WithDescriptors entry).
package httpmw

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"go.uber.org/zap"

	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/policy"
)

// Decider is what the middleware needs from the engine. A Decider that also
// has the engine's DecideInto (the engine itself) decides into Decisions
// the middleware pools, so a request allocates no Decision.
type Decider interface {
	// Decide answers one request.
	Decide(ctx context.Context, req *admission.Request) (*admission.Decision, error)
	// Release gives back a decision's concurrency slots.
	Release(ctx context.Context, d *admission.Decision) error
}

var _ Decider = (*admission.Engine)(nil)

// intoDecider is a Decider that can decide into a caller's Decision, as
// *admission.Engine can: the middleware then reuses pooled Decisions and
// makes no garbage Decision per request.
type intoDecider interface {
	DecideInto(ctx context.Context, req *admission.Request, d *admission.Decision) error
}

var _ intoDecider = (*admission.Engine)(nil)

// Identity is the verified caller.
type Identity struct {
	// Tenant and User come from verified claims; empty when unknown.
	Tenant, User string
	// Authenticated is false for anonymous callers (the pre-authentication
	// stage): they are limited by address and get no RateLimit fields.
	Authenticated bool
}

// Config configures the middleware.
type Config struct {
	// ReleaseTimeout bounds the release of concurrency slots after the
	// handler returns; a slot that cannot be released expires by its TTL.
	ReleaseTimeout time.Duration
	// AdvertiseLimits adds RateLimit-Policy and RateLimit to responses to
	// authenticated callers.
	AdvertiseLimits bool
}

// DefaultConfig releases slots within a second and advertises limits.
func DefaultConfig() Config {
	return Config{ReleaseTimeout: time.Second, AdvertiseLimits: true}
}

// Validate says what is wrong with c, or returns nil.
func (c Config) Validate() error {
	if c.ReleaseTimeout <= 0 {
		return fmt.Errorf("httpmw config: ReleaseTimeout must be positive, got %s", c.ReleaseTimeout)
	}
	return nil
}

// Option sets an optional function of the middleware.
type Option func(*options)

type options struct {
	identify  func(*http.Request) Identity
	route     func(*http.Request) string
	clientIP  func(*http.Request) string
	requestID func(*http.Request) string
	hits      func(*http.Request) int64
	extra     func(*http.Request) []policy.Entry
	logger    *zap.Logger
}

// WithIdentity sets how the caller is identified from verified claims. The
// default treats every caller as anonymous.
func WithIdentity(f func(*http.Request) Identity) Option { return func(o *options) { o.identify = f } }

// WithRoute sets the route class of a request, e.g. "GET /catalog". The
// default (DefaultRoute) is the method and the URL path; give a template
// function when paths carry ids, or every id becomes its own counter.
func WithRoute(f func(*http.Request) string) Option { return func(o *options) { o.route = f } }

// WithClientIP sets how the client address is found. The default is the
// host of the connection's remote address; behind a proxy chain you
// control, take the address your own edge appended, never the client's.
func WithClientIP(f func(*http.Request) string) Option { return func(o *options) { o.clientIP = f } }

// WithRequestID sets the idempotency key of a request; the default is none.
// A request repeating a key within the engine's IdempotencyTTL gets the
// first admission back: its handler runs uncharged and holds no concurrency
// slot. So the key must be one your server vouches for (an Idempotency-Key
// your idempotency layer answers repeats of, an id your own edge assigns),
// never a bare client header: a client repeating one key would run the
// handler without limit.
func WithRequestID(f func(*http.Request) string) Option { return func(o *options) { o.requestID = f } }

// WithHits sets how many hits a request counts for (e.g. a batch size); the
// default is 1.
func WithHits(f func(*http.Request) int64) Option { return func(o *options) { o.hits = f } }

// WithDescriptors adds descriptor entries (e.g. a plan from the claims).
func WithDescriptors(f func(*http.Request) []policy.Entry) Option {
	return func(o *options) { o.extra = f }
}

// WithLogger sets the logger; the default discards everything.
func WithLogger(l *zap.Logger) Option { return func(o *options) { o.logger = l } }

// New returns the middleware deciding with d.
func New(d Decider, cfg Config, opts ...Option) (func(http.Handler) http.Handler, error) {
	if d == nil {
		return nil, errors.New("httpmw: nil decider")
	}
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	o := options{
		identify: func(*http.Request) Identity { return Identity{} },
		route:    DefaultRoute,
		clientIP: remoteHost,
		logger:   zap.NewNop(),
	}
	for _, opt := range opts {
		opt(&o)
	}
	m := &middleware{d: d, cfg: cfg, o: o, log: o.logger.Named("httpmw")}
	m.into, _ = d.(intoDecider)
	m.pool.New = func() any { return new(admission.Decision) }
	return m.wrap, nil
}

// maxRoute bounds DefaultRoute's labels below admission.MaxValueLen.
const maxRoute = 200

// DefaultRoute is the route class WithRoute defaults to: the method and the
// URL path, e.g. "GET /catalog". HEAD counts as GET (net/http serves HEAD
// with GET handlers, so GET's limits must apply). A path the engine would
// refuse as a value (admission.ValidValue) is taken in its escaped form, and one too long for a
// descriptor is cut, with a hash of the whole path appended, so a client's
// odd path never turns into a 400 from the limiter.
func DefaultRoute(r *http.Request) string {
	method := r.Method
	if method == http.MethodHead {
		method = http.MethodGet
	}
	path := r.URL.Path
	if !admission.ValidValue(path) {
		path = r.URL.EscapedPath()
	}
	label := method + " " + path
	if len(label) <= maxRoute {
		return label
	}
	h := fnv.New64a()
	h.Write([]byte(label))
	cut := maxRoute - 17
	for cut > 0 && !utf8.RuneStart(label[cut]) {
		cut--
	}
	return label[:cut] + "#" + strconv.FormatUint(h.Sum64()|1<<63, 16)
}

func remoteHost(r *http.Request) string {
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return r.RemoteAddr
	}
	return host
}

type middleware struct {
	d    Decider
	into intoDecider // d, when it can decide into a pooled Decision
	pool sync.Pool   // of *admission.Decision, when into is set
	cfg  Config
	o    options
	log  *zap.Logger
	// lastNoTenant is when a tenantless identity was last logged (unix
	// ns), so a broken identity function logs once a minute, not per request.
	lastNoTenant atomic.Int64
}

func (m *middleware) wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id := m.o.identify(r)
		req := m.request(r, id)
		d, err := m.decide(r.Context(), req)
		if err != nil {
			m.fail(w, err, req)
			return
		}
		defer m.recycle(d) // runs last: after the handler and the slots' release
		if id.Authenticated && m.cfg.AdvertiseLimits {
			advertise(w.Header(), d)
		}
		switch d.Outcome {
		case admission.Allow:
			if d.HasSlots() {
				defer m.release(r.Context(), d)
			}
			next.ServeHTTP(w, r)
		case admission.Deny:
			reject(w, http.StatusTooManyRequests, d.RetryAfter, body{Error: "rate_limited", Scope: string(d.Scope), DecisionID: d.ID})
		default:
			reject(w, http.StatusServiceUnavailable, d.RetryAfter, body{Error: "limiter_unavailable", DecisionID: d.ID})
		}
	})
}

// decide asks the decider, into a pooled Decision when it can.
func (m *middleware) decide(ctx context.Context, req *admission.Request) (*admission.Decision, error) {
	if m.into == nil {
		return m.d.Decide(ctx, req)
	}
	d := m.pool.Get().(*admission.Decision)
	if err := m.into.DecideInto(ctx, req, d); err != nil {
		m.pool.Put(d)
		return nil, err
	}
	return d, nil
}

// recycle returns a pooled decision once nothing refers to it.
func (m *middleware) recycle(d *admission.Decision) {
	if m.into != nil {
		m.pool.Put(d)
	}
}

func (m *middleware) request(r *http.Request, id Identity) *admission.Request {
	entries := make([]policy.Entry, 0, 6)
	if ip := m.o.clientIP(r); ip != "" {
		entries = append(entries, policy.Entry{Key: "ip", Value: ip})
	}
	if id.Authenticated && id.Tenant == "" {
		m.noTenant()
		id = Identity{}
	}
	if id.Authenticated {
		entries = append(entries, policy.Entry{Key: "auth", Value: "token"}, policy.Entry{Key: "tenant", Value: id.Tenant})
		if id.User != "" {
			entries = append(entries, policy.Entry{Key: "user", Value: id.User})
		}
	} else {
		entries = append(entries, policy.Entry{Key: "auth", Value: "anonymous"})
	}
	entries = append(entries, policy.Entry{Key: "route", Value: m.o.route(r)})
	if m.o.extra != nil {
		entries = append(entries, m.o.extra(r)...)
	}
	req := &admission.Request{Descriptors: entries}
	if m.o.requestID != nil {
		req.RequestID = m.o.requestID(r)
	}
	if m.o.hits != nil {
		req.Hits = m.o.hits(r)
	}
	return req
}

// noTenant logs, at most once a minute, that the identity function returned
// an authenticated caller without a tenant.
func (m *middleware) noTenant() {
	now := time.Now().UnixNano()
	last := m.lastNoTenant.Load()
	if now-last < int64(time.Minute) || !m.lastNoTenant.CompareAndSwap(last, now) {
		return
	}
	m.log.Error("identity: an authenticated caller without a tenant; limited as anonymous (by address) until the identity function sets the tenant")
}

func (m *middleware) release(ctx context.Context, d *admission.Decision) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), m.cfg.ReleaseTimeout)
	defer cancel()
	if err := m.d.Release(ctx, d); err != nil {
		m.log.Warn("release failed; the slots expire by their TTL", zap.String("decision", d.ID), zap.Error(err))
	}
}

// fail answers a request the engine refused to decide. The client's own
// input (its path, hits, request id) is a 400 naming the field; a
// descriptor no rule uses can only come from the gateway (the standard keys
// are always known), so it is a 500 and logged. A cost beyond a rule's
// capacity is a 400 that names no rule or limit: the details, which would
// tell an anonymous caller the plan, go to the log. Any other descriptor the
// engine refuses (too long, unprintable, given twice) was built by the
// gateway too: the address, the identity function's tenant and user (from
// verified credentials), the route function's label, WithDescriptors'
// entries. The client cannot correct it, and the descriptor index the
// engine names is internal: a 500, logged with the descriptor's key.
func (m *middleware) fail(w http.ResponseWriter, err error, req *admission.Request) {
	var de *admission.DescriptorError
	switch {
	case errors.Is(err, admission.ErrUnknownDescriptor):
		m.log.Error("a descriptor the gateway adds is used by no rule", zap.Error(err))
		reject(w, http.StatusInternalServerError, 0, body{Error: "limiter_misconfigured"})
		return
	case errors.As(err, &de):
		var key string
		var size int
		if de.Index >= 0 && de.Index < len(req.Descriptors) {
			key, size = req.Descriptors[de.Index].Key, len(req.Descriptors[de.Index].Value)
		}
		m.log.Error("a descriptor the gateway built is refused by the engine (printable UTF-8, at most admission.MaxValueLen bytes, each key once)",
			zap.String("key", key), zap.Int("value_bytes", size), zap.Error(err))
		reject(w, http.StatusInternalServerError, 0, body{Error: "limiter_misconfigured"})
		return
	case errors.Is(err, admission.ErrBadCost):
		m.log.Debug("bad request", zap.Error(err))
		reject(w, http.StatusBadRequest, 0, body{Error: "bad_request", Message: "hits: more than this request's limits admit"})
		return
	case errors.Is(err, admission.ErrInvalidRequest):
		m.log.Debug("bad request", zap.Error(err))
		reject(w, http.StatusBadRequest, 0, body{Error: "bad_request", Message: err.Error()})
		return
	}
	m.log.Error("admission failed", zap.Error(err))
	reject(w, http.StatusServiceUnavailable, 1, body{Error: "limiter_unavailable"})
}

// body is the JSON of a refusal: the scope and decision id, for support;
// never counters.
type body struct {
	Error      string `json:"error"`
	Scope      string `json:"scope,omitempty"`
	DecisionID string `json:"decisionId,omitempty"`
	Message    string `json:"message,omitempty"`
}

func reject(w http.ResponseWriter, status int, retryAfter int64, b body) {
	h := w.Header()
	if retryAfter > 0 {
		h.Set("Retry-After", strconv.FormatInt(retryAfter, 10))
	}
	h.Set("Content-Type", "application/json")
	h.Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(b)
}

// advertise sets RateLimit-Policy and RateLimit for the decision's
// advertised rules (the caller's own tenant, user and route limits).
func advertise(h http.Header, d *admission.Decision) {
	var pol, lim []string
	for _, r := range d.Rules {
		if r.Quota <= 0 || r.Shadow {
			continue
		}
		name := sfString(r.Rule)
		p := name + ";q=" + sfInt(r.Quota)
		if r.Window > 0 {
			p += ";w=" + sfInt(r.Window)
		}
		pol = append(pol, p)
		if r.Remaining >= 0 {
			l := name + ";r=" + sfInt(r.Remaining)
			if r.Window > 0 { // a rule that never refills has no reset time
				l += ";t=" + sfInt(r.Reset)
			}
			lim = append(lim, l)
		}
	}
	if len(pol) > 0 {
		h.Set("RateLimit-Policy", strings.Join(pol, ", "))
	}
	if len(lim) > 0 {
		h.Set("RateLimit", strings.Join(lim, ", "))
	}
}

// sfMaxInt is the largest structured-field Integer (15 digits, RFC 9651).
const sfMaxInt = 999_999_999_999_999

// sfInt encodes n as a structured-field Integer, clamped to its range (a
// bucket refilling over years has a window of more than 15 digits).
func sfInt(n int64) string { return strconv.FormatInt(min(max(n, -sfMaxInt), sfMaxInt), 10) }

// sfString encodes s as a structured-field String (RFC 9651): quoted, with
// backslash and quote escaped. Rule names are [a-z0-9._-], so this is
// defensive.
func sfString(s string) string {
	var b strings.Builder
	b.WriteByte('"')
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c < 0x20 || c > 0x7e {
			continue
		}
		if c == '"' || c == '\\' {
			b.WriteByte('\\')
		}
		b.WriteByte(c)
	}
	b.WriteByte('"')
	return b.String()
}
