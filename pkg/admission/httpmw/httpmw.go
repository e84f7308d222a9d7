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
package httpmw

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

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
// default is the method and the URL path; give a template function when paths
// carry ids, or every id becomes its own counter.
func WithRoute(f func(*http.Request) string) Option { return func(o *options) { o.route = f } }

// WithClientIP sets how the client address is found. The default is the
// host of the connection's remote address; behind a proxy chain you
// control, take the address your own edge appended, never the client's.
func WithClientIP(f func(*http.Request) string) Option { return func(o *options) { o.clientIP = f } }

// WithRequestID sets the idempotency key of a request (e.g. a verified
// Idempotency-Key); the default is none.
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
		route:    func(r *http.Request) string { return r.Method + " " + r.URL.Path },
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
}

func (m *middleware) wrap(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		id := m.o.identify(r)
		req := m.request(r, id)
		d, err := m.decide(r.Context(), req)
		if err != nil {
			m.fail(w, err)
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
	if id.Authenticated {
		entries = append(entries, policy.Entry{Key: "auth", Value: "token"})
		if id.Tenant != "" {
			entries = append(entries, policy.Entry{Key: "tenant", Value: id.Tenant})
		}
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

func (m *middleware) release(ctx context.Context, d *admission.Decision) {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), m.cfg.ReleaseTimeout)
	defer cancel()
	if err := m.d.Release(ctx, d); err != nil {
		m.log.Warn("release failed; the slots expire by their TTL", zap.String("decision", d.ID), zap.Error(err))
	}
}

// fail answers a request the engine refused to decide.
func (m *middleware) fail(w http.ResponseWriter, err error) {
	if errors.Is(err, admission.ErrInvalidRequest) {
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
		p := name + ";q=" + strconv.FormatInt(r.Quota, 10)
		if r.Window > 0 {
			p += ";w=" + strconv.FormatInt(r.Window, 10)
		}
		pol = append(pol, p)
		if r.Remaining >= 0 {
			lim = append(lim, name+";r="+strconv.FormatInt(r.Remaining, 10)+";t="+strconv.FormatInt(r.Reset, 10))
		}
	}
	if len(pol) > 0 {
		h.Set("RateLimit-Policy", strings.Join(pol, ", "))
	}
	if len(lim) > 0 {
		h.Set("RateLimit", strings.Join(lim, ", "))
	}
}

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
