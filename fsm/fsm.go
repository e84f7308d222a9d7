package fsm

import (
	"cmp"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"math"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"

	"github.com/hashicorp/raft"

	"github.com/allot-dev/allot/pkg/lease"
)

// Limits on command fields. Values beyond them are rejected with
// ErrInvalidArgument; they keep every sum far from int64 overflow.
const (
	// MaxRegionBytes bounds a region name.
	MaxRegionBytes = 64
	// MaxRequestIDBytes bounds a request id.
	MaxRequestIDBytes = 128
	// MaxGrantIDBytes bounds a grant id in a Release.
	MaxGrantIDBytes = 64
	// MaxWants bounds the wants of one Acquire: a region renews every
	// quota it needs in one call per tick, and 16,384 wants with names of
	// MaxQuotaNameBytes still fit the allocator's default 4 MiB body limit,
	// request and answer (pkg/allocator measures it).
	MaxWants = 16_384
	// MaxQuotaNameBytes bounds a quota name, template instances included
	// (policy.MaxInstanceNameBytes).
	MaxQuotaNameBytes = 128
	// MaxQuotas bounds the quotas of one policy.
	MaxQuotas = 1_000_000
	// MaxTemplateKeys bounds a template's value-less match entries
	// (policy.MaxMatchEntries).
	MaxTemplateKeys = 16
	// MaxInstancesPerTemplate bounds the live instances of one template;
	// an Acquire that would create more fails with ErrResourceExhausted.
	MaxInstancesPerTemplate = 1_000_000
	// MaxRegionsPerQuota bounds a quota's declared regions.
	MaxRegionsPerQuota = 1000
	// MaxLimit bounds a quota's limit (about 10^15 tokens per window).
	MaxLimit = 1 << 50
	// MaxWindowMs bounds a window length and a lease TTL (366 days).
	MaxWindowMs = 366 * 24 * 3600 * 1000
	// MaxDocumentBytes bounds a policy document.
	MaxDocumentBytes = 8 << 20
	// MaxAuthorBytes bounds a policy author.
	MaxAuthorBytes = 256
	// MaxReasonBytes bounds a policy reason.
	MaxReasonBytes = 4096
	// MaxNowUnixMs is the latest accepted leader stamp: 9999-12-31T23:59:59.999Z.
	MaxNowUnixMs = 253402300799999
	// MaxMemberIDBytes bounds a member's Raft server ID.
	MaxMemberIDBytes = 256
	// MaxAPIAddressBytes bounds a member's API address.
	MaxAPIAddressBytes = 256
	// MaxClusterIDBytes bounds the cluster's id.
	MaxClusterIDBytes = 64
	// MaxMembers bounds the member table.
	MaxMembers = 1000
)

// Retention limits.
const (
	// HistoryVersions is the number of policy versions kept, documents
	// included; older versions are dropped from PolicyHistory and snapshots.
	HistoryVersions = 64
	// MaxIdempotencyRecords bounds the retained request ids. The oldest are
	// evicted first; a retry of an evicted request is granted afresh.
	MaxIdempotencyRecords = 100_000
	// MaxIdempotencyGrants bounds the grant results kept in retained
	// records (an Acquire may carry up to MaxWants of them).
	MaxIdempotencyGrants = 1_000_000
	// gcPerApply is the number of quotas whose old windows each successful
	// Apply collects, round robin, besides the quotas it touches.
	gcPerApply = 4
)

// FSM is allot's allocator state machine. It implements raft.FSM; see the
// package documentation. The zero value is not usable: call New.
type FSM struct {
	mu sync.RWMutex
	s  *state
}

var _ raft.FSM = (*FSM)(nil)

// New returns an empty state machine: no policy, no quotas, time zero.
func New() *FSM {
	return &FSM{s: newState()}
}

// state is everything Apply changes. It is only touched under FSM.mu.
type state struct {
	now           int64
	history       []*PolicyRecord // ascending versions; the last is current
	quotas        map[string]*quota
	names         []string // quota names, sorted
	templates     []string // the names of the templates among them, sorted
	tmplCursor    int
	instances     int // instances in memory, of every template
	maxWindowMs   int64
	grants        map[string]*grantRef
	idem          map[idemKey]*idemRecord
	idemQ         []*idemRecord // insertion order, hence ascending at
	idemHead      int
	idemGrants    int
	gcCursor      int
	windows       int
	tokensGranted int64
	// lastGrantIndex is the log index of the latest entry that made a
	// grant. Grant ids are "<log index>-<want>", so an entry at or below it
	// could repeat an id and is rejected.
	lastGrantIndex uint64
	// members maps Raft server IDs to API addresses.
	members map[string]string
	// clusterID is the cluster's id; empty until a SetCluster.
	clusterID string
	// carries maps a pool's name (a single pool's, an instance's) or a
	// template's to the tokens that pools of that name reset by a publish
	// had granted and that may still be spent (see carry), in ascending
	// keys, then expires, at most one entry per pair. Entries that expired
	// more than MaxWindowMs before now are invisible; publish collapses old
	// ones (see collapseCarries).
	carries map[string][]carry
	// historyWindowMs holds, for each record of history, the longest window
	// of its quotas: carries are kept exact for the longest of them.
	historyWindowMs []int64
	// maxInstances is MaxInstancesPerTemplate; tests lower it.
	maxInstances int
}

func newState() *state {
	return &state{
		maxInstances: MaxInstancesPerTemplate,
		quotas:       map[string]*quota{},
		grants:       map[string]*grantRef{},
		idem:         map[idemKey]*idemRecord{},
		members:      map[string]string{},
		carries:      map[string][]carry{},
	}
}

// carry is one step of what a publish that reset pools (a changed window
// length or TemplateKeys, a removed quota) leaves behind: tokens the old
// pools granted (net of releases) that regions may spend until expires.
// Regions keep spending deposited tokens until their leases end, and may
// have spent those of expired leases at any time since they were granted,
// so every window opened for a pool of the same name leaves room for every
// step that ends after the window starts (expires > start), as if those
// tokens had been granted from it: its pool is max(0, limit - carried -
// outstanding). That holds for a window that began before the publish (the
// one the change lands in, for a longer window than before: its span
// overlaps the old windows), whether the old grants are live or expired, and
// for a re-added quota too, which is why steps are kept by name in the state
// and not in the quota.
//
// A reset records (see reset): one step per expiry of the old pool's grants
// in the windows the state machine holds (the previous, the current and the
// next), their exact tokens; and for the older windows of the same window
// length, which the state machine no longer holds, each counted as its
// whole limit (the most it can have granted), a step ending when their
// leases may last be spent. For a changed window length, only the old
// windows that the new length's window holding the publish reaches are
// counted, and a step of MaxLimit ends at that window's start: a window
// reaching further (a later, longer one) is left empty. A removal counts
// them all, since the length of a re-added quota is not known; windows
// older than the policy versions held count as MaxLimit.
//
// Steps are recorded under the name of each reset pool (a single pool, an
// instance) and, for a template, under the template's name: for its
// TemplateKeys, the sum over its instances (per old window); for
// TemplateKeys 0, what each instance may have of the windows no longer held
// (dead instances included). A window of a single pool leaves room for
// every step of its name; a window of an instance for every step of its own
// name and those of its template's name recorded for other TemplateKeys: an
// instance named by other values cannot be matched to the old instances
// (or to the old single pool), so it leaves room for all of them; steps of
// TemplateKeys 0 apply to every instance.
type carry struct {
	// keys is the TemplateKeys of the quota the step was recorded for (0
	// for a single pool, and for the steps of a template that apply to
	// each of its instances).
	keys int
	// tokens is the step's tokens, at most MaxLimit (more than any limit:
	// a pool is empty either way).
	tokens int64
	// expires is when the step's tokens may last be spent: the step counts
	// against every window that starts before it.
	expires int64
}

// countsIn reports whether c counts against a window starting at start.
func (c carry) countsIn(start int64) bool { return c.expires > start }

// visible reports whether c can still count against a window at now: no
// window is longer than MaxWindowMs.
func (c carry) visible(now int64) bool { return c.expires > now-MaxWindowMs }

type quota struct {
	name    string
	spec    *QuotaSpec        // points into the current PolicyRecord
	windows []*window         // ascending index
	demand  map[string]demand // by region; created lazily

	// A template (spec.TemplateKeys > 0) has no windows: it holds its
	// instances, by name and in two lists ordered by death (instance.go).
	instances map[string]*quota
	lists     [2]instList
	// An instance points to its template, its list and its neighbours
	// there; death is the first instant it holds nothing visible.
	tmpl       *quota
	list       uint8
	prev, next *quota
	death      int64
}

type demand struct {
	rate float64
	at   int64
}

type window struct {
	index int64
	limit int64
	// carried is the tokens of pools reset by a publish that may be spent
	// in the window: the steps that end after it starts (see carry); the
	// pool leaves room for them.
	carried  int64
	granted  int64
	released int64
	regions  map[string]*ledger
	grants   []*grant // in grant order
}

type ledger struct {
	granted  int64
	released int64
	// list is the region's grants of the window, in grant order; the first
	// dead of them hold nothing at the state's time or later (expired or
	// wholly released), so held skips them.
	list []*grant
	dead int
}

// held returns the unreleased tokens of l's grants that have not expired at
// now. now must not be earlier than at any previous call: the grants it
// finds dead at the front of the list are skipped from then on.
func (l *ledger) held(now int64) int64 {
	for l.dead < len(l.list) {
		if g := l.list[l.dead]; g.expires > now && g.tokens > g.released {
			break
		}
		l.dead++
	}
	var n int64
	for _, g := range l.list[l.dead:] {
		if g.expires > now {
			n = satAdd(n, g.tokens-g.released)
		}
	}
	return n
}

type grant struct {
	id        string
	region    string
	tokens    int64
	released  int64
	grantedAt int64
	expires   int64
}

type grantRef struct {
	q *quota
	w *window
	g *grant
}

type idemKind uint8

const (
	idemAcquire idemKind = 1
	idemRelease idemKind = 2
)

type idemKey struct {
	kind      idemKind
	region    string
	requestID string
}

type idemRecord struct {
	key     idemKey
	at      int64
	acquire *AcquireResult // stored privately; callers get clones
	release *ReleaseResult
	dead    bool // superseded by a newer record with the same key
}

func (r *idemRecord) size() int {
	if r.acquire != nil {
		return len(r.acquire.Grants)
	}
	return 0
}

// remaining is the window's pool: max(0, limit - carried - outstanding).
// Deriving it keeps a limit lowered below the outstanding tokens from going
// negative and keeps releases from refilling past the limit.
func (w *window) remaining() int64 {
	return max(0, w.limit-w.carried-(w.granted-w.released))
}

// carried returns the tokens of reset pools that a window of pool q
// starting at start leaves room for: the steps of q's name and, for an
// instance, those of its template's name recorded for other TemplateKeys
// (0 included), that end after start.
func (s *state) carried(q *quota, start int64) int64 {
	var n int64
	for _, c := range s.carries[q.name] {
		if c.countsIn(start) {
			n = satAdd(n, c.tokens)
		}
	}
	if t := q.tmpl; t != nil {
		for _, c := range s.carries[t.name] {
			if c.countsIn(start) && c.keys != t.spec.TemplateKeys {
				n = satAdd(n, c.tokens)
			}
		}
	}
	return min(n, MaxLimit)
}

// carriedInto is carried for window idx of q: the steps that end after the
// window starts (a window opened early, for a pre-grant, does not leave
// room for clamped leases that end at its start; one opened late, after
// old leases ended, still does, since they may have been spent in it).
func (s *state) carriedInto(q *quota, idx int64) int64 {
	return s.carried(q, lease.WindowStart(idx, q.spec.WindowMs))
}

// addCarry adds steps (ascending expires, each once, tokens > 0) to those
// of name and keys, merging steps of equal expiry.
func (s *state) addCarry(name string, keys int, steps []carry) {
	if len(steps) == 0 {
		return
	}
	cs := s.carries[name]
	lo, _ := slices.BinarySearchFunc(cs, keys, func(c carry, k int) int { return cmp.Compare(c.keys, k) })
	hi := lo
	for hi < len(cs) && cs[hi].keys == keys {
		hi++
	}
	old := cs[lo:hi]
	merged := make([]carry, 0, len(old)+len(steps))
	i, j := 0, 0
	for i < len(old) || j < len(steps) {
		switch {
		case j == len(steps) || i < len(old) && old[i].expires < steps[j].expires:
			merged = append(merged, old[i])
			i++
		case i == len(old) || steps[j].expires < old[i].expires:
			merged = append(merged, carry{keys: keys, tokens: min(steps[j].tokens, MaxLimit), expires: steps[j].expires})
			j++
		default:
			merged = append(merged, carry{keys: keys, tokens: min(satAdd(old[i].tokens, steps[j].tokens), MaxLimit), expires: old[i].expires})
			i++
			j++
		}
	}
	s.carries[name] = slices.Concat(cs[:lo], merged, cs[hi:])
}

// carryRetention is how long after it ends a step is kept exact: the
// longest window of the policy versions held, so that a window of any of
// them (a quota re-added as it was, say) that starts before the step ends
// finds it.
func (s *state) carryRetention() int64 {
	var r int64
	for _, w := range s.historyWindowMs {
		r = max(r, w)
	}
	return r
}

// carryFamily is the name whose steps of TemplateKeys 0 apply to every
// pool named like name: a single pool's own, an instance's template's.
func carryFamily(name string) string {
	if t, _, ok := strings.Cut(name, instanceSep); ok {
		return t
	}
	return name
}

// collapseCarries forgets the steps that can no longer count against a
// window of the policy versions held (see carryRetention): each family's
// are replaced by one step of MaxLimit tokens under its name and
// TemplateKeys 0, ending with the latest of them, so that a window of a
// longer length published later that starts before they end is left empty
// rather than told they were never granted. Steps no window can reach (see
// carry.visible) go without a trace. It runs on publish, so that replicas
// restored from a snapshot and replicas that applied the log collapse the
// same steps at the same entries.
func (s *state) collapseCarries(now int64) {
	cutoff := now - s.carryRetention()
	tombs := map[string]int64{}
	for name, cs := range s.carries { // per name: the order does not matter
		cs = slices.DeleteFunc(cs, func(c carry) bool {
			switch {
			case !c.visible(now):
				return true
			case c.expires <= cutoff:
				f := carryFamily(name)
				tombs[f] = max(tombs[f], c.expires)
				return true
			}
			return false
		})
		if len(cs) == 0 {
			delete(s.carries, name)
		} else {
			s.carries[name] = cs
		}
	}
	for f, e := range tombs { // one step per name: the order does not matter
		s.addCarry(f, 0, []carry{{tokens: MaxLimit, expires: e}})
	}
}

// grantSteps returns the steps of the unreleased tokens of grants: one per
// expiry, ascending.
func grantSteps(grants []*grant) []carry {
	var steps []carry
	for _, g := range grants {
		if n := g.tokens - g.released; n > 0 {
			steps = append(steps, carry{tokens: n, expires: g.expires})
		}
	}
	slices.SortFunc(steps, func(a, b carry) int { return cmp.Compare(a.expires, b.expires) })
	out := steps[:0]
	for _, c := range steps {
		if k := len(out) - 1; k >= 0 && out[k].expires == c.expires {
			out[k].tokens = satAdd(out[k].tokens, c.tokens)
		} else {
			out = append(out, c)
		}
	}
	return out
}

// reset drops q's pools (a single pool's windows, a template's instances)
// for a publish at now that replaces q's spec by next (nil when q is
// removed), recording first as steps (see carry) every token they may have
// spent in a window that could still open: the unreleased tokens of the
// grants of the windows held, live or expired, under each pool's name;
// for a template their sum per window under the template's name; and the
// older windows of q's window length (see forgottenCarry). It reports
// whether there were any windows or instances.
func (s *state) reset(q *quota, now int64, next *QuotaSpec) bool {
	keys := q.spec.TemplateKeys
	pools := []*quota{q}
	if q.isTemplate() {
		pools = q.instanceList()
	}
	// A template's sum, per window held: the previous, current and next.
	prev := q.currentIndex(now) - 1
	var sums [3]carry
	var grants []*grant
	for _, p := range pools {
		grants = grants[:0]
		for _, w := range p.windows {
			if !p.visible(w.index, now) {
				continue
			}
			grants = append(grants, w.grants...)
			if k := w.index - prev; q.isTemplate() && k >= 0 && k < int64(len(sums)) {
				for _, c := range grantSteps(w.grants) {
					sums[k].tokens = satAdd(sums[k].tokens, c.tokens)
					sums[k].expires = max(sums[k].expires, c.expires)
				}
			}
		}
		s.addCarry(p.name, keys, grantSteps(grants))
	}
	if q.isTemplate() {
		var steps []carry
		for _, c := range sums { // ascending windows, but not always expiries
			if c.tokens > 0 {
				steps = append(steps, c)
			}
		}
		slices.SortFunc(steps, func(a, b carry) int { return cmp.Compare(a.expires, b.expires) })
		for _, c := range steps { // one at a time: two may end together
			s.addCarry(q.name, keys, []carry{c})
		}
	}
	s.forgottenCarry(q, now, next)
	return s.dropState(q)
}

// forgottenCarry records the steps of q's windows older than the previous
// one, which the state machine no longer holds, for a reset at now that
// replaces q's spec by next (nil for a removal). Each of them granted at
// most its limit, and those limits are at most the largest limit of the
// policy versions since q took its window length (see regime); their
// leases end by the window's end (clamped) or a TTL later. The windows of
// next's length start no earlier than the one holding now, so only the old
// windows whose leases may last until after it starts are counted, under
// q's name and TemplateKeys 0 (per pool: for a template, every instance may
// have had that much), with a step of MaxLimit until that start for
// windows that reach further (a later, longer one). A removal counts them
// all. For a template, the instances of other TemplateKeys (or a single
// pool of its name) leave room for all instances': MaxLimit.
func (s *state) forgottenCarry(q *quota, now int64, next *QuotaSpec) {
	wo := q.spec.WindowMs
	held := q.currentIndex(now) - 1 // the oldest window held
	first, known, limit, slack := s.regime(q.name, wo, q.spec.TemplateKeys)
	// tokens returns what the old windows may have spent in a window
	// starting at start (all of them for math.MinInt64).
	tokens := func(start int64) int64 {
		from := int64(math.MinInt64)
		if start != math.MinInt64 {
			from = lease.WindowIndex(start-slack, wo) // the first whose leases may outlive start
		}
		if !known && from < min(first, held) {
			return MaxLimit // windows older than the history can tell
		}
		if from = max(from, first); from >= held {
			return 0
		}
		return min(satMul(held-from, limit), MaxLimit)
	}
	all := tokens(math.MinInt64)
	if all == 0 {
		return
	}
	end := lease.WindowStart(held, wo) + slack // when their leases last end
	start := int64(math.MinInt64)
	if next != nil {
		start = lease.WindowStart(lease.WindowIndex(now, next.WindowMs), next.WindowMs)
	}
	var steps []carry
	if n := tokens(start); n < all {
		steps = append(steps, carry{tokens: MaxLimit, expires: min(start, end)})
		if n > 0 {
			steps = append(steps, carry{tokens: n, expires: end})
		}
	} else {
		steps = append(steps, carry{tokens: n, expires: end})
	}
	s.addCarry(q.name, 0, steps)
	if q.isTemplate() {
		s.addCarry(q.name, q.spec.TemplateKeys, []carry{{tokens: MaxLimit, expires: end}})
	}
}

// regime returns, for pool name of window length wo and TemplateKeys keys
// in the current policy, what the policy versions held tell of its windows
// since it took that length (the latest publish that added it, changed its
// window length or its TemplateKeys): the index of the first of them, the
// largest limit and the longest unclamped TTL (0 if always clamped) they
// had. When the history does not reach back to that publish, known is false
// and first is the first window that opened after the oldest version held:
// older windows' limits are unknown.
func (s *state) regime(name string, wo int64, keys int) (first int64, known bool, limit, slack int64) {
	i := len(s.history) - 1
	var since int64
	for ; i >= 0; i-- {
		qs := s.history[i].Quotas
		j, found := slices.BinarySearchFunc(qs, name, func(q QuotaSpec, n string) int { return strings.Compare(q.Name, n) })
		if !found || qs[j].WindowMs != wo || qs[j].TemplateKeys != keys {
			break
		}
		limit = max(limit, qs[j].Limit)
		if !qs[j].Clamp {
			slack = max(slack, qs[j].TTLMs)
		}
		since = s.history[i].PublishedUnixMs
	}
	if i >= 0 || s.history[0].Version == 1 {
		return lease.WindowIndex(since, wo), true, limit, slack
	}
	return lease.WindowIndex(since-1, wo) + 1, false, limit, slack
}

func (q *quota) currentIndex(now int64) int64 {
	return lease.WindowIndex(now, q.spec.WindowMs)
}

// visible reports whether window index idx is still part of the logical
// state at now: the current window and the previous one (and the next, once
// pre-granted from). Older windows may linger until collected but no
// result, view or snapshot shows them.
func (q *quota) visible(idx, now int64) bool {
	return idx >= q.currentIndex(now)-1
}

func (q *quota) freshDemand(r string, now int64) (demand, bool) {
	d, ok := q.demand[r]
	return d, ok && d.at >= now-2*q.spec.TTLMs
}

// Apply applies one committed log entry and returns *AcquireResult,
// *ReleaseResult, *PublishResult or an error wrapping one of the sentinel
// errors. An error leaves the state untouched. Entries other than
// raft.LogCommand return nil.
func (f *FSM) Apply(l *raft.Log) any {
	if l == nil || l.Type != raft.LogCommand {
		return nil
	}
	cmd, err := Decode(l.Data)
	if err != nil {
		return err
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	s := f.s
	if cmd.NowUnixMs < 0 || cmd.NowUnixMs > MaxNowUnixMs {
		return fmt.Errorf("%s: now_unix_ms %d: must be in [0, %d]: %w", cmd.Type, cmd.NowUnixMs, int64(MaxNowUnixMs), ErrInvalidArgument)
	}
	now := max(cmd.NowUnixMs, s.now)
	var res any
	switch cmd.Type {
	case CmdBatch:
		res = s.batch(l.Index, now, cmd.Batch)
	case CmdAcquire:
		res, err = s.acquire(l.Index, 0, now, cmd.Acquire)
	case CmdRelease:
		res, err = s.release(now, cmd.Release)
	case CmdPublishPolicy:
		res, err = s.publish(now, cmd.Publish)
	case CmdSetMember:
		res, err = s.setMember(cmd.Member)
	case CmdSetCluster:
		res, err = s.setCluster(cmd.Cluster)
	}
	if err != nil {
		return fmt.Errorf("%s: %w", cmd.Type, err)
	}
	s.now = now
	s.sweep()
	return res
}

func checkName(field, v string, maxBytes int) error {
	switch {
	case v == "":
		return fmt.Errorf("%s: must not be empty: %w", field, ErrInvalidArgument)
	case len(v) > maxBytes:
		return fmt.Errorf("%s: %d bytes, at most %d: %w", field, len(v), maxBytes, ErrInvalidArgument)
	}
	return nil
}

// BatchResult is what a CmdBatch entry returns: one result per command, in
// order, each either the command's result or its error.
type BatchResult struct {
	// Results holds an *AcquireResult, a *ReleaseResult or an error per command.
	Results []any
}

// batch applies each command of a CmdBatch entry on its own: one failing
// leaves the state as it was before that command and does not affect the
// others. Grant ids stay unique because want numbers continue across the
// entry's commands.
func (s *state) batch(index uint64, now int64, cmds []Command) *BatchResult {
	out := &BatchResult{Results: make([]any, len(cmds))}
	base := 0
	for i, c := range cmds {
		var (
			r   any
			err error
		)
		switch c.Type {
		case CmdAcquire:
			r, err = s.acquire(index, base, now, c.Acquire)
			base += len(c.Acquire.Wants)
		case CmdRelease:
			r, err = s.release(now, c.Release)
		}
		if err != nil {
			out.Results[i] = fmt.Errorf("%s: %w", c.Type, err)
			continue
		}
		out.Results[i] = r
	}
	return out
}

// grantID returns the id of the grant made for want number want of the
// entry at log index index.
func grantID(index uint64, want int) string {
	b := strconv.AppendUint(make([]byte, 0, 24), index, 10)
	b = append(b, '-')
	return string(strconv.AppendInt(b, int64(want), 10))
}

func (s *state) lookupIdem(k idemKey, now int64) *idemRecord {
	r, ok := s.idem[k]
	if !ok || now-r.at > 2*s.maxWindowMs {
		return nil
	}
	return r
}

func (s *state) record(r *idemRecord) {
	if old, ok := s.idem[r.key]; ok { // expired but not yet pruned
		old.dead = true
		s.idemGrants -= old.size()
	}
	s.idem[r.key] = r
	s.idemQ = append(s.idemQ, r)
	s.idemGrants += r.size()
}

// acquire applies one Acquire of the entry at index; base is the number of
// wants of the entry's earlier commands (0 unless the entry is a batch).
func (s *state) acquire(index uint64, base int, now int64, a *Acquire) (*AcquireResult, error) {
	if err := checkName("region", a.Region, MaxRegionBytes); err != nil {
		return nil, err
	}
	if err := checkName("request_id", a.RequestID, MaxRequestIDBytes); err != nil {
		return nil, err
	}
	key := idemKey{kind: idemAcquire, region: a.Region, requestID: a.RequestID}
	if r := s.lookupIdem(key, now); r != nil && r.acquire != nil {
		c := r.acquire.clone()
		c.Replayed = true
		return c, nil
	}
	if n := len(a.Wants); n < 1 || n > MaxWants {
		return nil, fmt.Errorf("wants: %d entries, want 1 to %d: %w", n, MaxWants, ErrInvalidArgument)
	}
	qs := make([]*quota, len(a.Wants))
	tmpls := make([]*quota, len(a.Wants)) // the template of an instance
	seen := make(map[string]int, len(a.Wants))
	var born, live map[*quota]int // per template: instances this Acquire creates, and those alive at now
	for i, w := range a.Wants {
		if w.Quota == "" || len(w.Quota) > MaxQuotaNameBytes {
			return nil, checkName(fmt.Sprintf("wants[%d].quota", i), w.Quota, MaxQuotaNameBytes)
		}
		q, t, err := s.lookupQuota(w.Quota, now)
		if err != nil {
			return nil, fmt.Errorf("wants[%d].quota %w", i, err)
		}
		if j, dup := seen[w.Quota]; dup {
			return nil, fmt.Errorf("wants[%d].quota %q: duplicate of wants[%d]: %w", i, w.Quota, j, ErrInvalidArgument)
		}
		seen[w.Quota] = i
		var spec *QuotaSpec
		if q != nil {
			spec = q.spec
		} else {
			spec = t.spec // an instance not alive yet: its template's spec
		}
		if w.Tokens < 0 || w.Tokens > spec.Limit {
			return nil, fmt.Errorf("wants[%d].tokens %d: must be in [0, limit %d]: %w", i, w.Tokens, spec.Limit, ErrInvalidArgument)
		}
		if !(w.DemandPerSecond >= 0) || math.IsInf(w.DemandPerSecond, 1) {
			return nil, fmt.Errorf("wants[%d].demand_per_second %v: must be finite and >= 0: %w", i, w.DemandPerSecond, ErrInvalidArgument)
		}
		if w.Next && !spec.Clamp {
			return nil, fmt.Errorf("wants[%d].next: quota %q has clamp off, so its leases already outlive the window: %w", i, w.Quota, ErrInvalidArgument)
		}
		if len(spec.Regions) > 0 {
			if _, ok := slices.BinarySearch(spec.Regions, a.Region); !ok {
				return nil, fmt.Errorf("region %q: not declared for wants[%d].quota %q: %w", a.Region, i, w.Quota, ErrInvalidArgument)
			}
		}
		if q == nil { // an instance not alive yet: it would be created
			if born == nil {
				born, live = map[*quota]int{}, map[*quota]int{}
			}
			if _, counted := live[t]; !counted {
				// Forgetting the instances dead at the state's time is
				// invisible, so it may happen before the command is known
				// to be valid; those that die between then and now are
				// counted out, and forgotten only if it is.
				s.expire(t, s.now)
				live[t] = len(t.instances) - t.deadBy(now)
			}
			born[t]++
			if live[t]+born[t] > s.maxInstances {
				return nil, fmt.Errorf("wants[%d].quota %q: template %q has %d live instances, at most %d: %w",
					i, w.Quota, t.name, live[t], s.maxInstances, ErrResourceExhausted)
			}
		}
		qs[i], tmpls[i] = q, t
	}
	if index < s.lastGrantIndex || (index == s.lastGrantIndex && base == 0) {
		// Raft never does this; grant ids would collide.
		return nil, fmt.Errorf("log index %d: not after %d, which already made grants: %w", index, s.lastGrantIndex, ErrInvalidArgument)
	}

	// Validated: from here on nothing fails.
	res := &AcquireResult{Region: a.Region, RequestID: a.RequestID, NowUnixMs: now, Grants: make([]GrantResult, len(a.Wants))}
	for i, wt := range a.Wants {
		q, t := qs[i], tmpls[i]
		if t != nil && q == nil {
			s.expire(t, now) // a dead instance of the same name goes first
			q = s.newInstance(t, wt.Quota)
		}
		s.collect(q, now)
		w := s.openWindow(q, q.currentIndex(now), now)
		start := lease.WindowEnd(w.index-1, q.spec.WindowMs) // of the granting window
		early := false
		if wt.Next {
			start = lease.WindowEnd(w.index, q.spec.WindowMs)
			// Pre-grants are made in the second half of a window only: an
			// ask sent before a turn and applied after it would otherwise
			// park tokens a whole window ahead. An early ask opens nothing.
			if early = start-now > q.spec.WindowMs/2; !early {
				w = s.openWindow(q, w.index+1, now)
			} else if w = q.window(w.index + 1); w == nil {
				idx := lease.WindowIndex(start, q.spec.WindowMs)
				w = &window{index: idx, limit: q.spec.Limit, carried: s.carriedInto(q, idx)}
			}
		}
		if q.demand == nil {
			q.demand = map[string]demand{}
		}
		q.demand[a.Region] = demand{rate: wt.DemandPerSecond, at: now}

		asked := wt.Tokens
		if asked == 0 {
			asked = q.spec.ChunkTokens
		}
		avail := w.remaining()
		switch {
		case early:
			avail = 0
		case wt.Next:
			// Before its window opens a region holds at most one chunk
			// of it, so pre-grants cannot drain a pool ahead of demand.
			var held int64
			if l := w.regions[a.Region]; l != nil {
				held = l.granted - l.released
			}
			avail = min(avail, max(0, q.spec.ChunkTokens-held))
		case q.spec.Strategy == StrategyFairShare:
			avail = min(avail, fairCap(q, w, a.Region, now))
		}
		// room is what the region may still take under its cap: a grant
		// never leaves it holding more than MaxHeldPerRegion, pre-grants
		// of the next window included.
		room := asked
		if held := q.spec.MaxHeldPerRegion; held > 0 {
			room = max(0, held-q.held(a.Region, now))
		}
		n := min(asked, avail, room)
		end := lease.WindowEnd(w.index, q.spec.WindowMs)
		gr := GrantResult{Quota: q.name, Requested: asked, WindowIndex: w.index, WindowEndUnixMs: end}
		if wt.Next {
			gr.NotBeforeUnixMs = start
		}
		if n > 0 {
			g := &grant{
				id:        grantID(index, base+i),
				region:    a.Region,
				tokens:    n,
				grantedAt: now,
				// A pre-grant's TTL runs from its window's start.
				expires: lease.ClampExpiry(max(now, start), q.spec.TTLMs, end, q.spec.Clamp),
			}
			w.add(g)
			s.grants[g.id] = &grantRef{q: q, w: w, g: g}
			s.tokensGranted = satAdd(s.tokensGranted, n)
			s.lastGrantIndex = index
			gr.GrantID, gr.Tokens, gr.ExpiresUnixMs, gr.TTLMs = g.id, n, g.expires, g.expires-now
		}
		gr.PoolRemaining = w.remaining()
		// Exhausted is the pool's word (or the fair share's, or a
		// pre-grant's chunk): a grant cut short only by the region's cap
		// is not, since the region gets more as its grants expire or are
		// released, before the window ends.
		gr.PoolExhausted = gr.PoolRemaining == 0 || avail < min(asked, room)
		res.Grants[i] = gr
		if t != nil {
			t.touch(q, now)
		}
	}
	s.record(&idemRecord{key: key, at: now, acquire: res})
	return res.clone(), nil
}

func (w *window) add(g *grant) {
	w.granted += g.tokens
	w.released += g.released
	w.grants = append(w.grants, g)
	if w.regions == nil {
		w.regions = map[string]*ledger{}
	}
	l := w.regions[g.region]
	if l == nil {
		l = &ledger{}
		w.regions[g.region] = l
	}
	l.granted += g.tokens
	l.released += g.released
	l.list = append(l.list, g)
}

// held returns the tokens region holds of pool q at now: the unreleased
// tokens of its grants that have not expired, in every window still
// visible (the previous, the current and, once pre-granted from, the next).
// Older windows hold no live grant of a quota with a cap (its TTL is at
// most its window, see validateSpecs). now must not decrease between calls.
func (q *quota) held(region string, now int64) int64 {
	var n int64
	for _, w := range q.windows {
		if l := w.regions[region]; l != nil && q.visible(w.index, now) {
			n = satAdd(n, l.held(now))
		}
	}
	return n
}

// openWindow returns q's window idx (the current one, or the next for a
// pre-grant), opening it on first touch at now with a full pool, less the
// tokens of reset pools of its name that may be spent in it (carried).
// collect must have run at now first.
func (s *state) openWindow(q *quota, idx, now int64) *window {
	at := len(q.windows)
	for at > 0 && q.windows[at-1].index >= idx {
		if q.windows[at-1].index == idx {
			return q.windows[at-1]
		}
		at--
	}
	w := &window{index: idx, limit: q.spec.Limit, carried: s.carriedInto(q, idx)}
	q.windows = slices.Insert(q.windows, at, w)
	s.windows++
	return w
}

// window returns q's window idx, or nil when it is not open.
func (q *quota) window(idx int64) *window {
	for i := len(q.windows) - 1; i >= 0; i-- {
		if q.windows[i].index == idx {
			return q.windows[i]
		}
	}
	return nil
}

// collect drops q's windows older than the previous one and its stale
// demand reports.
func (s *state) collect(q *quota, now int64) {
	drop := 0
	for drop < len(q.windows) && !q.visible(q.windows[drop].index, now) {
		drop++
	}
	if drop > 0 {
		for _, w := range q.windows[:drop] {
			s.dropWindow(w)
		}
		q.windows = slices.Delete(q.windows, 0, drop)
	}
	for r := range q.demand {
		if _, fresh := q.freshDemand(r, now); !fresh {
			delete(q.demand, r) // deletion order does not matter
		}
	}
	if len(q.demand) == 0 {
		q.demand = nil
	}
}

func (s *state) dropWindow(w *window) {
	for _, g := range w.grants {
		delete(s.grants, g.id)
	}
	s.windows--
}

func (s *state) dropWindows(q *quota) {
	for _, w := range q.windows {
		s.dropWindow(w)
	}
	q.windows = nil
}

// dropState drops q's windows, or for a template its instances; it reports
// whether there were any.
func (s *state) dropState(q *quota) bool {
	if q.isTemplate() {
		had := len(q.instances) > 0
		s.dropInstances(q)
		return had
	}
	had := len(q.windows) > 0
	s.dropWindows(q)
	return had
}

// sweep runs after every successful Apply: it prunes idempotency records by
// age and count, and collects the old windows of a few quotas round robin so
// that quotas nobody touches are collected too, at O(1) cost per entry.
func (s *state) sweep() {
	retention := 2 * s.maxWindowMs
	for s.idemHead < len(s.idemQ) {
		r := s.idemQ[s.idemHead]
		if !r.dead && s.now-r.at <= retention && len(s.idem) <= MaxIdempotencyRecords && s.idemGrants <= MaxIdempotencyGrants {
			break
		}
		s.idemQ[s.idemHead] = nil
		s.idemHead++
		if !r.dead {
			delete(s.idem, r.key)
			s.idemGrants -= r.size()
		}
	}
	if s.idemHead > 1024 && s.idemHead > len(s.idemQ)/2 {
		s.idemQ = append([]*idemRecord(nil), s.idemQ[s.idemHead:]...)
		s.idemHead = 0
	}
	for i := 0; i < gcPerApply && i < len(s.names); i++ {
		if s.gcCursor >= len(s.names) {
			s.gcCursor = 0
		}
		s.collect(s.quotas[s.names[s.gcCursor]], s.now)
		s.gcCursor++
	}
	for i := 0; i < gcPerApply && i < len(s.templates); i++ {
		if s.tmplCursor >= len(s.templates) {
			s.tmplCursor = 0
		}
		s.expire(s.quotas[s.templates[s.tmplCursor]], s.now)
		s.tmplCursor++
	}
}

func (s *state) release(now int64, r *Release) (*ReleaseResult, error) {
	if err := checkName("region", r.Region, MaxRegionBytes); err != nil {
		return nil, err
	}
	if err := checkName("grant_id", r.GrantID, MaxGrantIDBytes); err != nil {
		return nil, err
	}
	var key idemKey
	if r.RequestID != "" {
		if err := checkName("request_id", r.RequestID, MaxRequestIDBytes); err != nil {
			return nil, err
		}
		key = idemKey{kind: idemRelease, region: r.Region, requestID: r.RequestID}
		if rec := s.lookupIdem(key, now); rec != nil && rec.release != nil {
			c := rec.release.clone()
			c.Replayed = true
			return c, nil
		}
	}
	ref, ok := s.grants[r.GrantID]
	if !ok || !ref.q.visible(ref.w.index, now) {
		return nil, fmt.Errorf("grant_id %q: %w", r.GrantID, ErrUnknownGrant)
	}
	g := ref.g
	if g.region != r.Region {
		return nil, fmt.Errorf("region %q: grant %q was made to another region: %w", r.Region, r.GrantID, ErrInvalidArgument)
	}
	if unreleased := g.tokens - g.released; r.Tokens <= 0 || r.Tokens > unreleased {
		return nil, fmt.Errorf("tokens %d: must be in [1, %d], the grant's unreleased tokens: %w", r.Tokens, unreleased, ErrInvalidArgument)
	}

	q, w := ref.q, ref.w
	s.collect(q, now)
	res := &ReleaseResult{GrantID: r.GrantID, NowUnixMs: now}
	if w.index >= q.currentIndex(now) { // the current window, or a pre-grant's
		g.released += r.Tokens
		w.released += r.Tokens
		w.regions[g.region].released += r.Tokens
		res.Returned = r.Tokens
	}
	res.PoolRemaining = w.remaining()
	if r.RequestID != "" {
		s.record(&idemRecord{key: key, at: now, release: res})
	}
	return res.clone(), nil
}

func (s *state) setMember(m *SetMember) (*SetMemberResult, error) {
	if err := checkName("id", m.ID, MaxMemberIDBytes); err != nil {
		return nil, err
	}
	if m.Remove {
		if m.APIAddress != "" {
			return nil, fmt.Errorf("api_address: must be empty when remove is set: %w", ErrInvalidArgument)
		}
		_, had := s.members[m.ID]
		delete(s.members, m.ID)
		return &SetMemberResult{ID: m.ID, Removed: had}, nil
	}
	if err := checkName("api_address", m.APIAddress, MaxAPIAddressBytes); err != nil {
		return nil, err
	}
	if _, had := s.members[m.ID]; !had && len(s.members) >= MaxMembers {
		return nil, fmt.Errorf("id %q: the member table is full (%d): %w", m.ID, MaxMembers, ErrInvalidArgument)
	}
	s.members[m.ID] = m.APIAddress
	return &SetMemberResult{ID: m.ID, APIAddress: m.APIAddress}, nil
}

// setCluster records the cluster's id unless it has one: the first id
// committed stays.
func (s *state) setCluster(c *SetCluster) (*SetClusterResult, error) {
	if err := checkClusterID(c.ID); err != nil {
		return nil, err
	}
	if s.clusterID != "" {
		return &SetClusterResult{ID: s.clusterID}, nil
	}
	s.clusterID = c.ID
	return &SetClusterResult{ID: c.ID, Set: true}, nil
}

// checkClusterID validates a cluster id: 1 to MaxClusterIDBytes letters,
// digits, '-' or '_'.
func checkClusterID(id string) error {
	if err := checkName("cluster id", id, MaxClusterIDBytes); err != nil {
		return err
	}
	for i := 0; i < len(id); i++ {
		switch c := id[i]; {
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '-', c == '_':
		default:
			return fmt.Errorf("cluster id: byte %d is %q; letters, digits, '-' and '_' only: %w", i, c, ErrInvalidArgument)
		}
	}
	return nil
}

func (s *state) current() *PolicyRecord {
	if len(s.history) == 0 {
		return nil
	}
	return s.history[len(s.history)-1]
}

func (s *state) version() uint64 {
	if p := s.current(); p != nil {
		return p.Version
	}
	return 0
}

// validateSpecs checks specs and returns normalized copies sorted by name.
func validateSpecs(in []QuotaSpec) ([]QuotaSpec, error) {
	if len(in) > MaxQuotas {
		return nil, fmt.Errorf("quotas: %d entries, at most %d: %w", len(in), MaxQuotas, ErrInvalidArgument)
	}
	out := make([]QuotaSpec, len(in))
	seen := make(map[string]int, len(in))
	for i, q := range in {
		field := fmt.Sprintf("quotas[%d]", i)
		if err := checkName(field+".name", q.Name, MaxQuotaNameBytes); err != nil {
			return nil, err
		}
		if strings.Contains(q.Name, instanceSep) {
			return nil, fmt.Errorf("%s.name %q: %q is reserved for the instances of templates: %w", field, q.Name, instanceSep, ErrInvalidArgument)
		}
		if j, dup := seen[q.Name]; dup {
			return nil, fmt.Errorf("%s.name %q: duplicate of quotas[%d]: %w", field, q.Name, j, ErrInvalidArgument)
		}
		seen[q.Name] = i
		switch {
		case q.Limit < 1 || q.Limit > MaxLimit:
			return nil, fmt.Errorf("%s.limit %d: must be in [1, %d]: %w", field, q.Limit, int64(MaxLimit), ErrInvalidArgument)
		case q.WindowMs < 1 || q.WindowMs > MaxWindowMs:
			return nil, fmt.Errorf("%s.window_ms %d: must be in [1, %d]: %w", field, q.WindowMs, MaxWindowMs, ErrInvalidArgument)
		case q.TTLMs < 1 || q.TTLMs > MaxWindowMs:
			return nil, fmt.Errorf("%s.ttl_ms %d: must be in [1, %d]: %w", field, q.TTLMs, MaxWindowMs, ErrInvalidArgument)
		case q.ChunkTokens < 1 || q.ChunkTokens > q.Limit:
			return nil, fmt.Errorf("%s.chunk_tokens %d: must be in [1, limit %d]: %w", field, q.ChunkTokens, q.Limit, ErrInvalidArgument)
		case q.Clamp && q.TTLMs > q.WindowMs:
			return nil, fmt.Errorf("%s.ttl_ms %d: must not exceed window_ms %d when clamp is set: %w", field, q.TTLMs, q.WindowMs, ErrInvalidArgument)
		case q.FallbackPerRegion < 0 || q.FallbackPerRegion > MaxLimit:
			return nil, fmt.Errorf("%s.fallback_per_region %d: must be in [0, %d]: %w", field, q.FallbackPerRegion, int64(MaxLimit), ErrInvalidArgument)
		case q.MaxHeldPerRegion < 0 || q.MaxHeldPerRegion > q.Limit:
			return nil, fmt.Errorf("%s.max_held_per_region %d: must be in [0, limit %d]: %w", field, q.MaxHeldPerRegion, q.Limit, ErrInvalidArgument)
		case q.MaxHeldPerRegion > 0 && q.TTLMs > q.WindowMs:
			// Windows older than the previous one are dropped, so a lease
			// outliving the next window would escape the count.
			return nil, fmt.Errorf("%s.ttl_ms %d: must not exceed window_ms %d when max_held_per_region is set: %w", field, q.TTLMs, q.WindowMs, ErrInvalidArgument)
		case len(q.Regions) > MaxRegionsPerQuota:
			return nil, fmt.Errorf("%s.regions: %d entries, at most %d: %w", field, len(q.Regions), MaxRegionsPerQuota, ErrInvalidArgument)
		case q.TemplateKeys < 0 || q.TemplateKeys > MaxTemplateKeys:
			return nil, fmt.Errorf("%s.template_keys %d: must be in [0, %d]: %w", field, q.TemplateKeys, MaxTemplateKeys, ErrInvalidArgument)
		}
		switch q.Strategy {
		case "":
			q.Strategy = StrategyDemand
		case StrategyDemand, StrategyFairShare:
		default:
			return nil, fmt.Errorf("%s.strategy %q: want %q or %q: %w", field, q.Strategy, StrategyDemand, StrategyFairShare, ErrInvalidArgument)
		}
		if len(q.Regions) == 0 {
			q.Regions = nil
		} else {
			q.Regions = slices.Clone(q.Regions)
			for j, r := range q.Regions {
				if err := checkName(fmt.Sprintf("%s.regions[%d]", field, j), r, MaxRegionBytes); err != nil {
					return nil, err
				}
			}
			slices.Sort(q.Regions)
			for j := 1; j < len(q.Regions); j++ {
				if q.Regions[j] == q.Regions[j-1] {
					return nil, fmt.Errorf("%s.regions: %q listed twice: %w", field, q.Regions[j], ErrInvalidArgument)
				}
			}
		}
		out[i] = q
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out, nil
}

func validatePublish(p *Publish, current uint64) ([]QuotaSpec, error) {
	if p.ExpectedVersion != current+1 {
		return nil, fmt.Errorf("expected_version %d: current version is %d, want %d: %w", p.ExpectedVersion, current, current+1, ErrStaleVersion)
	}
	if err := checkName("author", p.Author, MaxAuthorBytes); err != nil {
		return nil, err
	}
	if len(p.Reason) > MaxReasonBytes {
		return nil, fmt.Errorf("reason: %d bytes, at most %d: %w", len(p.Reason), MaxReasonBytes, ErrInvalidArgument)
	}
	if len(p.Document) > MaxDocumentBytes {
		return nil, fmt.Errorf("document: %d bytes, at most %d: %w", len(p.Document), MaxDocumentBytes, ErrInvalidArgument)
	}
	return validateSpecs(p.Quotas)
}

// documentDigest is a PolicyRecord's Digest: the SHA-256 of its document.
func documentDigest(doc []byte) string {
	sum := sha256.Sum256(doc)
	return hex.EncodeToString(sum[:])
}

func (s *state) publish(now int64, p *Publish) (*PublishResult, error) {
	specs, err := validatePublish(p, s.version())
	if err != nil {
		return nil, err
	}
	rec := &PolicyRecord{
		Version:         p.ExpectedVersion,
		Author:          p.Author,
		Reason:          p.Reason,
		PublishedUnixMs: now,
		Document:        slices.Clone(p.Document),
		Quotas:          specs,
		Digest:          documentDigest(p.Document),
	}
	res := &PublishResult{Policy: rec.clone(true)}
	quotas := make(map[string]*quota, len(specs))
	names := make([]string, len(specs))
	var templates []string
	var maxW int64
	for i := range specs {
		spec := &specs[i]
		names[i] = spec.Name
		if spec.TemplateKeys > 0 {
			templates = append(templates, spec.Name)
		}
		maxW = max(maxW, spec.WindowMs)
		q, ok := s.quotas[spec.Name]
		if !ok {
			quotas[spec.Name] = &quota{name: spec.Name, spec: spec}
			continue
		}
		// Forget what is invisible under the old spec first: the result
		// must not depend on what lingers in memory, and a longer TTL must
		// not revive a stale demand report on one replica and not on
		// another (one restored from a snapshot never had it).
		pools := []*quota{q}
		if q.isTemplate() {
			s.expire(q, now)
			pools = q.instanceList()
		}
		for _, p := range pools {
			s.collect(p, now)
		}
		if q.spec.TemplateKeys != spec.TemplateKeys {
			// A single pool became a template, a template a single pool, or
			// a template's instances are named by more or fewer values:
			// the old pools are not the new ones, but their tokens that may
			// be spent in a new window are carried (see carry).
			if s.reset(q, now, spec) {
				res.WindowsReset = append(res.WindowsReset, q.name)
			}
			quotas[spec.Name] = &quota{name: spec.Name, spec: spec}
			continue
		}
		switch {
		case q.spec.WindowMs != spec.WindowMs:
			// A template's instances go whole, demand reports included:
			// they come back with the next Acquire that names them. The
			// tokens of every pool that may be spent in a window of the
			// new length are carried (see carry).
			if s.reset(q, now, spec) {
				res.WindowsReset = append(res.WindowsReset, q.name)
			}
			pools = nil
		case q.spec.Limit != spec.Limit:
			// Only the current window (and the next, if pre-granted from)
			// takes the new limit; its pool becomes max(0, new limit -
			// outstanding). The previous one is history.
			for _, p := range pools {
				for _, w := range p.windows {
					if w.index >= p.currentIndex(now) {
						w.limit = spec.Limit
					}
				}
			}
		}
		ttlChanged := q.spec.TTLMs != spec.TTLMs
		q.spec = spec
		if q.isTemplate() && len(pools) > 0 {
			for _, p := range pools {
				p.spec = spec
				if ttlChanged { // demand stays fresh for another 2 x TTL
					p.death = p.computeDeath()
				}
			}
			if ttlChanged {
				q.relink(pools, now)
			}
		}
		quotas[spec.Name] = q
	}
	for _, name := range s.names {
		if _, kept := quotas[name]; !kept {
			s.reset(s.quotas[name], now, nil) // carried, in case it comes back
			res.Removed = append(res.Removed, name)
		}
	}
	s.quotas, s.names, s.maxWindowMs, s.gcCursor = quotas, names, maxW, 0
	s.templates, s.tmplCursor = templates, 0
	s.history = append(s.history, rec)
	s.historyWindowMs = append(s.historyWindowMs, maxW)
	if n := len(s.history); n > HistoryVersions {
		s.history = append([]*PolicyRecord(nil), s.history[n-HistoryVersions:]...)
		s.historyWindowMs = append([]int64(nil), s.historyWindowMs[n-HistoryVersions:]...)
	}
	s.collapseCarries(now)
	return res, nil
}

// satMul multiplies non-negative a and b, saturating at MaxInt64.
func satMul(a, b int64) int64 {
	if a == 0 || b == 0 {
		return 0
	}
	if a > math.MaxInt64/b {
		return math.MaxInt64
	}
	return a * b
}

// satAdd adds non-negative a and b, saturating at MaxInt64.
func satAdd(a, b int64) int64 {
	if a > math.MaxInt64-b {
		return math.MaxInt64
	}
	return a + b
}
