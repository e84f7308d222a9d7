package bound_test

import (
	"fmt"
	"time"

	"github.com/allot-dev/allot/pkg/bound"
	"github.com/allot-dev/allot/pkg/policy"
)

// The Atlas quota of reference chapter 15 with unclamped leases and a
// bounded fallback: each term at its bound.
func ExampleCalculate() {
	c := bound.DefaultConfig().WithQuota(policy.GlobalQuota{
		Name: "p-tenant-atlas", Limit: 1000, Window: time.Minute, Chunk: 100, TTL: 15 * time.Second,
		Clamp: false, FallbackPerRegion: 100, Regions: []string{"eu", "us"},
	})
	c.MaxHeldPerRegion = 100
	b := bound.Calculate(c)
	for _, t := range b.Terms {
		fmt.Printf("%-14s %d\n", t.Name, t.Tokens)
	}
	fmt.Println("ceiling", b.Ceiling())
	// Output:
	// carry_over     200
	// fallback       200
	// lost_grants    0
	// timing         0
	// store_rollback 0
	// ceiling 1400
}
