package bound_test

import (
	"fmt"
	"time"

	"github.com/allot-dev/allot/pkg/bound"
	"github.com/allot-dev/allot/pkg/policy"
)

// The Atlas quota of reference chapter 15 with unclamped leases, a bounded
// fallback and each region's holdings capped at one chunk
// (lease.max_held_per_region, which the allocator enforces): each term at
// its bound, as the chapter's table states it.
func ExampleCalculate() {
	c := bound.DefaultConfig().WithQuota(policy.GlobalQuota{
		Name: "p-tenant-atlas", Limit: 1000, Window: time.Minute, Chunk: 100, TTL: 15 * time.Second,
		Clamp: false, FallbackPerRegion: 100, MaxHeldPerRegion: 100, Regions: []string{"eu", "us"},
	})
	b := bound.Calculate(c)
	for _, t := range b.Terms {
		fmt.Printf("%-14s %d\n", t.Name, t.Tokens)
	}
	fmt.Println("ceiling", b.Ceiling())
	// Without the cap one region could carry the previous window's whole
	// pool.
	c.MaxHeldPerRegion = 0
	fmt.Println("uncapped carry_over", bound.Calculate(c).Terms[0].Tokens)
	// Output:
	// carry_over     200
	// fallback       200
	// store_fallback 200
	// lost_grants    0
	// timing         0
	// store_rollback 0
	// ceiling 1600
	// uncapped carry_over 1000
}
