package agent

import (
	"sync"

	"connectrpc.com/connect"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/allot-dev/allot/internal/pausewatch"
)

// metrics are the agent's Prometheus metrics. Per-quota lease figures are
// read from the lease manager at scrape time (leaseCollector), so the
// renewal path pays nothing for them.
type metrics struct {
	decisions    *prometheus.CounterVec   // rule, verdict
	latency      *prometheus.HistogramVec // api
	badRequests  *prometheus.CounterVec   // api, code
	failMode     *prometheus.CounterVec   // rule, mode
	starveWaits  *prometheus.CounterVec   // result
	storeErrors  *prometheus.CounterVec   // op, kind
	policyVer    prometheus.Gauge
	policyUpd    *prometheus.CounterVec // result
	renewal      prometheus.Histogram
	renewFail    *prometheus.CounterVec // reason
	acquireCalls prometheus.Counter
	acquireWants prometheus.Counter
	acquireToks  prometheus.Counter
	poolReads    prometheus.Counter
	cutOff       prometheus.Gauge
	fallbackDep  *prometheus.CounterVec // quota
	fallbackHeld *prometheus.CounterVec // reason
	clockOffset  prometheus.Gauge
	pauses       prometheus.Histogram
}

// The label values the agent's counters take, each a bounded, known set:
// newMetrics creates their series at zero, so that a counter's first event
// is an increase from 0 (increase() and rate() see it) rather than the birth
// of a series at 1, which they do not. Labels without a known set (rule,
// quota: per-tenant rules make them unbounded) get series as events name
// them.
var (
	policyUpdateResults = []string{"applied", "older", "malformed", "invalid", "persist_error", "diverged"}
	renewFailReasons    = []string{"unreachable", "refused", "malformed", "deposit", "deposit_unknown", "too_late"}
	starveWaitResults   = []string{"served", "timeout", "exhausted", "cut_off", "refused"}
	storeErrorOps       = []string{"stats", "deposit", "exhaust", "withdraw"}
	storeErrorKinds     = []string{"timeout", "error"}
	fallbackHeldReasons = []string{withheldUnmeasured, withheldWindowStart}
	// badRequestAPIs and badRequestCodes: every API that counts bad requests,
	// and every code codeOf returns.
	badRequestAPIs  = []string{"connect", "grpc", "envoy", "connect-batch", "grpc-batch"}
	badRequestCodes = []connect.Code{connect.CodeInvalidArgument, connect.CodeDeadlineExceeded, connect.CodeCanceled,
		connect.CodeUnavailable, connect.CodeInternal}
)

func newMetrics() *metrics {
	m := &metrics{
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "allot_agent_decisions_total",
			Help: "Decisions by rule (the denying rule, or the tightest when allowed; none when no rule matched) and verdict (allow, deny, unavailable).",
		}, []string{"rule", "verdict"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "allot_agent_admission_duration_seconds",
			Help:    "Time to answer one Check (connect: the Connect API; grpc: the same over the gRPC listener; connect-batch and grpc-batch: one check of a CheckBatch) or ShouldRateLimit (envoy), starve waits included.",
			Buckets: []float64{.0001, .00025, .0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1},
		}, []string{"api"}),
		badRequests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "allot_agent_bad_requests_total",
			Help: "Requests refused before a decision, by API and code.",
		}, []string{"api", "code"}),
		failMode: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "allot_agent_fail_mode_total",
			Help: "Rules decided by their fail mode (the store could not answer), by rule and mode; cut_off counts leased pools answered unavailable because the allocator was unreachable, refused those answered unavailable while quarantined after the allocator refused them, because the policy does not lease them to this agent's region, or because their template has as many active instances as it may.",
		}, []string{"rule", "mode"}),
		starveWaits: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "allot_agent_starve_waits_total",
			Help: "Requests denied only for lack of leased tokens that waited for a renewal, by result (served, timeout, exhausted, cut_off, refused).",
		}, []string{"result"}),
		storeErrors: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "allot_agent_store_errors_total",
			Help: "Failed store calls of the lease manager, by operation (stats, deposit, exhaust, withdraw) and kind (timeout, error).",
		}, []string{"op", "kind"}),
		policyVer: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "allot_agent_policy_version",
			Help: "Version of the policy in force (0: a local bootstrap policy).",
		}),
		policyUpd: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "allot_agent_policy_updates_total",
			Help: "Policy records received, by result (applied, older, malformed, invalid, persist_error; diverged: the allocator's history differed from the version in force, and its record replaced it).",
		}, []string{"result"}),
		renewal: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "allot_agent_renewal_duration_seconds",
			Help:    "Latency of one Acquire call to the allocator (failover and retries included).",
			Buckets: []float64{.001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5},
		}),
		renewFail: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "allot_agent_renewal_failures_total",
			Help: "Failed renewals, by reason (unreachable, refused, malformed, deposit, deposit_unknown, too_late).",
		}, []string{"reason"}),
		acquireCalls: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "allot_agent_acquire_calls_total",
			Help: "Acquire calls sent to the allocator (a retry with the same request id counts again).",
		}),
		acquireWants: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "allot_agent_acquire_wants_total",
			Help: "Quotas asked for in Acquire calls.",
		}),
		acquireToks: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "allot_agent_acquire_tokens_total",
			Help: "Tokens granted by Acquire calls.",
		}),
		poolReads: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "allot_agent_pool_reads_total",
			Help: "Reads of leased pools in the regional store (demand measurement).",
		}),
		cutOff: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "allot_agent_allocator_cut_off",
			Help: "1 while the last Acquire failed: held tokens (and fallback allowances) only.",
		}),
		fallbackDep: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "allot_agent_fallback_deposits_total",
			Help: "Fallback allowances deposited while cut off from the allocator, by quota.",
		}, []string{"quota"}),
		fallbackHeld: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "allot_agent_fallback_withheld_total",
			Help: "Fallback allowances due while cut off from the allocator that were not deposited, by reason: unmeasured (this process never measured the allocator leader's clock: no answer since it started), window_start (the window may not have begun by the leader's clock, within the estimate's error). Counted per pool look.",
		}, []string{"reason"}),
		clockOffset: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "allot_agent_leader_clock_offset_seconds",
			Help: "The allocator leader's wall clock minus this agent's, as measured by the last fresh Acquire answer (the leader's stamp against the middle of the call). 0 until the first answer.",
		}),
		pauses: pausewatch.NewHistogram("allot_agent_process_pause_seconds"),
	}
	m.zero()
	return m
}

// zero creates the series of every known label value at zero.
func (m *metrics) zero() {
	for _, r := range policyUpdateResults {
		m.policyUpd.WithLabelValues(r)
	}
	for _, r := range renewFailReasons {
		m.renewFail.WithLabelValues(r)
	}
	for _, r := range fallbackHeldReasons {
		m.fallbackHeld.WithLabelValues(r)
	}
	for _, r := range starveWaitResults {
		m.starveWaits.WithLabelValues(r)
	}
	for _, op := range storeErrorOps {
		for _, k := range storeErrorKinds {
			m.storeErrors.WithLabelValues(op, k)
		}
	}
	for _, api := range badRequestAPIs {
		for _, c := range badRequestCodes {
			m.badRequests.WithLabelValues(api, c.String())
		}
	}
}

func (m *metrics) register(r prometheus.Registerer, l *leases) error {
	for _, c := range []prometheus.Collector{
		m.decisions, m.latency, m.badRequests, m.failMode, m.starveWaits, m.storeErrors, m.policyVer, m.policyUpd,
		m.renewal, m.renewFail, m.acquireCalls, m.acquireWants, m.acquireToks, m.poolReads, m.cutOff, m.fallbackDep,
		m.fallbackHeld, m.clockOffset, m.pauses,
		&leaseCollector{l: l},
	} {
		if err := r.Register(c); err != nil {
			return err
		}
	}
	return nil
}

var (
	descHeld = prometheus.NewDesc("allot_agent_lease_tokens_held",
		"Unexpired, unspent leased tokens in the regional store at the last look.", []string{"quota"}, nil)
	descConsumed = prometheus.NewDesc("allot_agent_lease_tokens_consumed_total",
		"Leased tokens spent from the regional pool (by every gateway of the region).", []string{"quota"}, nil)
	descExpired = prometheus.NewDesc("allot_agent_lease_tokens_expired_total",
		"Leased tokens that expired unspent in the regional store: stranded capacity.", []string{"quota"}, nil)
	descStarved = prometheus.NewDesc("allot_agent_lease_starved_total",
		"Requests the regional pool could not serve for lack of leased tokens.", []string{"quota"}, nil)
	descGranted = prometheus.NewDesc("allot_agent_lease_tokens_granted_total",
		"Tokens granted to this agent by the allocator.", []string{"quota"}, nil)
	descReleased = prometheus.NewDesc("allot_agent_lease_tokens_released_total",
		"Tokens handed back to the allocator (unusable grants, shutdown).", []string{"quota"}, nil)
	descDemand = prometheus.NewDesc("allot_agent_lease_demand_tokens_per_second",
		"Measured demand: consumption plus requests starved for lack of tokens, by cost.", []string{"quota"}, nil)
	descExhausted = prometheus.NewDesc("allot_agent_lease_exhausted",
		"1 while the allocator says the quota's global pool is exhausted for the window (for a template: how many of its instances are).", []string{"quota"}, nil)
	descInstances = prometheus.NewDesc("allot_agent_lease_instances",
		"Active instances of a quota template (pools of tenants with recent requests).", []string{"quota"}, nil)
)

// leaseCollector exports the lease manager's per-quota state at scrape time.
// The instances of a template are summed under the template's name: one
// series per rule, however many tenants are active. Those sums cover the
// active instances only, so they drop (a counter reset, to Prometheus) when
// idle instances are forgotten.
type leaseCollector struct{ l *leases }

// Describe implements prometheus.Collector.
func (c *leaseCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descHeld, descConsumed, descExpired, descStarved, descGranted, descReleased, descDemand, descExhausted, descInstances} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *leaseCollector) Collect(ch chan<- prometheus.Metric) {
	type sums struct {
		held, consumed, expired, starved, granted, released, demand, exhausted, instances float64
	}
	var order []string
	by := map[string]*sums{}
	tmpl := map[string]bool{}
	for _, s := range c.l.Status() {
		name := s.Quota
		if s.Template != "" {
			name, tmpl[s.Template] = s.Template, true
		}
		a := by[name]
		if a == nil {
			a = &sums{}
			by[name] = a
			order = append(order, name)
		}
		a.held += float64(s.Held)
		a.consumed += float64(s.Consumed)
		a.expired += float64(s.Expired)
		a.starved += float64(s.Starved)
		a.granted += float64(s.Granted)
		a.released += float64(s.Released)
		a.demand += s.Demand
		a.instances++
		if s.Exhausted {
			a.exhausted++
		}
	}
	for _, name := range order {
		a := by[name]
		g := func(d *prometheus.Desc, t prometheus.ValueType, v float64) {
			ch <- prometheus.MustNewConstMetric(d, t, v, name)
		}
		g(descHeld, prometheus.GaugeValue, a.held)
		g(descConsumed, prometheus.CounterValue, a.consumed)
		g(descExpired, prometheus.CounterValue, a.expired)
		g(descStarved, prometheus.CounterValue, a.starved)
		g(descGranted, prometheus.CounterValue, a.granted)
		g(descReleased, prometheus.CounterValue, a.released)
		g(descDemand, prometheus.GaugeValue, a.demand)
		g(descExhausted, prometheus.GaugeValue, a.exhausted)
		if tmpl[name] {
			g(descInstances, prometheus.GaugeValue, a.instances)
		}
	}
}

var _ prometheus.Collector = (*leaseCollector)(nil)

// engineRegisterer is the registerer the agent gives its admission engines
// (admission.WithRegisterer). The first engine's collector is registered
// with the agent's registry behind a forwarding collector; an engine that
// replaces it (a policy adopted from an allocator whose history differs,
// see Agent.adoptRecord) takes its place there instead of registering the
// same metrics twice, which the registry would refuse. Its counters start
// again from 0: a counter reset to Prometheus.
type engineRegisterer struct {
	reg prometheus.Registerer

	mu  sync.Mutex
	cur prometheus.Collector // the engine in force's; nil before the first
}

// Register implements prometheus.Registerer.
func (r *engineRegisterer) Register(c prometheus.Collector) error {
	r.mu.Lock()
	first := r.cur == nil
	r.cur = c
	r.mu.Unlock()
	if !first {
		return nil
	}
	// Unlocked: the registry describes the forwarder, which reads cur.
	if err := r.reg.Register(&engineCollector{r: r}); err != nil {
		r.mu.Lock()
		r.cur = nil
		r.mu.Unlock()
		return err
	}
	return nil
}

// MustRegister implements prometheus.Registerer.
func (r *engineRegisterer) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil {
			panic(err)
		}
	}
}

// Unregister implements prometheus.Registerer: an engine's collector stays
// registered until another replaces it.
func (r *engineRegisterer) Unregister(prometheus.Collector) bool { return false }

// current returns the collector of the engine in force.
func (r *engineRegisterer) current() prometheus.Collector {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.cur
}

// engineCollector forwards to the collector of the engine in force.
type engineCollector struct{ r *engineRegisterer }

// Describe implements prometheus.Collector.
func (c *engineCollector) Describe(ch chan<- *prometheus.Desc) {
	if cur := c.r.current(); cur != nil {
		cur.Describe(ch)
	}
}

// Collect implements prometheus.Collector.
func (c *engineCollector) Collect(ch chan<- prometheus.Metric) {
	if cur := c.r.current(); cur != nil {
		cur.Collect(ch)
	}
}

var (
	_ prometheus.Registerer = (*engineRegisterer)(nil)
	_ prometheus.Collector  = (*engineCollector)(nil)
)
