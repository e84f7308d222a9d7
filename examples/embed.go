// Package examples embeds the example policies, so binaries ship a default
// and tests and documentation share one source.
package examples

import _ "embed"

// Northstar is examples/northstar.yaml: the annotated Northstar policy of the
// reference design (P-ANON, P-READ, P-TENANT for Atlas and Birch, P-EXPORT,
// P-GLOBAL). It is shared by every caller: read it, never modify it; copy it
// with bytes.Clone first if a caller must change it.
//
//go:embed northstar.yaml
var Northstar []byte

// Plans is examples/plans.yaml: per-tenant plans written as quota templates
// (global_quota rules with a match entry without a value, one leased pool
// per tenant), beside a fixed rule for one tenant. Shared like Northstar:
// read it, never modify it.
//
//go:embed plans.yaml
var Plans []byte
