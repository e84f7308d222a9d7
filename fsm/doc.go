// Package fsm is allot's allocator state machine: the deterministic core that
// a Raft group replicates to hold every global quota's pool for the current
// window and to grant regions window-clamped, TTL'd chunks of it.
//
// FSM implements hashicorp/raft's raft.FSM. It is pure: it reads no clock,
// draws no random numbers, does no I/O except writing a snapshot to the sink
// raft hands it, and never lets map iteration order reach a result or a byte
// of a snapshot. Time is an input: the leader stamps NowUnixMs on every
// command and the state machine keeps now = max(stamp, previous now), so
// windows never reopen. Applying the same log to two FSMs yields the same
// results and byte-identical snapshots.
//
// # Commands
//
// A log entry is one byte of format version (FormatV1) followed by a JSON
// Command (see Encode and Decode). There are five commands:
//
//   - Acquire grants a region chunks of up to MaxWants quotas in one entry.
//     Each grant is at most the pool at that instant (and, for a fair_share
//     quota under contention, at most the region's max-min fair share);
//     with clamp on it expires at min(now+TTL, window end). A retry with the
//     same region and request id returns the recorded result, Replayed set,
//     and grants nothing. A want with Next set (clamp on only) is a
//     pre-grant: tokens of the next window, spendable from its start
//     (NotBeforeUnixMs), expiring at min(start+TTL, its end), at most
//     ChunkTokens per region before the window opens, and made only in
//     the second half of the current window. Regions hold tokens
//     the instant a window turns instead of one round trip later.
//     A quota with MaxHeldPerRegion caps what one region holds: a grant
//     never leaves the region holding more than the cap in unreleased
//     tokens of its grants that have not expired, over the windows the
//     state machine keeps (previous, current, and next: pre-grants count).
//     The state machine cannot see spending, so spent tokens count until
//     their grant expires or is released. A want beyond the room left gets
//     less, possibly 0 (no grant id), and a grant cut short only by the
//     cap is not PoolExhausted: room comes back as grants expire or are
//     released, before the window ends. Each instance of a template has
//     the cap on its own.
//   - Release returns unspent tokens of a grant to the pool of its window,
//     if that window is the current one (or, for a pre-grant, has not
//     started); afterwards it is a no-op that returns 0, because the pool
//     it came from is gone.
//   - Publish installs a new policy version (current+1 exactly): its specs
//     replace all quotas. A changed limit applies to the current window
//     (pool = max(0, new limit - outstanding)); a changed MaxHeldPerRegion
//     applies from the next grant (a region holding more than a lowered
//     cap keeps its grants and gets nothing until it holds less); a
//     changed window length (or TemplateKeys) drops the quota's windows
//     and grants; a dropped quota goes with its windows. Regions keep
//     spending the dropped grants until their leases end, and may have
//     spent those already expired at any time since they were granted, so
//     the unreleased tokens of every dropped grant are carried: every
//     window of a pool of the same name (the quota's, or a re-added
//     quota's) whose span the grant's lease reaches, from its grant to its
//     expiry, leaves room for them (pool = max(0, limit - carried -
//     outstanding); WindowView.Carried), live or expired. That includes the
//     window of the new length the change lands in, which began before the
//     publish: a longer window spans old windows whose grants are partly
//     spent (1m to 2m at 05:29:40: [05:28, 05:30) counts what [05:28,
//     05:29) and [05:29, 05:30) granted), a shorter one counts only the
//     grants whose leases reach it (2m to 1m at 05:29:55: [05:29, 05:30)
//     does not count a grant of [05:28, 05:30) that expired at 05:28:30),
//     so no window of the new length admits more than its limit, old and
//     new grants together. The grants of the windows still held (the
//     previous, current and next) are counted exactly. Older windows of the
//     same length, which the state machine no longer holds, are counted
//     whole, at the largest limit the policy versions held gave them since
//     the quota took that length (the most they can have granted), if the
//     window of the new length reaches them: a window that grows more than
//     twofold may admit less than its limit in the window the change lands
//     in, never more. A later window that reaches back further than the
//     publish accounted for (another change, or a quota re-added with a
//     longer window), or a window older than the versions held, is left
//     empty until it ends. Carried tokens are not kept per region, so they
//     do not count toward a region's cap: until they expire a region may
//     hold them beside a full cap of new grants. The last HistoryVersions
//     versions are kept for audit.
//   - SetMember records (or removes) the API address of an allocator
//     member, so that every replica can direct clients to the leader.
//   - SetCluster records the cluster's id, once: the first leader of a
//     cluster proposes a random one, and later ones change nothing (the
//     result names the id that stays). It tells the state of this cluster
//     from that of another founded with the same node ids and addresses.
//   - Batch carries up to MaxBatch Acquire and Release commands the leader
//     group-committed into one entry; each is applied on its own, as if it
//     had an entry of its own, and has its own result or error.
//
// Apply returns *AcquireResult, *ReleaseResult, *PublishResult,
// *SetMemberResult, *SetClusterResult or *BatchResult through
// ApplyFuture.Response, or an error wrapping ErrUnknownQuota,
// ErrInvalidArgument, ErrStaleVersion, ErrUnknownGrant, ErrResourceExhausted
// or ErrMalformedCommand whose message names the offending field. A command is
// validated whole before anything changes: after an error the state,
// including the time, is exactly as before. No input bytes make Apply panic.
//
// # Quota templates
//
// A spec with TemplateKeys > 0 is a template (a global_quota rule with match
// entries without a value): it has no pool of its own, and every name
// "<template>/<values>" written as policy.InstanceName writes it is a pool
// of its own, an instance, with the template's spec ("p-tenant-standard/
// birch": one pool per tenant from one rule). An instance comes into being
// on the first Acquire that names it, deterministically, and is forgotten as
// soon as it holds nothing visible (no previous, current or next window, no
// fresh demand report), so idle tenants cost no memory. At most
// MaxInstancesPerTemplate are alive per template; an Acquire that would
// create more fails whole with ErrResourceExhausted, naming the want. Naming
// an instance of a template the policy lacks, or of a single pool, is
// ErrUnknownQuota; a template's own name, or a malformed instance name,
// ErrInvalidArgument. Release, the grants, the windows and the snapshots of
// instances work as for any quota. A publish that changes a template's
// window drops its instances whole (they come back with the next Acquire);
// one that drops the template drops them all. Each instance's tokens are
// carried under its name, so a re-created instance leaves room for its own
// leases, and the windows no longer held count for every instance (one
// that was not alive at the publish may have granted in them). When
// TemplateKeys change (or a single pool becomes a template or back), new
// pools cannot be matched to old ones: every new pool of that name leaves
// room for the tokens of all the old ones, and none is left for it in a
// window that reaches old windows no longer held.
//
// # Memory
//
// Per quota the FSM holds its spec, at most three windows (the current one,
// the previous, kept for reporting, and the next once a region took a
// pre-grant of it) and the demand reports of the last two TTLs. Older windows are collected when their quota is touched and by a
// round-robin sweep of a few quotas per entry, so an entry costs O(quotas it
// touches), never O(all quotas); until collected they are invisible to every
// read, result and snapshot. Dead instances of templates are collected the
// same way (amortized O(1) each: a template keeps its instances in order of
// death). Request ids are kept for two of the longest
// window of the policy, and at most MaxIdempotencyRecords of them. Carried
// tokens take one small entry per expiry of a reset pool's grants (and a
// few per template), kept exact for the longest window of the policy
// versions held after the leases end; then a publish collapses each name's
// into one entry (of its template's, for an instance), which goes
// MaxWindowMs after they end, when no window can reach back to them.
//
// # Snapshots
//
// A snapshot is the logical state as JSON lines, the same bytes on every
// replica that applied the same log. Persist seals it (SnapshotFormatV2):
// the header begins {"format":2, and the last line holds the length and
// CRC-32C of all the bytes before it. Restore refuses a snapshot whose
// trailer is missing or does not match, however it arrived: the CRC of
// raft's snapshot files is computed on the bytes as a follower received
// them from InstallSnapshot, other paths may have none, and the checks of
// the records cannot see a changed digit of a count, a time or an id.
// Restore replaces the state whole, only after the snapshot was read to
// its end and checked, or not at all. Snapshots of older builds
// (SnapshotFormatV1: the same records, no trailer) still restore; no
// snapshot of this build restores on an older build.
//
// # Usage
//
//	f := fsm.New()
//	r, err := raft.NewRaft(conf, f, logs, stable, snaps, transport)
//	...
//	b, err := fsm.Encode(fsm.Command{Type: fsm.CmdAcquire, NowUnixMs: now, Acquire: &a})
//	fut := r.Apply(b, timeout)
//	if err := fut.Error(); err != nil { ... }   // not committed: retry with the same request id
//	switch res := fut.Response().(type) {
//	case *fsm.AcquireResult: ...
//	case error: ...                             // rejected: errors.Is(res, fsm.ErrUnknownQuota) ...
//	}
//
// # Caller duties
//
//  1. Stamp NowUnixMs on the leader, from its wall clock, when proposing;
//     never on a follower and never from the client.
//  2. Give every Acquire a request id that is stable across retries, and
//     retry an uncommitted or unanswered Acquire with the same id. Retries
//     more than two windows later, or after MaxIdempotencyRecords newer
//     requests, are granted afresh.
//  3. Answer the region only after the entry committed (ApplyFuture.Error
//     is nil) and with the Response, so no acknowledged grant can be lost
//     by a failover.
//  4. Read with the read methods (Now, Policy, Window, Grant, Stats...),
//     which take a read lock and return copies; never retain state across
//     Restore.
//  5. Upgrade every replica to understand a new command or snapshot format
//     before any leader writes it: a replica that rejects an entry others
//     accept diverges. So does one that applies an entry by another rule:
//     builds before the carried tokens (see Publish) grant a reset pool in
//     full, and builds before expired leases were carried leave them out,
//     so publish no window change or quota removal while replicas of an
//     older build serve (their snapshots restore on the new build, not the
//     other way round: see Snapshots).
//     Likewise, builds before MaxHeldPerRegion refuse a spec that sets it
//     (an unknown field): publish no cap while they serve. Builds before
//     SetCluster refuse that entry (which changes no grant, so they
//     diverge only in the id) and cannot restore a snapshot that carries
//     an id.
//  6. Report demand on every Acquire when a quota uses fair_share: a region
//     that reports none has no need, so under contention it gets no share.
package fsm
