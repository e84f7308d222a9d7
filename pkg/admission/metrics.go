package admission

import (
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
)

// Stats are the engine's counters since New.
type Stats struct {
	// Decisions counts Decide calls that returned a decision.
	Decisions uint64
	// Allowed, Denied and Unavailable count decisions by outcome.
	Allowed, Denied, Unavailable uint64
	// NegativeCacheHits counts denials answered without a store call.
	NegativeCacheHits uint64
	// Replays counts retries answered from an idempotency record.
	Replays uint64
	// StoreCalls counts store calls; StoreErrors the failed ones, and
	// StoreCanceled those the caller left (its context canceled) before the
	// store answered, which are not errors and engage no fail mode.
	StoreCalls, StoreErrors, StoreCanceled uint64
	// FailOpen, FailClosed and Fallback count rules decided by each fail mode.
	FailOpen, FailClosed, Fallback uint64
	// BreakerOpens counts how often a circuit breaker opened (the breaker
	// of any shard of the store: on Redis Cluster each master has its own).
	BreakerOpens uint64
	// LocalSpends and LocalTakes count spends from gateway-local chunks and
	// the store calls that refilled them.
	LocalSpends, LocalTakes uint64
	// RefundErrors counts compensations that could not be made.
	RefundErrors uint64
}

type counters struct {
	decisions, allowed, denied, unavailable atomic.Uint64
	negHits, replays                        atomic.Uint64
	storeCalls, storeErrors, storeCanceled  atomic.Uint64
	failOpen, failClosed, fallback          atomic.Uint64
	localSpends, localTakes                 atomic.Uint64
	refundErrors                            atomic.Uint64
}

// Stats returns a snapshot of the counters.
func (e *Engine) Stats() Stats {
	m := &e.m
	return Stats{
		Decisions:         m.decisions.Load(),
		Allowed:           m.allowed.Load(),
		Denied:            m.denied.Load(),
		Unavailable:       m.unavailable.Load(),
		NegativeCacheHits: m.negHits.Load(),
		Replays:           m.replays.Load(),
		StoreCalls:        m.storeCalls.Load(),
		StoreErrors:       m.storeErrors.Load(),
		StoreCanceled:     m.storeCanceled.Load(),
		FailOpen:          m.failOpen.Load(),
		FailClosed:        m.failClosed.Load(),
		Fallback:          m.fallback.Load(),
		BreakerOpens:      e.breakerOpens(),
		LocalSpends:       m.localSpends.Load(),
		LocalTakes:        m.localTakes.Load(),
		RefundErrors:      m.refundErrors.Load(),
	}
}

// BreakerOpen reports whether a circuit breaker currently refuses store
// calls: on Redis Cluster, the breaker of any master (the calls of the
// others go on); on any other store, the one breaker.
func (e *Engine) BreakerOpen() bool {
	now := e.mono(e.clock.Now())
	for i := range e.brks {
		if e.brks[i].isOpen(now) {
			return true
		}
	}
	return false
}

// breakerOpens sums the openings of every shard's breaker.
func (e *Engine) breakerOpens() uint64 {
	var n uint64
	for i := range e.brks {
		n += e.brks[i].opens.Load()
	}
	return n
}

// collector exports Stats as Prometheus metrics; it reads the counters at
// scrape time, so the decision path pays nothing for metrics.
type collector struct{ e *Engine }

var (
	descDecisions = prometheus.NewDesc("allot_admission_decisions_total", "Decisions by outcome.", []string{"outcome"}, nil)
	descNeg       = prometheus.NewDesc("allot_admission_negative_cache_hits_total", "Denials answered from the negative cache.", nil, nil)
	descReplays   = prometheus.NewDesc("allot_admission_replays_total", "Retries answered from an idempotency record.", nil, nil)
	descStore     = prometheus.NewDesc("allot_admission_store_calls_total", "Store calls by result.", []string{"result"}, nil)
	descFail      = prometheus.NewDesc("allot_admission_fail_mode_total", "Rules decided by a fail mode.", []string{"mode"}, nil)
	descBreaker   = prometheus.NewDesc("allot_admission_breaker_opens_total", "Times a circuit breaker opened (on Redis Cluster, the breaker of any master).", nil, nil)
	descBrkOpen   = prometheus.NewDesc("allot_admission_breaker_open", "1 while a circuit breaker refuses store calls (on Redis Cluster, the breaker of any master: the others' calls go on).", nil, nil)
	descLocal     = prometheus.NewDesc("allot_admission_local_spends_total", "Spends from gateway-local chunks.", nil, nil)
	descTakes     = prometheus.NewDesc("allot_admission_local_takes_total", "Store calls that refilled gateway-local chunks.", nil, nil)
	descRefund    = prometheus.NewDesc("allot_admission_refund_errors_total", "Compensations that could not be made.", nil, nil)
)

// Describe implements prometheus.Collector.
func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descDecisions, descNeg, descReplays, descStore, descFail, descBreaker, descBrkOpen, descLocal, descTakes, descRefund} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c *collector) Collect(ch chan<- prometheus.Metric) {
	s := c.e.Stats()
	counter := func(d *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	counter(descDecisions, s.Allowed, "allow")
	counter(descDecisions, s.Denied, "deny")
	counter(descDecisions, s.Unavailable, "unavailable")
	counter(descNeg, s.NegativeCacheHits)
	counter(descReplays, s.Replays)
	// The counters are read one by one while calls finish: never let a call
	// counted as failed but not yet as made wrap the difference around.
	ok := s.StoreCalls - min(s.StoreCalls, s.StoreErrors+s.StoreCanceled)
	counter(descStore, ok, "ok")
	counter(descStore, s.StoreErrors, "error")
	counter(descStore, s.StoreCanceled, "canceled")
	counter(descFail, s.FailOpen, "open")
	counter(descFail, s.FailClosed, "closed")
	counter(descFail, s.Fallback, "fallback")
	counter(descBreaker, s.BreakerOpens)
	open := 0.0
	if c.e.BreakerOpen() {
		open = 1
	}
	ch <- prometheus.MustNewConstMetric(descBrkOpen, prometheus.GaugeValue, open)
	counter(descLocal, s.LocalSpends)
	counter(descTakes, s.LocalTakes)
	counter(descRefund, s.RefundErrors)
}

var _ prometheus.Collector = (*collector)(nil)
