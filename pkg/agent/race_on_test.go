//go:build race

package agent_test

// raceEnabled is true under the race detector, which costs 5-10x the CPU
// per operation: load scenarios scale their offered load down.
const raceEnabled = true
