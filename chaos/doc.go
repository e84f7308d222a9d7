// Package chaos is allot's fault-injection suite: real allocator processes
// and region drivers, each in its own network namespace on a bridge the suite
// makes, WAN delay and loss on every region-to-allocator link (fault proxies;
// the kernel has no netem), real partitions (iptables DROP inside the
// namespaces), real crashes (SIGKILL, SIGSTOP), membership changes and clock
// skew; and checkers over the whole recorded history (package chaos/check).
//
// Layout:
//
//   - pkg/topology (netns*.go): the lab (namespaces, bridge, veth, sweep of
//     a crashed run's leftovers) and allocators inside namespaces;
//   - pkg/faultproxy: delay with jitter, loss, cuts on one TCP link;
//   - chaos/driver and chaos/cmd/chaosregion: the region stand-in;
//   - chaos/history: events, the true clock, the driver wire protocol;
//   - chaos/check: the checkers and the report;
//   - chaos (this package): the Suite, the Region interface, scenarios and
//     schedules, and the tests that run them.
//
// Run it (as root; see docs/chaos.md):
//
//	go test ./chaos/...                                   # every scenario once, a few minutes
//	go test ./chaos -run TestChaos -chaos.soak=30m -timeout=40m   # random schedules
//	go test ./chaos -run TestChaos -chaos.seed=42                 # replay a seed
package chaos
