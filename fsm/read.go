package fsm

import (
	"slices"

	"github.com/allot-dev/allot/pkg/lease"
)

// The read methods below take a read lock and return deep copies, so they
// may run concurrently with Apply and their results may be kept and changed.

// Now returns the state machine's time in Unix milliseconds: the latest
// leader stamp applied. It never goes backwards.
func (f *FSM) Now() int64 {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.s.now
}

// Policy returns the current policy, or false before the first publish.
func (f *FSM) Policy() (PolicyRecord, bool) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	if p := f.s.current(); p != nil {
		return p.clone(true), true
	}
	return PolicyRecord{}, false
}

// PolicyVersion returns policy version v, or false when v was never
// published or is older than the retained HistoryVersions.
func (f *FSM) PolicyVersion(v uint64) (PolicyRecord, bool) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	for _, p := range f.s.history {
		if p.Version == v {
			return p.clone(true), true
		}
	}
	return PolicyRecord{}, false
}

// PolicyHistory returns the retained policy versions, oldest first, without
// their documents and quotas (see PolicyVersion) but with their digests.
func (f *FSM) PolicyHistory() []PolicyRecord {
	f.mu.RLock()
	defer f.mu.RUnlock()
	out := make([]PolicyRecord, len(f.s.history))
	for i, p := range f.s.history {
		out[i] = p.clone(false)
	}
	return out
}

// Quota returns the current spec of quota name: a single pool, a template,
// or an instance of a template in force, alive or not (its template's spec,
// with Name set to the instance's name and TemplateKeys to 0).
func (f *FSM) Quota(name string) (QuotaSpec, bool) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	if q, ok := f.s.quotas[name]; ok {
		return cloneSpec(*q.spec), true
	}
	q, t, err := f.s.lookupQuota(name, f.s.now)
	if err != nil {
		return QuotaSpec{}, false
	}
	spec := cloneSpec(*t.spec)
	if q != nil {
		spec = cloneSpec(*q.spec)
	}
	spec.Name, spec.TemplateKeys = name, 0
	return spec, true
}

// Quotas returns the current quota specs (single pools and templates, not
// instances) sorted by name.
func (f *FSM) Quotas() []QuotaSpec {
	f.mu.RLock()
	defer f.mu.RUnlock()
	out := make([]QuotaSpec, len(f.s.names))
	for i, n := range f.s.names {
		out[i] = cloneSpec(*f.s.quotas[n].spec)
	}
	return out
}

// Window returns window index of quota (a single pool or a live instance of
// a template), as of the state machine's time. Only the previous, the
// current and (once pre-granted from) the next window are held.
func (f *FSM) Window(quota string, index int64) (WindowView, bool) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	s := f.s
	q, _, err := s.lookupQuota(quota, s.now)
	if err != nil || q == nil || !q.visible(index, s.now) || index > q.currentIndex(s.now)+1 {
		return WindowView{}, false
	}
	for _, w := range q.windows {
		if w.index == index {
			return view(q, w, s.now), true
		}
	}
	return WindowView{}, false
}

// CurrentWindow returns quota name's window holding nowMs, with Expired counted
// at nowMs. A nowMs before the state machine's time is raised to it (windows
// never reopen). A window not opened yet, and the window of an instance of a
// template that is not alive, is shown as it would open at nowMs: with its
// full pool, less the tokens carried from pools a publish reset. An unknown quota
// (or a template's own name) yields the zero WindowView, whose Quota is
// empty.
func (f *FSM) CurrentWindow(name string, nowMs int64) WindowView {
	f.mu.RLock()
	defer f.mu.RUnlock()
	s := f.s
	nowMs = max(nowMs, s.now)
	q, t, err := s.lookupQuota(name, nowMs)
	if err != nil {
		return WindowView{}
	}
	if q == nil {
		q = &quota{name: name, spec: t.spec, tmpl: t} // an instance with nothing yet
	}
	idx := q.currentIndex(nowMs)
	if w := q.window(idx); w != nil {
		return view(q, w, nowMs)
	}
	return view(q, &window{index: idx, limit: q.spec.Limit, carried: s.carriedInto(q, idx)}, nowMs)
}

// Grant returns grant id, while its window is the current or the previous.
func (f *FSM) Grant(id string) (GrantView, bool) {
	f.mu.RLock()
	defer f.mu.RUnlock()
	ref, ok := f.s.grants[id]
	if !ok || !ref.q.visible(ref.w.index, f.s.now) {
		return GrantView{}, false
	}
	return grantView(ref.q, ref.w, ref.g), true
}

// Members returns a copy of the member table: Raft server ID to API address.
func (f *FSM) Members() map[string]string {
	f.mu.RLock()
	defer f.mu.RUnlock()
	out := make(map[string]string, len(f.s.members))
	for id, addr := range f.s.members {
		out[id] = addr
	}
	return out
}

// ClusterID returns the cluster's id (see SetCluster); empty until the
// first leader of a cluster has recorded one.
func (f *FSM) ClusterID() string {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.s.clusterID
}

// Stats returns counters for metrics.
func (f *FSM) Stats() Stats {
	f.mu.RLock()
	defer f.mu.RUnlock()
	s := f.s
	return Stats{
		NowUnixMs:          s.now,
		PolicyVersion:      s.version(),
		Quotas:             len(s.quotas),
		Instances:          s.instances,
		Windows:            s.windows,
		Grants:             len(s.grants),
		IdempotencyRecords: len(s.idem),
		TokensGranted:      s.tokensGranted,
	}
}

func grantView(q *quota, w *window, g *grant) GrantView {
	return GrantView{
		ID:            g.id,
		Quota:         q.name,
		Region:        g.region,
		WindowIndex:   w.index,
		Tokens:        g.tokens,
		Released:      g.released,
		GrantedUnixMs: g.grantedAt,
		ExpiresUnixMs: g.expires,
	}
}

// view copies window w of q, counting expired leases at asOf.
func view(q *quota, w *window, asOf int64) WindowView {
	v := WindowView{
		Quota:       q.name,
		Index:       w.index,
		StartUnixMs: lease.WindowStart(w.index, q.spec.WindowMs),
		EndUnixMs:   lease.WindowEnd(w.index, q.spec.WindowMs),
		Limit:       w.limit,
		Carried:     w.carried,
		Granted:     w.granted,
		Released:    w.released,
		Outstanding: w.granted - w.released,
		Remaining:   w.remaining(),
		Grants:      make([]GrantView, len(w.grants)),
	}
	rows := map[string]*RegionView{}
	row := func(r string) *RegionView {
		if rv, ok := rows[r]; ok {
			return rv
		}
		rv := &RegionView{Region: r}
		rows[r] = rv
		return rv
	}
	for i, g := range w.grants {
		v.Grants[i] = grantView(q, w, g)
		rv := row(g.region)
		rv.Granted += g.tokens
		rv.Released += g.released
		rv.Grants++
		if g.expires <= asOf {
			v.Expired += g.tokens - g.released
			rv.Expired += g.tokens - g.released
		}
	}
	for r := range q.demand {
		if d, fresh := q.freshDemand(r, asOf); fresh {
			rv := row(r)
			rv.DemandPerSecond, rv.DemandReportedUnixMs = d.rate, d.at
		}
	}
	v.Regions = make([]RegionView, 0, len(rows))
	for _, rv := range rows {
		rv.Outstanding = rv.Granted - rv.Released
		v.Regions = append(v.Regions, *rv)
	}
	slices.SortFunc(v.Regions, func(a, b RegionView) int {
		switch {
		case a.Region < b.Region:
			return -1
		case a.Region > b.Region:
			return 1
		}
		return 0
	})
	return v
}
