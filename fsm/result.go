package fsm

// AcquireResult is Apply's response to an Acquire.
type AcquireResult struct {
	// Region and RequestID echo the request.
	Region    string `json:"region"`
	RequestID string `json:"request_id"`
	// NowUnixMs is the state machine's time when the grants were made: the
	// leader's stamp, or the previous entry's if that was later. Agents pass
	// it to lease.Deadline as the leader's now.
	NowUnixMs int64 `json:"now_unix_ms"`
	// Replayed is set when this is the recorded result of an earlier Acquire
	// with the same region and request id; nothing new was granted.
	Replayed bool `json:"replayed"`
	// Grants has one entry per want, in the order of the wants.
	Grants []GrantResult `json:"grants"`
}

// GrantResult is the outcome of one want.
type GrantResult struct {
	// Quota names the quota.
	Quota string `json:"quota"`
	// GrantID identifies the grant for Release; empty when Tokens is 0.
	GrantID string `json:"grant_id,omitempty"`
	// Requested is the chunk asked for (the quota's ChunkTokens for 0).
	Requested int64 `json:"requested"`
	// Tokens is the chunk granted; it never exceeds the pool at the grant.
	Tokens int64 `json:"tokens"`
	// WindowIndex is the window the tokens belong to.
	WindowIndex int64 `json:"window_index"`
	// WindowEndUnixMs is the end of that window (when the pool refills).
	WindowEndUnixMs int64 `json:"window_end_unix_ms"`
	// NotBeforeUnixMs is, for a pre-grant (Want.Next), the start of its
	// window: the region must not spend the tokens before it. 0 otherwise.
	NotBeforeUnixMs int64 `json:"not_before_unix_ms,omitempty"`
	// ExpiresUnixMs is the lease expiry on the allocator's clock; 0 when
	// nothing was granted.
	ExpiresUnixMs int64 `json:"expires_unix_ms"`
	// TTLMs is ExpiresUnixMs - NowUnixMs; 0 when nothing was granted.
	TTLMs int64 `json:"ttl_ms"`
	// PoolRemaining is the window's pool after this grant.
	PoolRemaining int64 `json:"pool_remaining"`
	// PoolExhausted is set when the grant emptied the pool, or the pool
	// (or, for fair_share, the region's fair share; for a pre-grant, its
	// chunk) made it smaller than asked. A grant cut short (possibly to 0)
	// only by the region's cap, QuotaSpec.MaxHeldPerRegion, does not set
	// it: the region gets more as its grants expire or are released,
	// before the window ends.
	PoolExhausted bool `json:"pool_exhausted"`
}

// ReleaseResult is Apply's response to a Release.
type ReleaseResult struct {
	// GrantID echoes the request.
	GrantID string `json:"grant_id"`
	// Returned is the tokens credited back: the request's tokens, or 0 when
	// the grant's window has ended (a pre-grant's window that has not
	// started yet takes them back).
	Returned int64 `json:"returned"`
	// PoolRemaining is the grant's window's pool after the release.
	PoolRemaining int64 `json:"pool_remaining"`
	// NowUnixMs is the state machine's time of the release.
	NowUnixMs int64 `json:"now_unix_ms"`
	// Replayed is set when this is the recorded result of an earlier
	// Release with the same region and request id.
	Replayed bool `json:"replayed"`
}

// PublishResult is Apply's response to a Publish.
type PublishResult struct {
	// Policy is a copy of the record now current, document and normalized
	// quotas included.
	Policy PolicyRecord `json:"policy"`
	// Removed lists, sorted, the quotas the policy dropped (with their windows).
	Removed []string `json:"removed,omitempty"`
	// WindowsReset lists, sorted, the quotas whose window length (or
	// TemplateKeys) changed: their windows and grants were dropped and the
	// next touch opens a new window. The unreleased tokens of those grants
	// are carried, live or expired: every window their leases reach (from
	// the grant to its expiry) leaves room for them (WindowView.Carried),
	// including the window of the new length that the change lands in.
	// Removed quotas are carried the same way, should they come back.
	WindowsReset []string `json:"windows_reset,omitempty"`
}

// SetMemberResult is Apply's response to a SetMember.
type SetMemberResult struct {
	// ID echoes the request.
	ID string `json:"id"`
	// APIAddress is the address now recorded; empty after a removal.
	APIAddress string `json:"api_address"`
	// Removed is set when an existing entry was deleted.
	Removed bool `json:"removed"`
}

// SetClusterResult is Apply's response to a SetCluster.
type SetClusterResult struct {
	// ID is the cluster's id after the command: the earlier one when the
	// cluster had one already.
	ID string `json:"id"`
	// Set is true when this command set it.
	Set bool `json:"set"`
}

// PolicyRecord is one published policy version. Records are immutable.
type PolicyRecord struct {
	// Version numbers policies from 1 without gaps.
	Version uint64 `json:"version"`
	// Author and Reason are the audit trail's who and why.
	Author string `json:"author"`
	Reason string `json:"reason"`
	// PublishedUnixMs is the audit trail's when (the state machine's time).
	PublishedUnixMs int64 `json:"published_unix_ms"`
	// Document is the canonical policy text.
	Document []byte `json:"document"`
	// Quotas are the specs of this version, sorted by name.
	Quotas []QuotaSpec `json:"quotas"`
	// Digest is the SHA-256 of Document, in hex. It is kept when a copy
	// leaves Document out (PolicyHistory). Being derived from Document, it
	// is not written into snapshots but computed again on Restore.
	Digest string `json:"-"`
}

// WindowView is a copy of one window of one quota.
type WindowView struct {
	// Quota names the quota; empty in the zero view of an unknown quota.
	Quota string
	// Index is the window index; [StartUnixMs, EndUnixMs) its span.
	Index       int64
	StartUnixMs int64
	EndUnixMs   int64
	// Limit is the window's G (the current spec's, if it changed mid-window).
	Limit int64
	// Carried is the tokens the pool leaves room for because a publish
	// reset the quota's pools (changed its window length or TemplateKeys,
	// or removed it and added it again): the unreleased tokens of the old
	// pools' grants whose leases reach into the window, live or expired,
	// since regions may have spent or may still spend them in its span;
	// and, for old windows the state machine no longer held, their whole
	// limit (see Publish in the package documentation). Limit - Carried is
	// what the window may still grant over its whole span.
	Carried int64
	// Granted and Released are tokens granted and released in the window.
	Granted  int64
	Released int64
	// Outstanding is Granted - Released: tokens regions may still hold or
	// have spent.
	Outstanding int64
	// Expired is the unreleased tokens of grants whose lease has ended by the
	// view's time. The allocator cannot know how many of them were spent.
	Expired int64
	// Remaining is the pool: max(0, Limit - Carried - Outstanding).
	Remaining int64
	// Regions has one row per region with a grant in the window or a fresh
	// demand report, sorted by region.
	Regions []RegionView
	// Grants lists the window's grants in the order they were made.
	Grants []GrantView
}

// RegionView is one region's row of a WindowView.
type RegionView struct {
	// Region names the region.
	Region string
	// Granted, Released, Outstanding and Expired are as in WindowView,
	// restricted to the region.
	Granted     int64
	Released    int64
	Outstanding int64
	Expired     int64
	// Grants is the number of grants the region holds in the window.
	Grants int
	// DemandPerSecond is the region's last demand report, if fresh (not
	// older than twice the quota's TTL); 0 otherwise.
	DemandPerSecond float64
	// DemandReportedUnixMs is when that report arrived; 0 when none is fresh.
	DemandReportedUnixMs int64
}

// GrantView is a copy of one grant.
type GrantView struct {
	// ID identifies the grant.
	ID string
	// Quota and Region say what was granted to whom.
	Quota  string
	Region string
	// WindowIndex is the window the tokens belong to.
	WindowIndex int64
	// Tokens were granted; Released of them were returned.
	Tokens   int64
	Released int64
	// GrantedUnixMs and ExpiresUnixMs bound the lease.
	GrantedUnixMs int64
	ExpiresUnixMs int64
}

// Stats are counters for metrics.
type Stats struct {
	// NowUnixMs is the state machine's time.
	NowUnixMs int64
	// PolicyVersion is the current policy version (0 before the first).
	PolicyVersion uint64
	// Quotas is the number of quotas in the current policy (single pools
	// and templates).
	Quotas int
	// Instances counts the instances of templates in memory, including
	// dead ones not yet garbage-collected.
	Instances int
	// Windows and Grants count retained windows and grant records,
	// including old ones not yet garbage-collected.
	Windows int
	Grants  int
	// IdempotencyRecords counts retained request ids.
	IdempotencyRecords int
	// TokensGranted is the tokens granted since the first entry (saturating).
	TokensGranted int64
}

func (r *AcquireResult) clone() *AcquireResult {
	c := *r
	c.Grants = append([]GrantResult(nil), r.Grants...)
	return &c
}

func (r *ReleaseResult) clone() *ReleaseResult {
	c := *r
	return &c
}

func cloneSpec(s QuotaSpec) QuotaSpec {
	if s.Regions != nil {
		s.Regions = append([]string(nil), s.Regions...)
	}
	return s
}

// clone deep-copies r; with full false it leaves Document and Quotas out
// (Digest stays).
func (r *PolicyRecord) clone(full bool) PolicyRecord {
	c := *r
	c.Document, c.Quotas = nil, nil
	if full {
		if r.Document != nil {
			c.Document = append([]byte{}, r.Document...)
		}
		c.Quotas = make([]QuotaSpec, len(r.Quotas))
		for i, s := range r.Quotas {
			c.Quotas[i] = cloneSpec(s)
		}
	}
	return c
}
