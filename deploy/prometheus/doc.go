// Package prometheus holds allot's Prometheus alerting rules,
// allot-alerts.yaml (the alert table of docs/operations.md). It has no
// code; its test keeps the rules in step with the metrics the allocator and
// the region agent serve.
package prometheus
