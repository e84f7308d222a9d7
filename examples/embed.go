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
