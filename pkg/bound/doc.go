// Package bound states how far a leased global quota can be exceeded, term by
// term, and reconciles observed admissions against that statement.
//
// The package is pure: no clock, no I/O, no package-level mutable state.
//
// # The bound
//
// For one window of a quota with limit G, DESIGN.md promises
//
//	admitted_in_window <= G + carry_over + fallback + store_fallback + lost_grants + timing + store_rollback
//
// [Calculate] turns a [Config] (the quota's lease spec plus the assumptions
// about the environment: replication, clocks, delays, the regional store)
// into a [Bound]: each [Term] with its value in tokens, the assumption it
// rests on, and how to make it zero. Stranded capacity (tokens granted and
// never spent, the price of safety) is reported beside the bound, not in it.
//
// # Usage
//
//  1. Start from [DefaultConfig], the strict environment assumptions, and set
//     the quota's fields with [Config.WithQuota] from a policy.GlobalQuota.
//  2. Override the assumptions you measured (drift, delays, replication lag)
//     and call [Config.Validate].
//  3. [Calculate] the bound, show it ([Bound.String]) or serve it.
//  4. Feed per-window, per-region admission counts to [Reconcile]; every
//     window whose total exceeds [Bound.Ceiling] is a violation of the stated
//     bound, i.e. a bug or a broken assumption, and is listed with its ledger.
//     Negative counts are listed in Report.Invalid, left out of the sums, and
//     make the report not OK.
//
// The terms are upper bounds for one window under the stated assumptions
// (notably: at most one allocator failover and one regional store failover
// per window); they are not measurements. Without a per-region cap
// (Config.MaxHeldPerRegion, the policy's lease.max_held_per_region) no term
// assumes a region holds less than a whole pool per window its leases
// reach. With one, the allocator never lets a region hold more than H
// unexpired, unreleased tokens, so carry_over, timing and store_rollback
// count at most what the regions can spend at once: H each when the expiry
// margin covers drift, delay and skew, a few times H when it falls short
// (see the terms' assumptions). The cap does not lower lost_grants (a
// failover forgets spent grants too). A publish that resets a pool (a
// changed window length, a removed and re-added quota) lets a region hold
// its old leases beside H new tokens until the old ones end: the capped
// terms assume no such publish in the window or the lease lifetime before.
//
// No term counts such a reset because the G of the bound does: the
// allocator opens every window of the new length less the tokens the old
// pools granted (net of releases) whose leases reach into it, expired or
// still live, since they may have been spent in its span (package fsm,
// WindowView.Carried). So the window the change lands in, which began
// before the publish and may span old windows, admits at most G plus the
// terms like any other; when the allocator no longer holds the old windows
// it reaches (a window more than doubled), it counts them whole and that
// window admits less. The terms are those of the quota's current lease spec.
// A quota with fail_mode fallback has two fallbacks, and both count: the
// agent's, which deposits fallback_per_region into the store while its region
// is cut off from the allocator (fallback), and the SDK's, which admits a
// gateway's share of fallback_per_region in process while the store fails or
// is slow (store_fallback), unseen by the store. The second assumes each
// gateway's admission Config.Gateways is at least its region's gateway count
// (Config.Gateways states it) and gateway clocks within the expiry margin
// of true time (each share is spent only within a window, less the SDK's
// margin at each end).
//
// Terms never overlap: a token spent in the wrong window because of a clock
// error is counted by timing only when leases are clamped, since without
// clamp carry_over already counts every token held across the boundary.
package bound
