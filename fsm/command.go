package fsm

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
)

// FormatV1 is the first byte of every encoded command in the current format.
// The rest of the entry is one JSON object (see Command). A future format
// gets a new byte; Decode rejects bytes it does not know, so every replica
// must understand a format before any leader proposes it.
const FormatV1 byte = 1

// CommandType says which payload of a Command is set.
type CommandType uint8

// The command types. Zero is not a valid type.
const (
	// CmdAcquire grants chunks of one or more quotas to a region.
	CmdAcquire CommandType = 1
	// CmdRelease returns unspent tokens of a grant to its window's pool.
	CmdRelease CommandType = 2
	// CmdPublishPolicy publishes a new policy version and its quota specs.
	CmdPublishPolicy CommandType = 3
	// CmdSetMember records or removes an allocator member's API address.
	CmdSetMember CommandType = 4
	// CmdBatch carries several Acquire and Release commands that the leader
	// group-committed into one entry; each is applied in order as if it were
	// its own entry at the batch's time, and fails or succeeds on its own.
	CmdBatch CommandType = 5
	// CmdSetCluster records the cluster's identity, once: the first leader
	// of a cluster proposes a random id, and every later one is ignored.
	CmdSetCluster CommandType = 6
)

// MaxBatch is the most commands one CmdBatch entry carries.
const MaxBatch = 256

// String returns the command type's name.
func (t CommandType) String() string {
	switch t {
	case CmdAcquire:
		return "acquire"
	case CmdRelease:
		return "release"
	case CmdPublishPolicy:
		return "publish_policy"
	case CmdSetMember:
		return "set_member"
	case CmdBatch:
		return "batch"
	case CmdSetCluster:
		return "set_cluster"
	}
	return fmt.Sprintf("CommandType(%d)", uint8(t))
}

// Command is one Raft log entry. Exactly the payload named by Type is set.
type Command struct {
	// Type selects the payload.
	Type CommandType `json:"type"`
	// NowUnixMs is the leader's wall clock when it proposed the entry, in
	// Unix milliseconds. It is the only time the state machine knows.
	NowUnixMs int64 `json:"now_unix_ms"`
	// Acquire is set for CmdAcquire.
	Acquire *Acquire `json:"acquire,omitempty"`
	// Release is set for CmdRelease.
	Release *Release `json:"release,omitempty"`
	// Publish is set for CmdPublishPolicy.
	Publish *Publish `json:"publish,omitempty"`
	// Member is set for CmdSetMember.
	Member *SetMember `json:"member,omitempty"`
	// Batch is set for CmdBatch: Acquire and Release commands only (their own
	// NowUnixMs is ignored; the batch's applies).
	Batch []Command `json:"batch,omitempty"`
	// Cluster is set for CmdSetCluster.
	Cluster *SetCluster `json:"cluster,omitempty"`
}

// Want is one quota's share of an Acquire batch.
type Want struct {
	// Quota names the quota.
	Quota string `json:"quota"`
	// Tokens is the chunk asked for; 0 means the quota's ChunkTokens.
	Tokens int64 `json:"tokens"`
	// DemandPerSecond is the region's observed demand for the quota.
	DemandPerSecond float64 `json:"demand_per_second"`
	// Next asks for a pre-grant: tokens of the window after the current
	// one, which the region may spend from that window's start, so that
	// a window turn costs it no round trip to the allocator. Only for a
	// quota with clamp on (with clamp off leases already outlive the
	// window), and only in the second half of the current window (earlier
	// asks get nothing). Before a window opens a region holds at most
	// ChunkTokens of it; a pre-grant's TTL runs from the window's start.
	Next bool `json:"next,omitempty"`
}

// Acquire asks for chunks of several quotas for one region in one entry.
type Acquire struct {
	// Region is the asking region.
	Region string `json:"region"`
	// RequestID makes retries idempotent: a second Acquire with the same
	// region and request id returns the first one's result.
	RequestID string `json:"request_id"`
	// Wants lists the quotas asked for, each at most once.
	Wants []Want `json:"wants"`
}

// Release returns unspent tokens of a grant.
type Release struct {
	// Region must be the region the grant was made to.
	Region string `json:"region"`
	// GrantID names the grant.
	GrantID string `json:"grant_id"`
	// Tokens is the number of tokens returned.
	Tokens int64 `json:"tokens"`
	// RequestID, when set, makes retries idempotent like Acquire's. Without
	// it a retried Release returns the tokens again, up to the grant.
	RequestID string `json:"request_id,omitempty"`
}

// Strategy selects how a quota's pool is shared between regions.
type Strategy string

// The allocation strategies.
const (
	// StrategyDemand grants whatever is asked while the pool lasts.
	StrategyDemand Strategy = "demand"
	// StrategyFairShare caps a grant, when the pool cannot cover every
	// region's reported need, at the region's max-min fair share.
	StrategyFairShare Strategy = "fair_share"
)

// QuotaSpec is one global quota as published in a policy.
type QuotaSpec struct {
	// Name identifies the quota.
	Name string `json:"name"`
	// Limit is G, the tokens available per window.
	Limit int64 `json:"limit"`
	// WindowMs is the window length W; windows are aligned to multiples of W.
	WindowMs int64 `json:"window_ms"`
	// ChunkTokens is the chunk granted when a want asks for 0 tokens.
	ChunkTokens int64 `json:"chunk_tokens"`
	// TTLMs is the lease duration of a grant.
	TTLMs int64 `json:"ttl_ms"`
	// Clamp ends every lease at the end of its window.
	Clamp bool `json:"clamp"`
	// Strategy is the allocation strategy; empty means StrategyDemand.
	Strategy Strategy `json:"strategy"`
	// FallbackPerRegion is the tokens a cut-off region may admit locally per
	// window. The state machine only records it, for the overshoot bound.
	FallbackPerRegion int64 `json:"fallback_per_region"`
	// MaxHeldPerRegion, when positive, caps the tokens one region holds of
	// the pool (of each instance, for a template): a grant never leaves the
	// region holding more than it in unreleased tokens of grants that have
	// not expired, over the windows the state machine keeps (the previous,
	// the current and the next). 0 means no cap. It needs TTLMs <=
	// WindowMs, so that no older window holds a live grant.
	MaxHeldPerRegion int64 `json:"max_held_per_region,omitempty"`
	// Regions, when not empty, are the only regions that may acquire the
	// quota. Stored sorted.
	Regions []string `json:"regions,omitempty"`
	// TemplateKeys, when positive, makes the quota a template: it has no
	// pool of its own, and each name "<Name>/<value 1>/.../<value
	// TemplateKeys>" (policy.InstanceName's syntax, or its hashed form
	// "<Name>/#<32 hex digits>") is a pool of its own with this spec, an
	// instance, alive from the first Acquire that names it until it holds
	// nothing visible. It is the number of the template rule's value-less
	// match entries.
	TemplateKeys int `json:"template_keys,omitempty"`
}

// Publish publishes a new policy version.
type Publish struct {
	// ExpectedVersion must be the current version plus one (1 for the first).
	ExpectedVersion uint64 `json:"expected_version"`
	// Author is who published, for the audit trail.
	Author string `json:"author"`
	// Reason is why, for the audit trail.
	Reason string `json:"reason"`
	// Document is the canonical policy text the quotas were derived from.
	Document []byte `json:"document"`
	// Quotas replaces every quota spec.
	Quotas []QuotaSpec `json:"quotas"`
}

// SetMember records the API address of an allocator member (a Raft server),
// so that every replica can point clients at the leader, or removes it.
type SetMember struct {
	// ID is the member's Raft server ID.
	ID string `json:"id"`
	// APIAddress is the member's API address; empty when Remove is set.
	APIAddress string `json:"api_address,omitempty"`
	// Remove deletes the member's entry; removing an absent one is a no-op.
	Remove bool `json:"remove,omitempty"`
}

// SetCluster names the cluster. The id tells this cluster's state apart from
// another's made with the same node ids and addresses (a cluster torn down
// and founded again), so that a node can refuse to start on another
// cluster's data dir (see package allocator).
type SetCluster struct {
	// ID is the cluster's id: 1 to MaxClusterIDBytes letters, digits, '-'
	// or '_'.
	ID string `json:"id"`
}

// Encode returns the log entry bytes of c: FormatV1 followed by c as JSON.
// It fails only on values JSON cannot carry (a NaN or infinite demand).
func Encode(c Command) ([]byte, error) {
	var buf bytes.Buffer
	buf.WriteByte(FormatV1)
	if err := json.NewEncoder(&buf).Encode(c); err != nil {
		return nil, fmt.Errorf("encode %s: %w", c.Type, err)
	}
	return bytes.TrimRight(buf.Bytes(), "\n"), nil
}

// Decode parses log entry bytes written by Encode. Unknown formats, unknown
// JSON fields, trailing data and a payload that does not match the type are
// rejected with ErrMalformedCommand. Decode does not validate values; Apply
// does.
func Decode(b []byte) (Command, error) {
	var c Command
	if len(b) == 0 {
		return c, fmt.Errorf("command: empty entry: %w", ErrMalformedCommand)
	}
	if b[0] != FormatV1 {
		return c, fmt.Errorf("command: format version %d unsupported: %w", b[0], ErrMalformedCommand)
	}
	dec := json.NewDecoder(bytes.NewReader(b[1:]))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&c); err != nil {
		return Command{}, fmt.Errorf("command: %w: %w", ErrMalformedCommand, err)
	}
	if _, err := dec.Token(); err != io.EOF {
		return Command{}, fmt.Errorf("command: trailing data after JSON object: %w", ErrMalformedCommand)
	}
	set := 0
	for _, p := range []bool{c.Acquire != nil, c.Release != nil, c.Publish != nil, c.Member != nil, c.Batch != nil, c.Cluster != nil} {
		if p {
			set++
		}
	}
	var ok bool
	switch c.Type {
	case CmdAcquire:
		ok = c.Acquire != nil
	case CmdRelease:
		ok = c.Release != nil
	case CmdPublishPolicy:
		ok = c.Publish != nil
	case CmdSetMember:
		ok = c.Member != nil
	case CmdSetCluster:
		ok = c.Cluster != nil
	case CmdBatch:
		ok = len(c.Batch) > 0 && len(c.Batch) <= MaxBatch
		for i, sub := range c.Batch {
			subOK := (sub.Type == CmdAcquire && sub.Acquire != nil && sub.Release == nil) ||
				(sub.Type == CmdRelease && sub.Release != nil && sub.Acquire == nil)
			if !subOK || sub.Publish != nil || sub.Member != nil || sub.Batch != nil || sub.Cluster != nil {
				return Command{}, fmt.Errorf("command: batch[%d]: only acquire or release with exactly its payload: %w", i, ErrMalformedCommand)
			}
		}
	default:
		return Command{}, fmt.Errorf("command: type %d unknown: %w", uint8(c.Type), ErrMalformedCommand)
	}
	if !ok || set != 1 {
		return Command{}, fmt.Errorf("command: type %s needs exactly its own payload: %w", c.Type, ErrMalformedCommand)
	}
	return c, nil
}

// The errors Apply returns, wrapped with the name of the offending field.
// Match them with errors.Is.
var (
	// ErrUnknownQuota means a want names a quota the current policy lacks,
	// or an instance of a template it lacks or of a single pool.
	ErrUnknownQuota = errors.New("unknown quota")
	// ErrInvalidArgument means a field of a command is out of range.
	ErrInvalidArgument = errors.New("invalid argument")
	// ErrStaleVersion means a Publish's ExpectedVersion is not current+1.
	ErrStaleVersion = errors.New("stale policy version")
	// ErrUnknownGrant means a Release names a grant that is not (or no
	// longer) held: never made, or its window was garbage-collected.
	ErrUnknownGrant = errors.New("unknown grant")
	// ErrMalformedCommand means the entry bytes could not be decoded.
	ErrMalformedCommand = errors.New("malformed command")
	// ErrResourceExhausted means an Acquire would create an instance of a
	// template beyond MaxInstancesPerTemplate.
	ErrResourceExhausted = errors.New("resource exhausted")
)
