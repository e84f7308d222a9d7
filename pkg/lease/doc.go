// Package lease holds the pure arithmetic of allot's regional leases: window
// alignment, expiry clamping, the region-side lease deadline, the relative TTL
// used when a chunk is deposited into the regional store, and demand-driven
// chunk sizing.
//
// The package does no I/O, keeps no state and reads no clock: every instant is
// an argument. The allocator state machine (package fsm) uses the window and
// clamp functions with the leader-stamped time of a Raft entry; the region
// agent uses Deadline, RedisTTL and Sizing with its own monotonic clock.
//
// # Windows
//
// A quota's window of W milliseconds is aligned to epoch multiples of W:
// window i covers the half-open interval [i*W, (i+1)*W) of Unix milliseconds,
// and the window holding instant t is floor(t/W) (floor, not truncation, so
// instants before the epoch land in negative windows).
//
// # Usage
//
// An agent that needs tokens for a quota does, in order:
//
//	sent := time.Now()                           // monotonic reading, BEFORE sending
//	res := acquire(ctx, lease.Sizing{...}.Chunk(rate))
//	deadline := lease.Deadline(sent, res.ExpiresUnixMs, res.NowUnixMs, margin)
//	ttl := lease.RedisTTL(deadline, time.Now(), measuredStoreDelay)
//	if ttl > 0 {
//		deposit(ctx, res.Tokens, ttl)          // PX ttl in the regional store
//	}
//
// # Caller duties
//
// The guarantee that a region never spends a token after the allocator
// considers it expired holds only if the caller:
//
//  1. Reads sentAt from a monotonic clock (time.Now() keeps a monotonic
//     reading; do not strip it with Round(0) or a round trip through Unix
//     time) and reads it BEFORE the Acquire leaves the process, so that the
//     leader's stamp is causally after it.
//  2. Passes the leader's own stamp (the NowUnixMs of the grant, not the
//     agent's wall clock) as leaderNowUnixMs to Deadline, with the expiry
//     from the same reply.
//  3. Chooses a margin of at least the relative drift rate between its clock
//     and the allocator's, times the lease TTL, plus any clock step between
//     successive allocator leaders it wants covered (see the "timing" term
//     of package bound).
//  4. Stops spending at the deadline even if the store still holds tokens,
//     and deposits with RedisTTL, which subtracts the measured agent-to-store
//     delay, so that the store's own expiry is never later than the deadline.
//  5. Treats a zero RedisTTL as "do not deposit": the lease is already over.
package lease
