// Package chaos is allot's fault-injection suite: real allocator processes
// and real regions (redis-server, regionagent and a load generator per
// region), each host in its own network namespace on a bridge the suite
// makes, WAN delay and loss on every region-to-allocator link (fault proxies;
// the kernel has no netem), real partitions (iptables DROP inside the
// namespaces), real crashes (SIGKILL, SIGSTOP), membership changes, agents
// restarted with skewed clocks, a region's Redis killed and restarted; and
// checkers over the whole recorded history (package chaos/check).
//
// Layout:
//
//   - pkg/topology (netns*.go, region.go): the lab (namespaces, bridge,
//     veth, sweep of a crashed run's leftovers), allocators inside
//     namespaces, and a region's Redis and agent inside one
//     (RegionConfig.Netns);
//   - pkg/faultproxy: delay with jitter, loss, cuts on one TCP link (also
//     the WAN delay of deploy/multiregion);
//   - chaos/loadgen and chaos/cmd/chaosregion -mode load: the load
//     generator of an agent region (AgentRegion, the default);
//   - chaos/wan and chaos/cmd/chaosregion -mode wan: a region's WAN links
//     to the allocators, out of the test process;
//   - chaos/driver and chaos/cmd/chaosregion: the region driver, a region in
//     one process with deliberately broken modes for the checkers' own test
//     (DriverRegion, -chaos.regions=driver);
//   - chaos/history: events, the true clock, the wire protocol of the region
//     processes;
//   - chaos/check: the checkers and the report;
//   - chaos (this package): the Suite, the Region interface and its two
//     implementations, the agents' lease journals turned into history,
//     scenarios and schedules, and the tests that run them.
//
// Run it (as root; see docs/chaos.md):
//
//	go test ./chaos/...                                   # every scenario once, a few minutes
//	go test ./chaos -run TestChaos -chaos.soak=30m -timeout=40m   # random schedules
//	go test ./chaos -run TestChaos -chaos.seed=42                 # replay a seed
//	go test ./chaos -run TestChaos -chaos.regions=driver          # region drivers instead of agents
package chaos
