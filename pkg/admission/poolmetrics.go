package admission

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/redis/go-redis/v9"
)

// Descriptions of the Redis connection pool metrics (RedisPoolCollector).
// Label pool: main (single commands) or pipeline (go-redis's dedicated
// pipeline pool, which the store's batched decisions use; a burst wider than
// it spills to main).
var (
	descPoolConns = prometheus.NewDesc("allot_redis_pool_connections",
		"Connections of the Redis client's pools (summed over a cluster's nodes), by pool and state: total (open) and idle.", []string{"pool", "state"}, nil)
	descPoolHits = prometheus.NewDesc("allot_redis_pool_hits_total",
		"Times a call found an idle connection in the Redis client's pool.", []string{"pool"}, nil)
	descPoolMisses = prometheus.NewDesc("allot_redis_pool_misses_total",
		"Times a call found no idle connection and dialed or waited for one.", []string{"pool"}, nil)
	descPoolTimeouts = prometheus.NewDesc("allot_redis_pool_timeouts_total",
		"Times a call gave up waiting for a pooled connection (the pool is too small for the load, or Redis is slow): those calls failed without reaching Redis.", []string{"pool"}, nil)
	descPoolStale = prometheus.NewDesc("allot_redis_pool_stale_connections_total",
		"Connections the pool closed as stale or unusable.", []string{"pool"}, nil)
	descPoolWait = prometheus.NewDesc("allot_redis_pool_wait_seconds_total",
		"Time calls spent waiting for a pooled connection.", []string{"pool"}, nil)
)

// RedisPoolCollector exports a go-redis client's connection pool statistics
// (PoolStats, read at scrape time; a cluster client's are summed over its
// nodes). Register it next to the engine's metrics: a pool that times out
// fails decisions into their fail modes before they reach Redis, which
// the store's own metrics cannot tell from a slow Redis. go-redis keeps
// these counts in 32 bits; a wrap reads as a counter reset.
func RedisPoolCollector(client redis.UniversalClient) prometheus.Collector {
	return poolCollector{client}
}

type poolCollector struct{ c redis.UniversalClient }

// Describe implements prometheus.Collector.
func (p poolCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descPoolConns, descPoolHits, descPoolMisses, descPoolTimeouts, descPoolStale, descPoolWait} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (p poolCollector) Collect(ch chan<- prometheus.Metric) {
	s := p.c.PoolStats()
	if s == nil {
		return
	}
	collectPool(ch, "main", s.TotalConns, s.IdleConns, s.Hits, s.Misses, s.Timeouts, s.StaleConns+s.Unusable, s.WaitDurationNs)
	if ps := s.PipelineStats; ps != nil {
		collectPool(ch, "pipeline", ps.TotalConns, ps.IdleConns, ps.Hits, ps.Misses, ps.Timeouts, ps.StaleConns+ps.Unusable, ps.WaitDurationNs)
	}
}

func collectPool(ch chan<- prometheus.Metric, pool string, total, idle, hits, misses, timeouts, stale uint32, waitNs int64) {
	ch <- prometheus.MustNewConstMetric(descPoolConns, prometheus.GaugeValue, float64(total), pool, "total")
	ch <- prometheus.MustNewConstMetric(descPoolConns, prometheus.GaugeValue, float64(idle), pool, "idle")
	ch <- prometheus.MustNewConstMetric(descPoolHits, prometheus.CounterValue, float64(hits), pool)
	ch <- prometheus.MustNewConstMetric(descPoolMisses, prometheus.CounterValue, float64(misses), pool)
	ch <- prometheus.MustNewConstMetric(descPoolTimeouts, prometheus.CounterValue, float64(timeouts), pool)
	ch <- prometheus.MustNewConstMetric(descPoolStale, prometheus.CounterValue, float64(stale), pool)
	ch <- prometheus.MustNewConstMetric(descPoolWait, prometheus.CounterValue, float64(waitNs)/1e9, pool)
}
