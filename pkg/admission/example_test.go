package admission_test

import (
	"context"
	"fmt"

	"github.com/allot-dev/allot/examples"
	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/policy"
)

// The Northstar export example on the embedded store: an export costs 10
// units of a 20-unit bucket, so the third export in a row waits 5 s.
func Example() {
	doc, err := policy.Parse(examples.Northstar)
	if err != nil {
		panic(err)
	}
	store, err := admission.NewMemoryStore(admission.DefaultMemoryConfig(), nil)
	if err != nil {
		panic(err)
	}
	e, err := admission.New(admission.DefaultConfig(), store, doc, 1)
	if err != nil {
		panic(err)
	}
	defer e.Close()
	ctx := context.Background()
	req := &admission.Request{Descriptors: []policy.Entry{
		{Key: "route", Value: "POST /reports/export"},
		{Key: "tenant", Value: "cedar"},
	}}
	for i := 0; i < 3; i++ {
		d, err := e.Decide(ctx, req)
		if err != nil {
			panic(err)
		}
		if d.Allowed() {
			fmt.Println("export admitted")
			_ = e.Release(ctx, d) // the export finished
			continue
		}
		fmt.Printf("429: scope %s, Retry-After %d\n", d.Scope, d.RetryAfter)
	}
	// Output:
	// export admitted
	// export admitted
	// 429: scope tenant, Retry-After 5
}
