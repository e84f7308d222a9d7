package fsm

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"testing"

	"pgregory.net/rapid"

	"github.com/allot-dev/allot/pkg/lease"
)

// model is what the property test remembers about the commands it sent.
type model struct {
	h        *harness
	now      int64 // the largest stamp applied
	stamp    int64 // the next stamp, which may lag behind now
	nextID   int
	specs    map[string]QuotaSpec
	requests []sentAcquire
	grants   []grantMade
	// lowered marks windows whose limit was lowered below their
	// outstanding tokens; peak holds the largest limit a window had.
	lowered map[windowKey]bool
	peak    map[windowKey]int64
	// gen counts publishes; capGen holds, per spec name, the gen at which
	// its MaxHeldPerRegion took its current value (a grant made since
	// leaves its region within that cap).
	gen    int
	capGen map[string]int
	// tally counts, over every run of the property, what the commands
	// achieved, so that the test fails when nothing is ever granted or
	// released (then every invariant holds trivially).
	tally *propTally
}

type propTally struct {
	runs, grants, releases int
	// capped counts the grants a region's cap cut short.
	capped int
	// carried counts the checks that found live tokens of dropped grants;
	// spent those that found tokens of dropped grants that had expired but
	// may have been spent in the window checked.
	carried, spent int
}

type windowKey struct {
	quota string
	index int64
}

type sentAcquire struct {
	acq     Acquire
	res     *AcquireResult
	expired bool // pruned from the FSM's idempotency records
}

type grantMade struct {
	id, quota, region string
	tokens            int64
	window            int64
	grantedAt         int64
	expires           int64
	// released is the tokens the FSM took back (ReleaseResult.Returned).
	released int64
	// gen is the model's gen when the grant was made.
	gen int
	// dropped is set when a publish removed the grant's quota or changed
	// its window length, which drops its windows and grants.
	dropped bool
	// carried is set when the grant was dropped while its window was
	// still held (the previous, current or next) and its lease had not
	// ended: until it does, every window of its pool leaves room for its
	// unreleased tokens, whatever the policy did since. Every window whose
	// span its [grantedAt, expires) overlaps does too, once it is dropped,
	// carried or not: its tokens may have been spent in that span.
	carried bool
}

var (
	propRegions = []string{"eu", "us", "apac"}
	// propQuotas are the quota specs; "tq" is a template, whose instances
	// are propInstances.
	propQuotas    = []string{"q0", "q1", "q2", "q3", "tq"}
	propInstances = []string{"tq/a", "tq/b%2Fc", "tq/d"}
	// propBadNames are refused whatever the policy: a template's own name,
	// an instance of a single pool, a malformed instance.
	propBadNames = []string{"tq", "q0/a", "tq/a/b"}
)

// spec returns the spec of pool name: a single pool's, or an instance's
// template's.
func (m *model) spec(name string) (QuotaSpec, bool) {
	if slices.Contains(propInstances, name) {
		s, ok := m.specs["tq"]
		return s, ok
	}
	s, ok := m.specs[name]
	return s, ok && s.TemplateKeys == 0
}

// pools returns the names of the pools of the current policy.
func (m *model) pools() []string {
	var out []string
	for _, name := range propQuotas {
		if _, ok := m.spec(name); ok {
			out = append(out, name)
		}
	}
	if _, ok := m.specs["tq"]; ok {
		out = append(out, propInstances...)
	}
	return out
}

func drawSpec(t *rapid.T, name string) QuotaSpec {
	limit := rapid.Int64Range(1, 500).Draw(t, name+".limit")
	window := rapid.SampledFrom([]int64{1_000, 5_000, minute}).Draw(t, name+".window")
	clamp := rapid.Bool().Draw(t, name+".clamp")
	// A cap on what one region holds, sometimes; it needs a TTL within
	// the window.
	var held int64
	if rapid.IntRange(0, 2).Draw(t, name+".capped?") == 0 {
		held = rapid.Int64Range(1, limit).Draw(t, name+".maxheld")
	}
	ttlMax := 2 * window
	if clamp || held > 0 {
		ttlMax = window
	}
	return QuotaSpec{
		Name:             name,
		Limit:            limit,
		WindowMs:         window,
		ChunkTokens:      rapid.Int64Range(1, limit).Draw(t, name+".chunk"),
		TTLMs:            rapid.Int64Range(1, ttlMax).Draw(t, name+".ttl"),
		Clamp:            clamp,
		Strategy:         rapid.SampledFrom([]Strategy{StrategyDemand, StrategyFairShare}).Draw(t, name+".strategy"),
		MaxHeldPerRegion: held,
	}
}

func (m *model) publish(t *rapid.T) {
	specs := map[string]QuotaSpec{}
	for _, name := range propQuotas {
		old, had := m.specs[name]
		switch {
		case had && rapid.IntRange(0, 9).Draw(t, "keep "+name) < 6:
			specs[name] = old // unchanged
		case had && rapid.Bool().Draw(t, "relimit "+name):
			old.Limit = rapid.Int64Range(old.ChunkTokens, 600).Draw(t, name+".newlimit")
			old.MaxHeldPerRegion = min(old.MaxHeldPerRegion, old.Limit)
			specs[name] = old
		case had && old.TTLMs <= old.WindowMs && rapid.Bool().Draw(t, "recap "+name):
			// Set, change or lift the cap; a region may then hold more
			// than the new cap until its grants end.
			old.MaxHeldPerRegion = rapid.Int64Range(0, old.Limit).Draw(t, name+".newmaxheld")
			specs[name] = old
		case rapid.IntRange(0, 4).Draw(t, "drop "+name) > 0:
			specs[name] = drawSpec(t, name)
			if name == "tq" {
				s := specs[name]
				s.TemplateKeys = 1
				specs[name] = s
			}
		}
	}
	list := make([]QuotaSpec, 0, len(specs))
	for _, name := range propQuotas {
		if s, ok := specs[name]; ok {
			list = append(list, s)
		}
	}
	// Record lowered limits before they take effect.
	for _, s := range list {
		old, had := m.specs[s.Name]
		if !had || old.WindowMs != s.WindowMs {
			continue
		}
		names := []string{s.Name}
		if s.TemplateKeys > 0 {
			names = propInstances
		}
		for _, name := range names {
			cur := m.h.f.CurrentWindow(name, m.stamp)
			views := []WindowView{cur}
			if next, ok := m.h.f.Window(name, cur.Index+1); ok { // pre-granted from
				views = append(views, next)
			}
			for _, w := range views {
				k := windowKey{name, w.Index}
				if s.Limit < w.Outstanding+w.Carried {
					m.lowered[k] = true
				}
				m.peak[k] = max(m.peak[k], w.Limit, s.Limit)
			}
		}
	}
	m.h.publish(m.stamp, list...)
	m.gen++
	for name, s := range specs {
		if old, had := m.specs[name]; !had || old.MaxHeldPerRegion != s.MaxHeldPerRegion {
			m.capGen[name] = m.gen
		}
	}
	now := m.h.f.Now()
	for _, name := range propQuotas {
		old, had := m.specs[name]
		s, has := specs[name]
		if !had || (has && s.WindowMs == old.WindowMs && s.TemplateKeys == old.TemplateKeys) {
			continue
		}
		names := []string{name}
		if old.TemplateKeys > 0 {
			names = propInstances
		}
		for i := range m.grants {
			g := &m.grants[i]
			if slices.Contains(names, g.quota) && !g.dropped {
				g.dropped = true
				g.carried = g.window >= lease.WindowIndex(now, old.WindowMs)-1 && g.expires > now
			}
		}
	}
	m.specs = specs
}

// valid reports whether the FSM must accept an Acquire of wants with a
// fresh request id: every quota is a pool of the current policy (or an
// instance of its template), the tokens are within its limit, and only
// clamped quotas are pre-granted from. The model declares no regions, and
// never reaches the instance cap. A valid Acquire may still get nothing (an
// empty pool, a fair share of 0, an early pre-grant), but it is not refused.
func (m *model) valid(wants []Want) bool {
	for _, w := range wants {
		spec, ok := m.spec(w.Quota)
		if !ok || w.Tokens < 0 || w.Tokens > spec.Limit || (w.Next && !spec.Clamp) {
			return false
		}
	}
	return true
}

// recordGrants remembers the grants of r, made to region.
func (m *model) recordGrants(region string, r *AcquireResult) {
	for _, g := range r.Grants {
		if g.Tokens > 0 {
			m.grants = append(m.grants, grantMade{id: g.GrantID, quota: g.Quota, region: region, tokens: g.Tokens, window: g.WindowIndex, grantedAt: r.NowUnixMs, expires: g.ExpiresUnixMs, gen: m.gen})
			m.tally.grants++
		}
	}
}

// held is what region holds of pool name at now as the cap counts it: the
// unreleased tokens of its grants the FSM still keeps (not dropped by a
// publish, of a window no older than the previous one) that have not
// expired.
func (m *model) held(name, region string, now int64) int64 {
	spec, ok := m.spec(name)
	if !ok {
		return 0
	}
	cur := lease.WindowIndex(now, spec.WindowMs)
	var n int64
	for _, g := range m.grants {
		if g.quota == name && g.region == region && !g.dropped && g.window >= cur-1 && g.expires > now {
			n += g.tokens - g.released
		}
	}
	return n
}

// room is what region may still be granted of pool name at now under its
// cap (the asked tokens when it has none).
func (m *model) room(name, region string, now, asked int64) int64 {
	spec, _ := m.spec(name)
	if spec.MaxHeldPerRegion == 0 {
		return asked
	}
	return max(0, spec.MaxHeldPerRegion-m.held(name, region, now))
}

// capName is the spec name whose cap applies to pool name.
func capName(name string) string {
	if slices.Contains(propInstances, name) {
		return "tq"
	}
	return name
}

func (m *model) windowsAt(stamp int64) map[string]WindowView {
	out := map[string]WindowView{}
	for _, name := range m.pools() {
		out[name] = m.h.f.CurrentWindow(name, stamp)
	}
	return out
}

func (m *model) acquire(t *rapid.T) {
	region := rapid.SampledFrom(propRegions).Draw(t, "region")
	n := rapid.IntRange(1, 4).Draw(t, "wants")
	all := append(append(slices.Clone(propQuotas[:4]), propInstances...), propInstances...) // instances twice as often
	if rapid.IntRange(0, 9).Draw(t, "bad name?") == 0 {
		all = append(all, rapid.SampledFrom(propBadNames).Draw(t, "bad name"))
	}
	var names []string
	for _, q := range rapid.Permutation(all).Draw(t, "quotas") {
		if len(names) < n && !slices.Contains(names, q) {
			names = append(names, q)
		}
	}
	var wants []Want
	for _, q := range names {
		spec, ok := m.spec(q)
		maxTokens := int64(600)
		if ok {
			maxTokens = spec.Limit
		}
		wants = append(wants, Want{
			Quota:           q,
			Tokens:          rapid.Int64Range(0, maxTokens).Draw(t, "tokens"),
			DemandPerSecond: float64(rapid.IntRange(0, 200).Draw(t, "demand")) / 4,
			// A pre-grant, mostly of clamped quotas (otherwise rejected).
			Next: rapid.IntRange(0, 3).Draw(t, "next?") == 0 && (spec.Clamp || rapid.IntRange(0, 9).Draw(t, "next unclamped?") == 0),
		})
	}
	m.nextID++
	acq := Acquire{Region: region, RequestID: fmt.Sprint("req-", m.nextID), Wants: wants}
	before := m.windowsAt(m.stamp)
	valid := m.valid(wants)
	now := max(m.h.f.Now(), m.stamp)
	room := make([]int64, len(wants))
	for i, w := range wants {
		if valid {
			asked := w.Tokens
			if asked == 0 {
				asked = m.specs[capName(w.Quota)].ChunkTokens
			}
			room[i] = m.room(w.Quota, region, now, asked)
		}
	}
	res := m.h.acquireRes(m.stamp, region, acq.RequestID, wants...)
	r, ok := res.(*AcquireResult)
	switch {
	case !ok && valid:
		t.Fatalf("valid acquire refused: %+v\npolicy %+v\nerror %v", acq, m.specs, res)
	case ok && !valid:
		t.Fatalf("acquire of an unknown quota, over the limit or an unclamped pre-grant accepted: %+v\npolicy %+v\nresult %+v", acq, m.specs, r)
	case !ok:
		// An unknown quota or an unclamped pre-grant, the only invalid
		// wants the model sends.
		if err, _ := res.(error); !errors.Is(err, ErrUnknownQuota) && !errors.Is(err, ErrInvalidArgument) {
			t.Fatalf("invalid acquire %+v: got %v, want ErrUnknownQuota or ErrInvalidArgument", acq, res)
		}
		return
	}
	if r.Replayed || len(r.Grants) != len(wants) {
		t.Fatalf("fresh request %s: replayed %v, %d grants for %d wants", acq.RequestID, r.Replayed, len(r.Grants), len(wants))
	}
	m.requests = append(m.requests, sentAcquire{acq: acq, res: r})
	after := m.windowsAt(m.stamp)
	for i, g := range r.Grants {
		spec, _ := m.spec(g.Quota)
		b, a := before[g.Quota], after[g.Quota]
		if wants[i].Next {
			if !spec.Clamp {
				t.Fatalf("want %d: pre-grant of unclamped %s accepted", i, g.Quota)
			}
			if g.WindowIndex != a.Index+1 || g.NotBeforeUnixMs != a.EndUnixMs {
				t.Fatalf("want %d: pre-grant of window %d from %d, current window %d ends %d", i, g.WindowIndex, g.NotBeforeUnixMs, a.Index, a.EndUnixMs)
			}
			next, _ := m.h.f.Window(g.Quota, g.WindowIndex)
			if g.Tokens > g.Requested || g.Tokens > spec.ChunkTokens || g.Tokens > room[i] {
				t.Fatalf("want %d: pre-granted %d, asked %d, chunk %d, room under the cap %d", i, g.Tokens, g.Requested, spec.ChunkTokens, room[i])
			}
			if early := g.NotBeforeUnixMs-r.NowUnixMs > spec.WindowMs/2; early && g.Tokens > 0 {
				t.Fatalf("want %d: pre-granted %d tokens %d ms before the window, more than half a window %d", i, g.Tokens, g.NotBeforeUnixMs-r.NowUnixMs, spec.WindowMs)
			}
			var held int64
			for _, rv := range next.Regions {
				if rv.Region == region {
					held = rv.Granted - rv.Released
				}
			}
			if g.Tokens > 0 && held > spec.ChunkTokens {
				t.Fatalf("want %d: %s holds %d of window %d before it opens, chunk %d", i, region, held, g.WindowIndex, spec.ChunkTokens)
			}
			if g.Tokens > 0 {
				if g.ExpiresUnixMs > g.WindowEndUnixMs || g.ExpiresUnixMs-g.NotBeforeUnixMs > spec.TTLMs || g.ExpiresUnixMs <= g.NotBeforeUnixMs {
					t.Fatalf("want %d: pre-grant for [%d, %d) expires %d (ttl %d)", i, g.NotBeforeUnixMs, g.WindowEndUnixMs, g.ExpiresUnixMs, spec.TTLMs)
				}
				m.grants = append(m.grants, grantMade{id: g.GrantID, quota: g.Quota, region: region, tokens: g.Tokens, window: g.WindowIndex, grantedAt: r.NowUnixMs, expires: g.ExpiresUnixMs, gen: m.gen})
				m.tally.grants++
			}
			continue
		}
		if g.NotBeforeUnixMs != 0 {
			t.Fatalf("want %d: a grant of the current window has not_before %d", i, g.NotBeforeUnixMs)
		}
		if g.Tokens > b.Remaining || g.Tokens > g.Requested || g.Tokens < 0 {
			t.Fatalf("want %d: granted %d, pool before %d, asked %d", i, g.Tokens, b.Remaining, g.Requested)
		}
		if b.Index == a.Index && a.Remaining != b.Remaining-g.Tokens {
			t.Fatalf("want %d: pool %d -> %d after granting %d\nres %+v\nbefore %+v\nafter %+v\nstamp %d now %d", i, b.Remaining, a.Remaining, g.Tokens, r, b, a, m.stamp, m.h.f.Now())
		}
		if g.Tokens > room[i] {
			t.Fatalf("want %d: granted %d, but %s had room for %d under its cap %d", i, g.Tokens, region, room[i], spec.MaxHeldPerRegion)
		}
		if spec.Strategy == StrategyDemand && b.Index == a.Index {
			if g.Tokens != min(g.Requested, b.Remaining, room[i]) {
				t.Fatalf("demand strategy granted %d of %d with %d in the pool and room for %d under the cap", g.Tokens, g.Requested, b.Remaining, room[i])
			}
			// Only the pool says it is exhausted, never the cap.
			if want := a.Remaining == 0 || b.Remaining < min(g.Requested, room[i]); g.PoolExhausted != want {
				t.Fatalf("want %d: pool_exhausted %v, want %v: asked %d, pool %d -> %d, room %d", i, g.PoolExhausted, want, g.Requested, b.Remaining, a.Remaining, room[i])
			}
		}
		if room[i] < min(g.Requested, b.Remaining) {
			m.tally.capped++
		}
		if g.Tokens > 0 {
			if spec.Clamp && g.ExpiresUnixMs > g.WindowEndUnixMs {
				t.Fatalf("clamped grant expires %d after window end %d", g.ExpiresUnixMs, g.WindowEndUnixMs)
			}
			if g.TTLMs <= 0 || g.TTLMs > spec.TTLMs {
				t.Fatalf("ttl %d outside (0, %d]", g.TTLMs, spec.TTLMs)
			}
			m.grants = append(m.grants, grantMade{id: g.GrantID, quota: g.Quota, region: region, tokens: g.Tokens, window: g.WindowIndex, grantedAt: r.NowUnixMs, expires: g.ExpiresUnixMs, gen: m.gen})
			m.tally.grants++
		}
	}
}

func (m *model) retry(t *rapid.T) {
	if len(m.requests) == 0 {
		return
	}
	i := rapid.IntRange(0, len(m.requests)-1).Draw(t, "retry")
	sent := m.requests[i]
	granted := m.h.f.Stats().TokensGranted
	var maxW int64
	for _, s := range m.specs {
		maxW = max(maxW, s.WindowMs)
	}
	within := !sent.expired && max(m.h.f.Now(), m.stamp)-sent.res.NowUnixMs <= 2*maxW
	valid := m.valid(sent.acq.Wants)
	res := m.h.acquireRes(m.stamp, sent.acq.Region, sent.acq.RequestID, sent.acq.Wants...)
	r, ok := res.(*AcquireResult)
	switch {
	case ok && r.Replayed:
		if !slices.Equal(r.Grants, sent.res.Grants) || r.NowUnixMs != sent.res.NowUnixMs {
			t.Fatalf("replay %+v differs from the recorded %+v", r, sent.res)
		}
		if got := m.h.f.Stats().TokensGranted; got != granted {
			t.Fatalf("a retry granted %d new tokens", got-granted)
		}
		if !within {
			t.Fatalf("replayed a request older than the retention")
		}
	case within:
		t.Fatalf("retry within retention not replayed: %v", res)
	case ok != valid:
		t.Fatalf("retry of pruned request %+v under policy %+v: valid %v, got %v", sent.acq, m.specs, valid, res)
	case ok: // pruned, so granted afresh and recorded again
		m.requests[i] = sentAcquire{acq: sent.acq, res: r}
		m.recordGrants(sent.acq.Region, r)
	}
}

func (m *model) release(t *rapid.T) {
	if len(m.grants) == 0 {
		return
	}
	gi := rapid.IntRange(0, len(m.grants)-1).Draw(t, "grant")
	g := m.grants[gi]
	region := g.region
	if rapid.IntRange(0, 9).Draw(t, "wrong region") == 0 {
		region = rapid.SampledFrom(propRegions).Draw(t, "region")
	}
	tokens := rapid.Int64Range(1, g.tokens).Draw(t, "release tokens")

	// The FSM holds the grant while its window is the current, the
	// previous or (a pre-grant's) the next one at the command's time, unless
	// a publish dropped it. A release of a held grant by its region, of at
	// most its unreleased tokens, must succeed; it returns the tokens unless
	// the grant's window has ended.
	now := max(m.h.f.Now(), m.stamp)
	spec, known := m.spec(g.quota)
	var cur int64
	if known {
		cur = lease.WindowIndex(now, spec.WindowMs)
	}
	held := known && !g.dropped && g.window >= cur-1
	valid := held && region == g.region && tokens <= g.tokens-g.released

	before, _ := m.h.f.Window(g.quota, g.window)
	beforeCur := m.h.f.CurrentWindow(g.quota, m.stamp)
	res := m.h.releaseRes(m.stamp, region, g.id, tokens)
	r, ok := res.(*ReleaseResult)
	switch {
	case !ok && valid:
		t.Fatalf("valid release refused: %d of grant %+v by %s at %d (window %d): %v", tokens, g, region, now, cur, res)
	case ok && !valid:
		t.Fatalf("invalid release accepted: %d of grant %+v by %s at %d (window %d, held %v): %+v", tokens, g, region, now, cur, held, r)
	case !ok:
		return
	}
	want := int64(0)
	if g.window >= cur {
		want = tokens
	}
	if r.Returned != want || r.Replayed {
		t.Fatalf("released %d of grant %+v in window %d: returned %d (replayed %v), want %d", tokens, g, cur, r.Returned, r.Replayed, want)
	}
	m.grants[gi].released += r.Returned
	if r.Returned == 0 {
		return
	}
	m.tally.releases++
	after, _ := m.h.f.Window(g.quota, g.window)
	if after.Released != before.Released+tokens {
		t.Fatalf("released %d of grant %s: window %d released %d -> %d", tokens, g.id, g.window, before.Released, after.Released)
	}
	if g.window > cur { // a pre-grant whose window has not started
		return
	}
	afterCur := m.h.f.CurrentWindow(g.quota, m.stamp)
	if want := max(0, afterCur.Limit-afterCur.Carried-(beforeCur.Outstanding-tokens)); afterCur.Remaining != want || r.PoolRemaining != want {
		t.Fatalf("after releasing %d: pool %d (result %d), want %d", tokens, afterCur.Remaining, r.PoolRemaining, want)
	}
	// Released tokens are reusable: ask for them back at once.
	if spec.Strategy != StrategyDemand || m.lowered[windowKey{g.quota, afterCur.Index}] {
		return
	}
	m.nextID++
	room := m.room(g.quota, region, now, tokens)
	back := m.h.acquire(m.stamp, region, fmt.Sprint("back-", m.nextID), Want{Quota: g.quota, Tokens: tokens})
	m.recordGrants(region, back)
	if got := back.Grants[0].Tokens; got != min(tokens, room) {
		t.Fatalf("released %d, then re-acquired only %d (pool %d, room under the cap %d)", tokens, got, afterCur.Remaining, room)
	}
}

func (m *model) advance(t *rapid.T) {
	m.now = max(m.now, m.stamp)
	m.stamp = m.now + rapid.Int64Range(0, 20_000).Draw(t, "advance")
	if rapid.IntRange(0, 4).Draw(t, "skew") == 0 {
		m.stamp -= rapid.Int64Range(0, 10_000).Draw(t, "behind") // a leader with a slow clock
	}
}

// expire marks the requests the FSM has pruned: after every command it
// applied, those older than two of the current longest window.
func (m *model) expire() {
	var maxW int64
	for _, s := range m.specs {
		maxW = max(maxW, s.WindowMs)
	}
	for i := range m.requests {
		if m.h.f.Now()-m.requests[i].res.NowUnixMs > 2*maxW {
			m.requests[i].expired = true
		}
	}
}

// check asserts the invariants that hold after every command.
func (m *model) check(t *rapid.T, prevNow int64) {
	f := m.h.f
	now := f.Now()
	if now < prevNow {
		t.Fatalf("time went backwards: %d -> %d", prevNow, now)
	}
	for _, name := range m.pools() {
		// No region holds more than its cap, unless the cap was lowered
		// (or set) while it held more and it got nothing since.
		if spec, _ := m.spec(name); spec.MaxHeldPerRegion > 0 {
			for _, region := range propRegions {
				held := m.held(name, region, now)
				if held <= spec.MaxHeldPerRegion {
					continue
				}
				for _, g := range m.grants {
					if g.quota == name && g.region == region && !g.dropped && g.gen >= m.capGen[capName(name)] {
						t.Fatalf("%s holds %d of %s, over its cap %d, and was granted %+v since the cap was set", region, held, name, spec.MaxHeldPerRegion, g)
					}
				}
			}
		}
		// The live tokens of the pool's grants that publishes dropped:
		// every window opened since leaves room for them, so a reset
		// never opens a second pool beside leases still being spent.
		var live int64
		for _, g := range m.grants {
			if g.quota == name && g.carried && g.expires > now {
				live += g.tokens - g.released
			}
		}
		if live > 0 {
			m.tally.carried++
		}
		cur := f.CurrentWindow(name, now)
		if cur.Carried < live {
			t.Fatalf("%s: current window carries %d, but dropped leases hold %d", name, cur.Carried, live)
		}
		// A window leaves room for every dropped grant whose lease
		// overlaps its span, expired or not: the tokens may have been
		// spent in it. So the span never admits more than G from the
		// old grants and its own together (unless the old grants alone
		// exceed it).
		spent := func(w WindowView) (n int64, expired bool) {
			for _, g := range m.grants {
				if g.quota == name && g.dropped && g.expires > w.StartUnixMs && g.grantedAt < w.EndUnixMs {
					n += g.tokens - g.released
					expired = expired || g.expires <= now
				}
			}
			return n, expired
		}
		if n, expired := spent(cur); cur.Carried < n {
			t.Fatalf("%s: current window [%d, %d) carries %d, but dropped grants of %d tokens may be spent in it", name, cur.StartUnixMs, cur.EndUnixMs, cur.Carried, n)
		} else if expired && n > 0 {
			m.tally.spent++
		}
		for _, idx := range []int64{cur.Index - 1, cur.Index, cur.Index + 1} {
			w, ok := f.Window(name, idx)
			if !ok {
				continue
			}
			k := windowKey{name, idx}
			n, _ := spent(w)
			if w.Carried < n {
				t.Fatalf("%s[%d]: carries %d, but dropped grants of %d tokens may be spent in it", name, idx, w.Carried, n)
			}
			// (Old pools of a larger limit may have granted more than this
			// one's: then it grants nothing.)
			if !m.lowered[k] && w.Outstanding > max(0, w.Limit-n) {
				t.Fatalf("%s[%d]: dropped grants of %d tokens may be spent in it and %d are outstanding, over the limit %d", name, idx, n, w.Outstanding, w.Limit)
			}
			if w.Remaining != max(0, w.Limit-w.Carried-w.Granted+w.Released) {
				t.Fatalf("%s[%d]: remaining %d != max(0, %d - %d - %d + %d)", name, idx, w.Remaining, w.Limit, w.Carried, w.Granted, w.Released)
			}
			if w.Released < 0 || w.Released > w.Granted {
				t.Fatalf("%s[%d]: released %d of %d", name, idx, w.Released, w.Granted)
			}
			if !m.lowered[k] && w.Outstanding > max(0, w.Limit-w.Carried) {
				t.Fatalf("%s[%d]: outstanding %d over the limit %d less %d carried", name, idx, w.Outstanding, w.Limit, w.Carried)
			}
			if w.Outstanding > max(w.Limit, m.peak[k]) {
				t.Fatalf("%s[%d]: outstanding %d over every limit the window had", name, idx, w.Outstanding)
			}
			var sum, rel, rows int64
			for _, g := range w.Grants {
				sum += g.Tokens
				rel += g.Released
			}
			for _, r := range w.Regions {
				rows += r.Granted
			}
			if sum != w.Granted || rel != w.Released || rows != w.Granted {
				t.Fatalf("%s[%d]: grants sum %d/%d, rows %d, window %d/%d", name, idx, sum, rel, rows, w.Granted, w.Released)
			}
		}
	}
}

func TestPropertyInvariants(t *testing.T) {
	var tally propTally
	// A window change that drops grants whose leases are then still live
	// (tally.carried) or expire inside a window of the new length
	// (tally.spent) takes a publish, a grant and the right advance of time
	// in one run: most seeds' 100 runs make dozens of each, about one seed
	// in fifteen makes none of one. Such a seed runs another round (a fresh
	// seed unless -rapid.seed fixes it), up to three, so the guard below
	// fails for a model that stopped making them, not for an unlucky seed.
	for round := 0; round < 4 && !t.Failed() && (round == 0 || tally.vacuous()); round++ {
		propertyRound(t, &tally)
	}
	// Every valid command is checked to succeed above; this catches a
	// model that stops sending them. Over the default 100 runs of up to
	// 120 commands, a run without a grant or a release is common but all
	// of them without one is practically impossible; with very few runs
	// (-rapid.checks) it is not, so the check needs some.
	t.Logf("%d runs: %d grants (%d cut short by a cap), %d releases returned tokens, %d checks of carried tokens, %d of expired ones",
		tally.runs, tally.grants, tally.capped, tally.releases, tally.carried, tally.spent)
	if !t.Failed() && tally.runs >= 20 && tally.vacuous() {
		t.Fatalf("%d runs made %d grants (%d cut short by a cap) and %d releases, %d checks of carried tokens, %d of expired ones: the property checked nothing",
			tally.runs, tally.grants, tally.capped, tally.releases, tally.carried, tally.spent)
	}
}

// vacuous reports whether some kind of check never happened.
func (p *propTally) vacuous() bool {
	return p.grants == 0 || p.releases == 0 || p.carried == 0 || p.capped == 0 || p.spent == 0
}

// propertyRound runs one rapid.Check of the invariants, counting into tally.
func propertyRound(t *testing.T, tally *propTally) {
	rapid.Check(t, func(t *rapid.T) {
		tally.runs++
		h := newHarness(t)
		h.strict = true // every rejected command must leave the state untouched
		m := &model{h: h, stamp: t0, specs: map[string]QuotaSpec{}, lowered: map[windowKey]bool{}, peak: map[windowKey]int64{}, capGen: map[string]int{}, tally: tally}
		m.publish(t)
		steps := rapid.IntRange(1, 120).Draw(t, "steps")
		for range steps {
			prevNow := h.f.Now()
			switch rapid.IntRange(0, 9).Draw(t, "op") {
			case 0, 1:
				m.advance(t)
			case 2, 3, 4:
				m.acquire(t)
			case 5:
				m.retry(t)
			case 6, 7:
				m.release(t)
			case 8:
				if rapid.IntRange(0, 3).Draw(t, "publish?") == 0 {
					m.publish(t)
				}
			case 9:
				m.advance(t)
				m.acquire(t)
			}
			m.check(t, prevNow)
			m.expire()
		}

		// Replaying the log into a fresh FSM gives the same results and a
		// byte-identical snapshot.
		want := snapshotBytes(t, h.f)
		replica := newHarness(t)
		for _, b := range h.log {
			replica.applyBytes(b)
		}
		if !slices.Equal(replica.results, h.results) {
			t.Fatalf("replayed log gives different results")
		}
		if got := snapshotBytes(t, replica.f); !bytes.Equal(got, want) {
			t.Fatalf("replayed log gives a different snapshot:\n%s\n%s", got, want)
		}
		// Snapshot -> restore -> snapshot is the identity.
		restored := New()
		if err := restore(restored, want); err != nil {
			t.Fatalf("Restore: %v", err)
		}
		if got := snapshotBytes(t, restored); !bytes.Equal(got, want) {
			t.Fatalf("restored snapshot differs:\n%s\n%s", got, want)
		}
	})
}
