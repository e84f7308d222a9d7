package examples_test

import (
	"testing"

	"github.com/allot-dev/allot/examples"
	"github.com/allot-dev/allot/pkg/policy"
)

func TestNorthstarParses(t *testing.T) {
	d, err := policy.Parse(examples.Northstar)
	if err != nil {
		t.Fatalf("examples/northstar.yaml: %v", err)
	}
	// All five reference policies are present.
	for _, name := range []string{"p-anon", "p-read", "p-tenant-atlas", "p-tenant-birch", "p-export", "p-export-concurrency", "p-global"} {
		if d.Rule(name) == nil {
			t.Errorf("rule %s missing", name)
		}
	}
	if got := len(d.GlobalQuotas()); got != 3 {
		t.Errorf("%d global quotas, want 3 (atlas, birch, catalog)", got)
	}
}

func TestPlansParses(t *testing.T) {
	d, err := policy.Parse(examples.Plans)
	if err != nil {
		t.Fatalf("examples/plans.yaml: %v", err)
	}
	tmpl := 0
	for _, q := range d.GlobalQuotas() {
		if len(q.TemplateKeys) > 0 {
			tmpl++
		}
	}
	if tmpl != 2 {
		t.Errorf("%d templates, want 2 (p-tenant-standard, p-tenant-exports)", tmpl)
	}
}
