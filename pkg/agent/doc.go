// Package agent is allot's region agent: it serves admission decisions for a
// region from the region's Redis, and keeps the region's share of every
// global quota leased from the allocator, in proportion to demand.
//
// # What it does
//
//   - Policy. It follows the allocator's policy (GetPolicy, then a
//     WatchPolicy stream, reconnecting with backoff through the failover
//     client). A record is applied only if its version is newer than the one
//     in force, its digest is the SHA-256 of its document and the document
//     parses and validates; the engine swaps the compiled policy atomically,
//     so every decision is made under one version, which it records. The
//     accepted record is persisted (Config.DataDir/policy.json, written
//     atomically, with a sum over its version and digest) and put back in
//     force at the next start, before the allocator is reached:
//     last-known-good. The one exception to "newer only": when the watch
//     (re)connects and the allocator's current version, read on the leader,
//     is older than the one in force, shares its number with another
//     digest, or does not exist, the allocator's history differs (a rebuilt
//     cluster): the agent logs an error and adopts the allocator's record.
//     Shadow rules are evaluated beside live ones under their own keys and
//     only report would_deny.
//   - Leases. For every global quota the region leases, the lease manager
//     reads the regional pool (pkg/admission PoolStats: available, consumed,
//     starved) and measures demand = consumption rate + requests starved for
//     lack of leased tokens x their cost (an exponentially weighted average,
//     Config.Lease.DemandHalfLife). A pool under its low watermark (demand x
//     Lead) is renewed; all the pools due in one tick go in ONE batched
//     Acquire (more only beyond Config.Lease.MaxWantsPerCall, 16,384 by
//     default as the allocator's limit per call, or beyond a lower limit
//     the allocator refuses a call for), each asking
//     lease.Sizing.Chunk(demand) tokens, at most the policy's chunk. A pool
//     whose grants live briefly (a TTL of a few Leads) renews with a
//     shorter lead (lease.LeadWithin), so it never holds more than it can
//     spend before its grants expire. A pool
//     whose demand decayed under 0.01 tokens/s is renewed only when a
//     request starves.
//   - Quota templates. A global_quota rule with a match entry without a
//     value has a pool per instance ("p-tenant-standard/birch"). The lease
//     manager learns of an instance from the first request its pool
//     denies (pkg/admission names it in RuleResult.Pool), manages it like a
//     single pool from then on, and forgets it once it is idle (no demand,
//     nothing held, no live grant, unused for the longer of two IdlePolls
//     and the lease TTL), so memory follows the active tenants. Lease
//     metrics sum a template's instances under the template's name.
//     Grants are deposited with DepositChunk for a TTL computed by the
//     send-time rule (lease.Deadline from the moment the Acquire was first
//     sent, minus Config.Lease.Margin, or the allocator's lease_margin_ms
//     when larger; lease.RedisTTL subtracts the measured
//     store delay), so a chunk never outlives its lease. A call that gets no
//     answer is retried with the SAME request id (the allocator replays it),
//     and its deadlines still count from the first send; the client follows
//     the allocator leader's hints. A grant that arrives too late to be worth
//     depositing, or whose deposit certainly never reached the store, is
//     released back. A deposit that may have reached it (a timeout) is
//     never sent again, since a late copy would count its TTL from its
//     arrival: the grant is withdrawn with a tombstone, and only what is
//     certainly out of the store is released. Rounds run once
//     per Config.Lease.Tick and no more often, whatever the number of
//     quotas; a request starved for lack of tokens marks its pool for the
//     next round. Pools are not asked for in the last moments of a window
//     (a chunk would not outlive the margin and the deposit bound).
//   - Window turns. With clamp on, every chunk a region holds ends with its
//     window. Config.Lease.PregrantLead (1 s, at most a quarter of the
//     window) before a window's estimated end, a pool with demand asks for a
//     chunk of the next window (a pre-grant, allot.v1.Want.next_window),
//     deposited with DepositPregrant so the store opens it at
//     lease.NotBefore: never before the leader's clock reaches the window's
//     start, whatever the clock offset. Requests waiting at the turn are
//     woken when it opens, so a turn costs no Acquire round trip and no tick;
//     what remains is the lease margin (and the deposit bound) at the end of
//     the old window. Without a pre-grant the pool is renewed at the first
//     round after the turn, as with clamp off.
//   - Cut-off. When the allocator does not answer, the region spends only
//     what it holds, plus the policy's fallback_per_region once per window
//     for a fallback quota (the bound's fallback term). The allowance's
//     window is placed by the leader's clock as the last fresh Acquire
//     answer measured it, carried on by the monotonic clock (never the wall
//     clock) and widened by Config.Lease.MaxDriftPPM of the time since: it
//     is deposited only once the leader's clock is surely inside the window,
//     and dies the margin before the window surely ends, so the region's
//     agents never hold two windows' allowances at once. A process that has
//     had no answer since it started deposits none
//     (allot_agent_fallback_withheld_total{reason="unmeasured"}). A request
//     its pool cannot serve is then answered unavailable (503: the
//     limiter's problem). While Redis fails, the engine's in-process share
//     of a fallback quota is placed by the same estimate of the leader's
//     clock (admission.WithFallbackClock), not the host's clock.
//     A pool the allocator reports exhausted for the window is marked in the
//     store (MarkExhausted), so requests get 429 with Retry-After to the
//     window's end. A request short of tokens while a renewal is on its way
//     waits for it, up to Config.StarveWait, then is answered unavailable.
//   - Shutdown. When Run ends, the agent withdraws the unspent tokens of its
//     live grants from the store, atomically so none can be spent after, and
//     releases them to the allocator, within Config.ShutdownTimeout of the
//     end of Run's context. It logs what the allocator acknowledged, and
//     warns of what it did not: those tokens return to the allocator's pool
//     when their leases expire.
//   - Regions. A policy's global quotas are leased to its regions. An agent
//     whose region is not one of them (a wrong -region) logs an error naming
//     the quotas, once per policy version, answers their requests the pools
//     cannot serve unavailable (fail_mode_total{mode="refused"}), and is not
//     ready (Ready, /readyz).
//   - APIs. allot.v1.AdmissionService over Connect (and gRPC, gRPC-Web) on
//     the HTTP mux (Mux), and Envoy's envoy.service.ratelimit.v3
//     RateLimitService over gRPC on a listener of its own (NewGRPCServer).
//     Bad input is InvalidArgument naming the field, with nothing debited;
//     oversized messages are ResourceExhausted.
//   - Telemetry. Prometheus metrics (allot_agent_* and the engine's
//     allot_admission_*), and sampled decision logs whose principals are
//     salted hashes (HMAC-SHA-256 keyed by Config.LogSalt; without one, by
//     a random salt of the process, so they do not correlate across
//     restarts or agents).
//   - Lease journal. With WithLeaseObserver (regionagent -lease-journal),
//     every Acquire attempt with its answer, every deposit with the deadline
//     and the store TTL it used, and every Release is reported as a
//     LeaseEvent; LeaseJournal writes them as JSON lines. The chaos suite
//     checks the agent's leases from it.
//
// # Why the engine's negative cache is off by default
//
// The engine denies a recently denied key in process for up to
// Config.Engine.NegativeCacheTTL without asking the store. A leased pool
// that was short a moment ago may have been refilled since: the agent waits
// for exactly that deposit, and a negative cache would keep denying for its
// TTL. DefaultConfig therefore sets it to 0; exhausted pools are marked in
// the store instead, and denial storms cost one script call each.
//
// # Usage
//
//  1. Create a go-redis client for the region's Redis and a Config with the
//     region, the allocator endpoints and a data dir.
//  2. New, then Run in its own goroutine (errgroup) until shutdown.
//  3. Serve Mux(agent, registry) over HTTP/1.1 + h2c (allocator.HTTPServer)
//     and NewGRPCServer(agent) on the Envoy port.
//  4. Gateways call Check per request and ReleaseSlot when a request holding
//     concurrency slots ends; Envoy calls ShouldRateLimit.
package agent
