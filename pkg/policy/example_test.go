package policy_test

import (
	"errors"
	"fmt"

	"github.com/allot-dev/allot/examples"
	"github.com/allot-dev/allot/pkg/policy"
)

func ExampleParse() {
	_, err := policy.Parse([]byte(`
name: demo
rules:
  - name: p-read
    scope: user
    match: [{key: tenant}, {key: user}]
    kind: token_bucket
    capacity: 20
    refill_per_second: 2
    cost: 30
`))
	fmt.Println(errors.Is(err, policy.ErrInvalid))
	fmt.Println(err)
	// Output:
	// true
	// invalid policy: rules[0].cost: 30 exceeds capacity 20 (line 10)
}

func ExampleMatcher_Match() {
	d, err := policy.Parse(examples.Northstar)
	if err != nil {
		panic(err)
	}
	m := policy.Compile(d)
	for _, r := range m.Match([]policy.Entry{
		{Key: "tenant", Value: "atlas"}, {Key: "user", Value: "U-17"}, {Key: "route", Value: "GET /catalog"},
	}) {
		fmt.Println(r.Rule.Scope, r.Rule.Name, r.Parts)
	}
	// Output:
	// global p-global []
	// tenant p-tenant-atlas []
	// user p-read [atlas U-17]
}
