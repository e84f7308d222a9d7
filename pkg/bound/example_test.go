package bound_test

import (
	"fmt"
	"time"

	"github.com/allot-dev/allot/pkg/bound"
	"github.com/allot-dev/allot/pkg/policy"
)

// The Atlas quota of reference chapter 15 with unclamped leases and a
// bounded fallback: each term at its bound. Nothing caps what one region
// holds, so carry-over is the previous window's whole pool (the chapter's
// "100 per region" assumes a cap the allocator does not enforce).
func ExampleCalculate() {
	c := bound.DefaultConfig().WithQuota(policy.GlobalQuota{
		Name: "p-tenant-atlas", Limit: 1000, Window: time.Minute, Chunk: 100, TTL: 15 * time.Second,
		Clamp: false, FallbackPerRegion: 100, Regions: []string{"eu", "us"},
	})
	b := bound.Calculate(c)
	for _, t := range b.Terms {
		fmt.Printf("%-14s %d\n", t.Name, t.Tokens)
	}
	fmt.Println("ceiling", b.Ceiling())
	// Output:
	// carry_over     1000
	// fallback       200
	// lost_grants    0
	// timing         0
	// store_rollback 0
	// ceiling 2200
}
