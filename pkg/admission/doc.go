// Package admission is allot's decision engine and Go SDK: gateways embed it
// to decide, for every request, whether it may consume backend capacity now.
//
// One request is decided against every rule of the policy that matches its
// descriptors (pkg/policy), in the fixed evaluation order ip, global, tenant,
// user, route. All the rules that share a hash tag are decided by ONE call of
// one Lua script (script.lua, loaded once, called with EVALSHA and reloaded
// on NOSCRIPT): the script checks every rule first and then debits all of
// them, or none, so a denied request spends nothing and the denying rule is
// deterministic. All keys of a tenant share the tag {t:<tenant>}, so this
// holds on Redis Cluster too. Redis TIME is the only clock inside the script;
// amounts are integers (millitokens for buckets).
//
// # Rule kinds
//
//   - token_bucket: capacity and refill (P-READ: 20, 2/s); the retry hint is
//     the deficit over the refill rate, rounded up to whole seconds; no refill
//     for negative time; the idle TTL is the time to refill fully.
//   - fixed_window: epoch-aligned windows (P-ANON); admits up to twice the
//     limit across a boundary, by design.
//   - sliding_window: the counter estimate prev*(1-elapsed/W)+curr.
//   - concurrency: slots as leases in a sorted set of request ids scored by
//     deadline; acquiring drops expired ones; Release and Renew.
//   - global_quota: a leased pool of chunks deposited by the region agent
//     (DepositChunk), each with its own expiry, spent earliest-expiring
//     first. A tenant's pool is part of the tenant's atomic script; a
//     fleet-wide pool (P-GLOBAL) is spent from a gateway-local chunk taken
//     from the regional pool, refunded in process when a later rule denies.
//     A quota template (match entries without a value) has a pool per
//     instance, named by policy.InstanceName and keyed under the tenant's
//     tag; RuleResult.Pool names the pool a request was charged to, and
//     DepositChunk, PoolStats, MarkExhausted and PoolKeys take it.
//
// Weighted cost (P-EXPORT costs 10) multiplies everything; Request.Hits
// multiplies it again. A cost above what a rule can ever admit is an error.
//
// # Around the store
//
//   - Negative cache: after a denial with retry hint R, the same counter is
//     denied in process for min(R, Config.NegativeCacheTTL) with no store
//     call, in fixed memory. The retry of a request this engine admitted
//     (its request id, descriptors and hits, within Config.IdempotencyTTL)
//     is not denied so, nor by a gateway-local chunk found empty: it goes
//     to the store, which replays the admission. The engine knows such
//     requests from a fixed table of 4096 recent admissions (lossy: a lost
//     entry means the cached 429, a false match one more store call), so a
//     client cannot pass the cache with fresh ids. A retry that reaches
//     ANOTHER gateway while that gateway holds the key's denial (at most
//     NegativeCacheTTL, 250 ms by default) still gets the cached 429.
//   - Key cache: up to Config.KeyCacheSize counter keys (16,384 by
//     default, about 200 bytes each; when full, a random one makes room)
//     are kept made, so a principal seen again costs no SHA-256 and no
//     allocation for its keys; a key is reused only for the exact inputs
//     it was made from.
//   - Idempotency: a retry of a request admitted within
//     Config.IdempotencyTTL (the same request id, descriptors and hits) gets
//     the earlier decision back and is not charged again.
//   - Fail modes: when the store does not answer within Config.StoreTimeout,
//     or the circuit breaker of the store's shard that holds the rules' keys
//     is open, each rule's fail mode decides: closed
//     answers Unavailable (503), open admits (counted), fallback spends an
//     in-process bucket of the rule divided by Config.Gateways (at least
//     one request). A global quota's fallback is its
//     lease.fallback_per_region divided so, once per epoch-aligned window
//     of the gateway's wall clock, and only Config.PoolFallbackMargin inside
//     it (250 ms by default; outside that span it answers Unavailable with
//     a Retry-After to the span), so that a clock within the margin of true
//     time spends one share per true window: the stated bound counts it as
//     store_fallback. The caller's
//     context bounds the wait too: when its deadline passes first the fail
//     modes decide the same way. A caller that leaves (its context canceled)
//     also gets the fail modes' decision, but the call is counted as
//     canceled (allot_admission_store_calls_total{result="canceled"}), not as
//     a store error or a fail mode's engagement, and the breaker ignores it.
//     A call whose caller stopped waiting before the batcher sent it is
//     dropped, never sent: the request answered by its fail mode is not
//     also charged when the store comes back. One already sent may still
//     land (a paused Redis runs it when it resumes): the concurrency slots
//     it takes are released by the engine a second, ten seconds and a
//     minute later.
//   - Circuit breakers: one per shard of the store. On Redis Cluster each
//     master is a shard (the master that owns a call's slot in the client's
//     slot map); any other store is one shard. A breaker opens after
//     Config.BreakerFailures consecutive failed calls of its shard, refuses
//     that shard's calls for Config.BreakerCooldown, then lets one probe
//     through; a master that stops answering so opens its own breaker and
//     the other masters' tenants keep their store. Failures that say
//     nothing about the node are not counted: the caller leaving, the
//     caller's deadline passing first, the store's own queue being full,
//     and Redis Cluster refusing a call for where its keys live (TRYAGAIN
//     while a slot is being moved, or the caller's timeout passing while
//     the call waits to be sent again after one; a MOVED or ASK redirect
//     left over once go-redis's redirects ran out); the fail modes still
//     decide those calls. CLUSTERDOWN, MASTERDOWN, LOADING, connection errors and
//     timeouts count.
//
// # Stores
//
// The same engine runs on the embedded MemoryStore (one process; the
// reference design's V0 and the demo) and on a RedisStore over a standalone
// server or a Redis Cluster. A conformance suite runs the same tests on all
// three. RedisStore batches concurrent calls into pipelines; on Redis
// Cluster, one batcher per master, so that a master that stops answering
// holds up only its own calls, and a call that fails on its connection
// makes the client reload its slot map, so that a replica promoted in a
// dead master's place is used at once rather than after go-redis's
// periodic reload (a minute by default).
//
// # Counter state
//
// A bucket or a window is one Redis string. RedisStore writes it in a
// binary form (25 bytes: a tag and three numbers) and reads both that and
// the decimal text ("tokens:stamp:expiry", "index:count[:prev]") that builds
// before the binary form wrote and read; parsing and formatting text cost
// the script about a microsecond per rule. Upgrading gateways that share a
// Redis with such older builds takes two steps: roll out the new build with
// RedisConfig.StateForm = StateText (regionagent -redis-state text), so
// every gateway reads both forms and all still write text; then switch to
// StateBinary. An older script meeting binary state fails that rule's call,
// and its fail mode decides.
//
// # Latency and the Go collector
//
// A Redis-backed decision allocates about 150 B (one rule; about 300 B for
// three) on the caller's heap. On a small host shared with Redis, the
// collector's pauses and marking then make most of a gateway's p99: in docs/admission-bench.md, at
// half of the SDK's peak rate on two cores, p99 was 2.4-3.3 ms with the
// default GOGC and under 1 ms with the collector off. A gateway that needs
// that tail can raise GOGC, or set GOMEMLIMIT and GOGC=off; the engine does
// not change its host's collector settings.
//
// # Usage
//
//  1. Create a store: NewMemoryStore, or NewRedisStore on a go-redis client
//     (with ContextTimeoutEnabled, so that RedisConfig.PipelineTimeout bounds
//     a round trip; the store never lets go-redis retry a script call, and
//     sends a call again itself only when Redis refused it before running
//     it: NOSCRIPT, READONLY, TRYAGAIN, LOADING, CLUSTERDOWN, MASTERDOWN).
//  2. Create the engine from a parsed policy and its version: New.
//  3. For each request, build descriptors from verified claims (never from
//     client headers) and call Decide. Allow: forward, and Release the
//     decision when the work ends if it holds concurrency slots. Deny: 429
//     with Retry-After. Unavailable: 503 with Retry-After. pkg/admission/httpmw
//     does all of this for net/http.
//  4. Apply newer policy versions as they are published; older or invalid
//     ones are rejected and the version in force stays.
//  5. The region agent deposits leased chunks with DepositChunk, reads
//     PoolStats for demand, and marks exhausted pools with MarkExhausted.
//
// Guarantees are those of the reference design: two requests cannot both
// consume the same remaining budget of one store instance; multi-rule
// decisions are all-or-nothing within one hash tag (rules under different
// tags, such as an ip rule beside a tenant's rules, are decided in order and
// compensated with a refund when a later one denies; a refund that fails
// leaves the earlier rules charged, the safe direction. A leased pool decided
// in the store under a tag of its own, a fleet-wide quota without
// gateway_chunk or a template instance with a hashed name, is not refunded:
// its token stays spent, which can waste quota but never overshoots it);
// Retry-After is a hint, never a reservation.
package admission
