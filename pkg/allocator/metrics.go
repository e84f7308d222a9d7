package allocator

import (
	"sync"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/allot-dev/allot/internal/pausewatch"
)

// Metrics are the allocator's Prometheus metrics. They register on the
// registry given to NewMetrics, never on a global one.
type Metrics struct {
	// Grants counts grants made (tokens > 0).
	Grants prometheus.Counter
	// TokensGranted counts tokens granted.
	TokensGranted prometheus.Counter
	// PoolExhausted counts wants answered with pool_exhausted.
	PoolExhausted prometheus.Counter
	// TokensReleased counts tokens handed back.
	TokensReleased prometheus.Counter
	// Requests counts API calls by method and Connect code ("ok" on success).
	Requests *prometheus.CounterVec
	// Forwarded counts calls a follower forwarded to the leader.
	Forwarded prometheus.Counter
	// ApplyLatency observes propose-to-apply latency on the leader.
	ApplyLatency prometheus.Histogram
	// LeaderChanges counts leader changes this node observed.
	LeaderChanges prometheus.Counter
	// WatchStreams is the number of WatchPolicy streams this node serves
	// (Config.MaxWatchStreams caps it).
	WatchStreams prometheus.Gauge
	// Pauses are the stretches in which this process did not run (Run
	// watches for them; see internal/pausewatch).
	Pauses prometheus.Histogram

	mu   sync.Mutex
	node *Node
}

// NewMetrics creates the metrics and registers them on reg (nil: unregistered).
func NewMetrics(reg prometheus.Registerer) *Metrics {
	m := &Metrics{
		Grants:         prometheus.NewCounter(prometheus.CounterOpts{Name: "allot_allocator_grants_total", Help: "Grants made (tokens > 0)."}),
		TokensGranted:  prometheus.NewCounter(prometheus.CounterOpts{Name: "allot_allocator_tokens_granted_total", Help: "Tokens granted to regions."}),
		PoolExhausted:  prometheus.NewCounter(prometheus.CounterOpts{Name: "allot_allocator_pool_exhausted_total", Help: "Wants answered with an exhausted pool."}),
		TokensReleased: prometheus.NewCounter(prometheus.CounterOpts{Name: "allot_allocator_tokens_released_total", Help: "Tokens handed back by regions."}),
		Requests:       prometheus.NewCounterVec(prometheus.CounterOpts{Name: "allot_allocator_requests_total", Help: "API calls by method and code."}, []string{"method", "code"}),
		Forwarded:      prometheus.NewCounter(prometheus.CounterOpts{Name: "allot_allocator_forwarded_total", Help: "Calls forwarded by a follower to the leader."}),
		ApplyLatency: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "allot_allocator_apply_seconds", Help: "Propose-to-apply latency on the leader.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 2, 14),
		}),
		LeaderChanges: prometheus.NewCounter(prometheus.CounterOpts{Name: "allot_allocator_leader_changes_total", Help: "Leader changes observed by this node."}),
		WatchStreams:  prometheus.NewGauge(prometheus.GaugeOpts{Name: "allot_allocator_watch_streams", Help: "WatchPolicy streams this node serves."}),
		Pauses:        pausewatch.NewHistogram("allot_allocator_process_pause_seconds"),
	}
	if reg != nil {
		reg.MustRegister(m.Grants, m.TokensGranted, m.PoolExhausted, m.TokensReleased, m.Requests,
			m.Forwarded, m.ApplyLatency, m.LeaderChanges, m.WatchStreams, m.Pauses, (*stateCollector)(m))
	}
	return m
}

func (m *Metrics) registerNode(n *Node) {
	m.mu.Lock()
	m.node = n
	m.mu.Unlock()
}

func (m *Metrics) unregisterNode() {
	m.mu.Lock()
	m.node = nil
	m.mu.Unlock()
}

// stateCollector reads gauges from the node's state at scrape time, so the
// apply path pays nothing for them.
type stateCollector Metrics

var (
	descLeader    = prometheus.NewDesc("allot_allocator_is_leader", "1 when this node is the leader.", nil, nil)
	descApplied   = prometheus.NewDesc("allot_allocator_applied_index", "Last applied Raft index.", nil, nil)
	descPolicy    = prometheus.NewDesc("allot_allocator_policy_version", "Current policy version.", nil, nil)
	descRemaining = prometheus.NewDesc("allot_allocator_pool_remaining", "Tokens remaining in the current window's pool.", []string{"quota"}, nil)
	descQuotas    = prometheus.NewDesc("allot_allocator_quotas", "Global quotas of the current policy (single pools and templates).", nil, nil)
	descInstances = prometheus.NewDesc("allot_allocator_quota_instances", "Instances of quota templates held in memory (one pool per tenant, say).", nil, nil)
)

// maxQuotaSeries caps per-quota series so a huge policy cannot blow up a scrape.
const maxQuotaSeries = 1000

func (c *stateCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- descLeader
	ch <- descApplied
	ch <- descPolicy
	ch <- descRemaining
	ch <- descQuotas
	ch <- descInstances
}

func (c *stateCollector) Collect(ch chan<- prometheus.Metric) {
	c.mu.Lock()
	n := c.node
	c.mu.Unlock()
	if n == nil {
		return
	}
	leader := 0.0
	if n.IsLeader() {
		leader = 1
	}
	ch <- prometheus.MustNewConstMetric(descLeader, prometheus.GaugeValue, leader)
	ch <- prometheus.MustNewConstMetric(descApplied, prometheus.GaugeValue, float64(n.raft.AppliedIndex()))
	ver := uint64(0)
	if p, ok := n.fsm.Policy(); ok {
		ver = p.Version
	}
	ch <- prometheus.MustNewConstMetric(descPolicy, prometheus.GaugeValue, float64(ver))
	quotas := n.fsm.Quotas()
	ch <- prometheus.MustNewConstMetric(descQuotas, prometheus.GaugeValue, float64(len(quotas)))
	ch <- prometheus.MustNewConstMetric(descInstances, prometheus.GaugeValue, float64(n.fsm.Stats().Instances))
	now := n.fsm.Now()
	series := 0
	for _, q := range quotas {
		if q.TemplateKeys > 0 {
			continue // a template's pools are its instances: too many for series
		}
		if series++; series > maxQuotaSeries {
			break
		}
		w := n.fsm.CurrentWindow(q.Name, now)
		ch <- prometheus.MustNewConstMetric(descRemaining, prometheus.GaugeValue, float64(w.Remaining), q.Name)
	}
}
