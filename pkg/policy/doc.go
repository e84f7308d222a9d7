// Package policy is allot's policy schema: parsing, validation, canonical
// encoding, the derivation of leased global quotas, and descriptor matching.
//
// The package is pure. It reads no clock, does no I/O, and keeps no
// package-level mutable state; every function is deterministic.
//
// # Documents
//
// A policy [Document] is YAML (JSON is accepted too, since JSON is YAML). It
// names the regions that lease global quotas and lists rules. Each [Rule] says
// which requests it governs (its ordered [Match] entries), how to count them
// (its [Kind]: fixed_window, sliding_window, token_bucket, concurrency or
// global_quota), whose counter a request is charged to (its [Scope]), and what
// gateways do when the regional store cannot answer (its [FailMode]).
// examples/northstar.yaml is the annotated reference policy.
//
// A document carries no version number: the allocator assigns the version when
// it publishes a document through Raft. [Digest] identifies the content.
//
// # Usage
//
//  1. [Parse] the bytes. Parsing is strict: unknown fields, wrong scalar types,
//     duplicate keys, merge keys, custom tags and multiple YAML documents are
//     errors, and every semantic rule of [Document.Validate] is checked. Errors
//     wrap [ErrInvalid] and name the field, e.g. "rules[2].cost: 30 exceeds
//     capacity 20". Parse returns a normalized document: defaults filled in,
//     regions and rules sorted by name.
//  2. Store or hash the [Canonical] encoding ([Digest] is its SHA-256). The
//     canonical form is deterministic, so equal policies have equal digests
//     whatever their source order or formatting, and Parse(Canonical(d))
//     equals d.
//  3. Derive the leased pools with [Document.GlobalQuotas] (the allocator;
//     [Document.Quota] resolves a pool by name, template instances included)
//     and match request descriptors with a [Matcher] from [Compile] (the
//     agents and gateways). A Document must not be modified once it is
//     shared.
//  4. Show operators what a new version changes with [Diff].
//
// # Matching
//
// A request descriptor is a list of [Entry] values (ip, tenant, user, route,
// ...). A rule matches when every one of its match entries is present in the
// descriptor: an entry with a value must be equal, an entry without a value
// matches any non-empty value and makes one counter per distinct value. The
// order of entries in the request does not matter; a key that occurs twice in
// a request is taken from its first occurrence; an entry with an empty value
// counts as absent (an empty user must never become one shared counter).
//
// A global_quota rule is one leased pool when every match entry has a value.
// With entries without a value it is a quota template: each distinct tuple
// of the request's values for them (in match order) gets a pool of its own,
// an instance, with the rule's limit, window and lease; "every tenant: 1,000
// requests per minute worldwide" is the rule
//
//	name: p-tenant-standard
//	scope: tenant
//	match: [{key: tenant}]
//	kind: global_quota
//	limit: 1000
//	window: 1m
//
// [Matched.Instance] names the instance a request is charged to,
// [InstanceName] writes such names ("p-tenant-standard/birch") and
// [ParseInstanceName] reads them back. A template and a rule with a fixed
// value for the same key are two rules like any others: a request of Atlas
// that matches both p-tenant-atlas and the template is charged to both
// pools, and both must allow it (a conjunction, as for every rule). A
// template cannot use gateway-local chunks (lease.gateway_chunk). Instance
// names carry the values in clear to the allocator (its state, snapshots
// and operator views) and to the regional store's key names, unlike the
// counters of other rules, whose wildcard values are hashed: key templates
// by identifiers that may be shown, such as tenant or plan ids, not by users
// or client addresses. Validate refuses a template with an entry without a
// value whose key names principals or credentials (ip, remote_address,
// client_ip, user, user_id, email, api_key, apikey, token, authorization,
// client_id, session, session_id): its pools would name them in clear, one
// per client. Other keys are the operator's to choose well.
//
// Matched rules come back in the fixed evaluation order: ip, global, tenant,
// user, route, and by rule name within a scope. The ip scope comes first
// because it is the pre-authentication stage: it must run before identity
// exists (reference chapter 8). The remaining order is the reference's
// "global protection, then tenant, then user, then route" (chapter 9), so the
// denying rule a client is told about is deterministic.
package policy
