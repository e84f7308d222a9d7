package admission_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/bench"
)

// BenchmarkNegativeCacheHit is the in-process denial of a recently denied
// key: target < 200 ns and no allocation.
func BenchmarkNegativeCacheHit(b *testing.B) {
	c := admission.NewNegCacheForBench(4096)
	const key = 0x9e3779b97f4a7c15
	c.Put(key, 1<<62, 1<<62)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if _, ok := c.Get(key, 1); !ok {
				b.Fatal("miss")
			}
		}
	})
}

// BenchmarkLocalChunkSpend is the spend of a P-GLOBAL token from the
// gateway-local chunk: target < 200 ns and no allocation.
func BenchmarkLocalChunkSpend(b *testing.B) {
	var c admission.LocalChunkForBench
	c.Fill(1<<62, 1<<62)
	b.ReportAllocs()
	b.RunParallel(func(pb *testing.PB) {
		for pb.Next() {
			if !c.SpendRefund(1, 1, false) {
				b.Fatal("empty")
			}
		}
	})
}

// BenchmarkLocalChunkSpendRefund is a spend followed by the in-process
// refund made when a tenant rule denies.
func BenchmarkLocalChunkSpendRefund(b *testing.B) {
	var c admission.LocalChunkForBench
	c.Fill(1<<62, 1<<62)
	b.ReportAllocs()
	for i := 0; i < b.N; i++ {
		if !c.SpendRefund(1, 1, true) {
			b.Fatal("empty")
		}
	}
}

// BenchmarkDecide is the whole engine on the embedded store and on Redis,
// for a 3-rule decision (tenant, user, route).
func BenchmarkDecide(b *testing.B) {
	doc := parse(b, bench.ThreeRulePolicy)
	for _, name := range []string{"memory", "redis"} {
		b.Run(name, func(b *testing.B) {
			var store admission.Store
			if name == "memory" {
				store, _ = admission.NewMemoryStore(admission.DefaultMemoryConfig(), nil)
			} else {
				if shared.err != nil {
					b.Skip(shared.err)
				}
				c := redis.NewClient(&redis.Options{Addr: shared.redis.Addr()})
				defer c.Close()
				rs, err := admission.NewRedisStore(c, admission.DefaultRedisConfig())
				if err != nil {
					b.Fatal(err)
				}
				defer rs.Close()
				store = rs
			}
			cfg := admission.DefaultConfig()
			cfg.Namespace = namespace()
			cfg.StoreTimeout = time.Second
			e, err := admission.New(cfg, store, doc, 1)
			if err != nil {
				b.Fatal(err)
			}
			reqs := make([]*admission.Request, 1000)
			for i := range reqs {
				reqs[i] = &admission.Request{Descriptors: entries("tenant", fmt.Sprint("t", i%10), "user", fmt.Sprint("u", i), "route", "GET /catalog")}
			}
			b.ReportAllocs()
			b.ResetTimer()
			b.RunParallel(func(pb *testing.PB) {
				i := 0
				for pb.Next() {
					d, err := e.Decide(context.Background(), reqs[i%len(reqs)])
					if err != nil || !d.Allowed() {
						b.Fatalf("%v %v", d, err)
					}
					i++
				}
			})
		})
	}
}
