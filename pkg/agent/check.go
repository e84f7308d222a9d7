package agent

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/allot-dev/allot/pkg/admission"
	"github.com/allot-dev/allot/pkg/policy"
)

// Input is one admission question, as Check and ShouldRateLimit deliver it.
type Input struct {
	// Descriptors describe the request, from verified claims only.
	Descriptors []policy.Entry
	// Cost multiplies every matched rule's cost (Envoy's hits_addend); 0
	// means 1.
	Cost int64
	// RequestID makes the decision idempotent and names concurrency slots.
	RequestID string
}

// Verdict is the agent's answer to one Input.
type Verdict struct {
	// Allowed is the verdict.
	Allowed bool
	// Unavailable is true when the limiter could not decide (503): a
	// fail-closed rule whose store did not answer, or a leased pool that ran
	// dry while the allocator was unreachable or too slow.
	Unavailable bool
	// Rule and Scope name the denying (or undecidable) rule; when allowed,
	// the tightest live rule (the least remaining), if any reported one.
	Rule  string
	Scope policy.Scope
	// RetryAfter is whole seconds to wait, rounded up (denials and
	// unavailable answers); -1 when waiting will not help.
	RetryAfter int64
	// Remaining is what the reported rule has left; -1 when unknown.
	Remaining int64
	// DecisionID identifies the decision in logs.
	DecisionID string
	// PolicyVersion is the version the decision was made under.
	PolicyVersion uint64
	// WouldDeny lists the shadow rules that would have denied.
	WouldDeny []string
	// Source says what decided (see admission.Source).
	Source admission.Source
	// Waited is how long the request waited for a lease renewal.
	Waited time.Duration
	// Rules is each matched rule's part of the decision (the engine's
	// results, which the verdict owns).
	Rules []admission.RuleResult
}

// verdictName is the metric label of v.
func (v *Verdict) verdictName() string {
	switch {
	case v.Allowed:
		return "allow"
	case v.Unavailable:
		return "unavailable"
	}
	return "deny"
}

// Check decides in. Bad input is an error wrapping ErrInvalidRequest or
// admission.ErrInvalidRequest (nothing debited); before the first policy it
// is ErrNotReady; when ctx ends before the store answers, ctx's error.
// Everything else is a Verdict: store trouble is decided by each rule's fail
// mode, and a leased pool that is short waits up to
// Config.StarveWait for a renewal this call asks for, then answers 429 when
// the global pool is exhausted for the window (Retry-After to its end) or
// 503 when the allocator cannot supply tokens.
func (a *Agent) Check(ctx context.Context, in *Input) (*Verdict, error) {
	eng := a.engine.Load()
	if eng == nil {
		return nil, ErrNotReady
	}
	switch {
	case in.Cost < 0:
		return nil, fmt.Errorf("cost: must not be negative, got %d: %w", in.Cost, ErrInvalidRequest)
	case in.Cost > admission.MaxHits:
		return nil, fmt.Errorf("cost: %d exceeds the maximum %d: %w", in.Cost, int64(admission.MaxHits), ErrInvalidRequest)
	}
	req := &admission.Request{Descriptors: in.Descriptors, Hits: in.Cost, RequestID: in.RequestID}
	var start, deadline time.Time
	for first := true; ; first = false {
		if !first {
			// Each decision of a starve wait is made by the engine in force
			// (one replaced meanwhile stays open until Run ends, see
			// Agent.install).
			eng = a.engine.Load()
		}
		seen := a.leases.Generation()
		d, err := eng.Decide(ctx, req)
		if err != nil {
			return nil, err
		}
		if d.Source == admission.SourceFailMode && ctx.Err() != nil {
			// The store had not answered when the caller's deadline passed
			// (or the caller left): the caller gets its context's error,
			// not a fail mode's verdict it can no longer use, which would
			// also read as the store failing.
			if d.HasSlots() {
				_ = eng.Release(context.WithoutCancel(ctx), d)
			}
			return nil, fmt.Errorf("decide: the call ended before the store answered: %w", ctx.Err())
		}
		rule, pool := poolDenial(d)
		if pool == "" {
			v := a.verdict(d)
			if !start.IsZero() {
				v.Waited = a.now().Sub(start)
				if v.Allowed {
					a.m.starveWaits.WithLabelValues("served").Inc()
				}
			}
			return a.finish(eng, d, v, in), nil
		}
		state, wait, ch := a.leases.starved(pool, seen)
		if start.IsZero() {
			var others []string
			for i := range d.Rules {
				if r := &d.Rules[i]; r.Kind == policy.KindGlobalQuota && r.Pool != pool && !r.Shadow {
					others = append(others, r.Pool)
				}
			}
			a.leases.touch(others)
		}
		switch state {
		case poolExhausted:
			v := a.verdict(d)
			v.RetryAfter = max(v.RetryAfter, ceilSeconds(wait))
			if !start.IsZero() {
				a.m.starveWaits.WithLabelValues("exhausted").Inc()
			}
			return a.finish(eng, d, v, in), nil
		case poolCutOff, poolRefused:
			why := "cut_off"
			if state == poolRefused {
				why = "refused"
			}
			a.m.failMode.WithLabelValues(rule, why).Inc()
			if !start.IsZero() {
				a.m.starveWaits.WithLabelValues(why).Inc()
			}
			return a.finish(eng, d, a.unavailable(d, ceilSeconds(wait)), in), nil
		}
		now := a.now()
		if start.IsZero() {
			start, deadline = now, now.Add(a.cfg.StarveWait)
		}
		left := deadline.Sub(now)
		if left <= 0 {
			a.m.starveWaits.WithLabelValues("timeout").Inc()
			a.log.Debug("no renewal within the starve wait", zap.String("quota", pool), zap.Duration("waited", now.Sub(start)))
			return a.finish(eng, d, a.unavailable(d, 1), in), nil
		}
		t := time.NewTimer(left)
		select {
		case <-ch:
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return nil, ctx.Err()
		}
		t.Stop()
	}
}

// poolDenial returns the rule and the leased pool (the rule's own, or an
// instance of a template) that denied d, if a pool (and not a live rule
// before it) is why d was denied.
func poolDenial(d *admission.Decision) (rule, pool string) {
	if d.Outcome != admission.Deny || d.Source == admission.SourceFailMode {
		return "", ""
	}
	for i := range d.Rules {
		r := &d.Rules[i]
		if r.Rule == d.Rule && !r.Shadow && !r.Allowed {
			if r.Kind == policy.KindGlobalQuota {
				return r.Rule, r.Pool
			}
			return "", ""
		}
	}
	return "", ""
}

// verdict converts an engine decision.
func (a *Agent) verdict(d *admission.Decision) *Verdict {
	v := &Verdict{
		Allowed: d.Allowed(), Unavailable: d.Outcome == admission.Unavailable, Rule: d.Rule, Scope: d.Scope,
		RetryAfter: d.RetryAfter, Remaining: d.Remaining, DecisionID: d.ID, PolicyVersion: d.PolicyVersion, Source: d.Source,
		Rules: d.Rules,
	}
	if v.Allowed {
		v.RetryAfter = 0
		best := int64(-1)
		for i := range d.Rules {
			r := &d.Rules[i]
			if !r.Shadow && r.Remaining >= 0 && (best < 0 || r.Remaining < best) {
				best, v.Rule, v.Scope = r.Remaining, r.Rule, r.Scope
			}
		}
	}
	for i := range d.Rules {
		if r := &d.Rules[i]; r.Shadow && !r.Allowed {
			v.WouldDeny = append(v.WouldDeny, r.Rule)
		}
	}
	return v
}

// unavailable is d's verdict turned into a 503: the pool that denied it
// cannot be refilled (the limiter's problem, not the caller's).
func (a *Agent) unavailable(d *admission.Decision, retry int64) *Verdict {
	v := a.verdict(d)
	v.Unavailable = true
	v.RetryAfter = max(retry, 1)
	return v
}

// finish records metrics, the sampled decision log and the slots a
// decision of eng holds in process.
func (a *Agent) finish(eng *admission.Engine, d *admission.Decision, v *Verdict, in *Input) *Verdict {
	rule := v.Rule
	if rule == "" {
		rule = "none"
	}
	a.m.decisions.WithLabelValues(rule, v.verdictName()).Inc()
	for i := range d.Rules {
		if r := &d.Rules[i]; r.FailMode != "" {
			a.m.failMode.WithLabelValues(r.Rule, string(r.FailMode)).Inc()
			if r.Kind == policy.KindConcurrency && r.Allowed && v.Allowed {
				// A slot taken by the fail-mode fallback lives in this
				// process: remember the decision so ReleaseSlot frees it.
				id := in.RequestID
				if id == "" {
					id = d.ID
				}
				a.slots.put(tenantOf(in.Descriptors), id, heldSlots{eng, d})
			}
		}
	}
	a.dlog.log(v, in)
	return v
}

func ceilSeconds(d time.Duration) int64 {
	if d <= 0 {
		return 0
	}
	return int64(math.Ceil(d.Seconds()))
}

// ReleaseSlot frees the concurrency slots the request named requestID took
// when it was checked with descriptors; it returns how many it freed (0 when
// they had expired or were released already). It is idempotent and does not
// depend on this process having made the decision: slots in the store are
// found from the descriptors and removed by request id. Slots a fail-mode
// fallback took in this process are freed only for the tenant (the
// descriptors' tenant entry) that took them. When the store cannot be
// reached the error wraps ErrUnavailable and says so without the store's
// details (they are logged); when ctx ends first it wraps ctx's error.
func (a *Agent) ReleaseSlot(ctx context.Context, descriptors []policy.Entry, requestID string) (int64, error) {
	eng := a.engine.Load()
	if eng == nil {
		return 0, ErrNotReady
	}
	if requestID == "" {
		return 0, fmt.Errorf("request_id: required (the id given to Check, or its decision_id): %w", ErrInvalidRequest)
	}
	// The engine finds the request's slot sets from the descriptors and
	// removes the request id from each: the store holds the truth, whichever
	// agent or gateway took the slots.
	released, err := eng.ReleaseRequest(ctx, &admission.Request{Descriptors: descriptors, RequestID: requestID})
	if err != nil && errors.Is(err, admission.ErrInvalidRequest) {
		return 0, err
	}
	var errs []error
	if err != nil {
		errs = append(errs, fmt.Errorf("in the store: %w", err))
	}
	// Slots a fallback took live in this process and are freed here even
	// when the store cannot be reached: left held they would deny the
	// rule's requests until their slot_ttl ran out.
	for _, h := range a.slots.take(tenantOf(descriptors), requestID) {
		d := h.d
		for i := range d.Rules {
			if r := &d.Rules[i]; r.Kind == policy.KindConcurrency && r.Allowed && r.FailMode != "" {
				released++
			}
		}
		// The engine that took them: their fallback's state is its own.
		if err := h.eng.Release(ctx, d); err != nil {
			errs = append(errs, fmt.Errorf("of decision %s: %w", d.ID, err))
		}
	}
	if len(errs) == 0 {
		return released, nil
	}
	return released, a.releaseError(ctx, requestID, errors.Join(errs...))
}

// releaseError is what ReleaseSlot of id answers when releasing failed with
// err: the end of ctx when the caller left or its deadline passed, else that
// the store is unavailable. The store's own error (its address, the
// dialer's message) is logged, not handed to the caller.
func (a *Agent) releaseError(ctx context.Context, id string, err error) error {
	if cerr := ctx.Err(); cerr != nil {
		a.log.Debug("release slots: the call ended before the store answered", zap.String("request_id", id), zap.Error(err))
		return &publicError{msg: fmt.Sprintf("release slots of %s: the call ended before the store answered: %v", id, cerr), errs: []error{cerr}}
	}
	a.log.Warn("release slots: the store is unavailable", zap.String("request_id", id), zap.Error(err))
	return &publicError{
		msg:  fmt.Sprintf("release slots of %s: the regional store is unavailable; the slots expire after their slot_ttl", id),
		errs: []error{ErrUnavailable, admission.ErrUnavailable},
	}
}

// tenantOf is the value of the tenant entry of descriptors, "" when there is
// none.
func tenantOf(descriptors []policy.Entry) string {
	for _, e := range descriptors {
		if e.Key == "tenant" {
			return e.Value
		}
	}
	return ""
}

// slotKey names the fallback slots of one request: its tenant and its id,
// so that one tenant cannot release another's slots by reusing an id.
type slotKey struct{ tenant, id string }

// heldSlots is a decision holding fallback slots, and the engine that made
// it.
type heldSlots struct {
	eng *admission.Engine
	d   *admission.Decision
}

// slotEntry is the decisions stored under one slotKey (a retried request
// id takes slots again while the store is down) and when the key was
// stored, which names it in the table's fifo.
type slotEntry struct {
	ds  []heldSlots
	seq uint64
}

// slotTable remembers, by tenant and request id, the decisions holding slots
// taken by a fail-mode fallback in this process (the store knows nothing of
// them), so that ReleaseSlot can free them. It is bounded to max decisions:
// the oldest keys go first.
type slotTable struct {
	mu   sync.Mutex
	max  int
	n    int // decisions held
	seq  uint64
	m    map[slotKey]*slotEntry
	fifo []slotRef
}

// slotRef is a key as it was put in the fifo; seq tells whether the key was
// taken (and maybe stored again) since.
type slotRef struct {
	key slotKey
	seq uint64
}

func newSlotTable(max int) *slotTable {
	return &slotTable{max: max, m: map[slotKey]*slotEntry{}}
}

// put stores d under tenant and id, next to the decisions stored there
// already.
func (s *slotTable) put(tenant, id string, d heldSlots) {
	if s.max == 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	k := slotKey{tenant, id}
	for s.n >= s.max && len(s.fifo) > 0 {
		old := s.fifo[0]
		s.fifo = s.fifo[1:]
		if e, ok := s.m[old.key]; ok && e.seq == old.seq {
			s.n -= len(e.ds)
			delete(s.m, old.key)
		}
	}
	e, ok := s.m[k]
	if !ok {
		s.seq++
		e = &slotEntry{seq: s.seq}
		s.m[k] = e
		s.fifo = append(s.fifo, slotRef{k, e.seq})
	}
	e.ds = append(e.ds, d)
	s.n++
}

// take removes and returns every decision stored under tenant and id.
func (s *slotTable) take(tenant, id string) []heldSlots {
	s.mu.Lock()
	defer s.mu.Unlock()
	k := slotKey{tenant, id}
	e, ok := s.m[k]
	if !ok {
		return nil
	}
	delete(s.m, k)
	s.n -= len(e.ds)
	if len(s.fifo) > 2*s.max+16 { // compact keys already taken
		live := s.fifo[:0]
		for _, r := range s.fifo {
			if e, ok := s.m[r.key]; ok && e.seq == r.seq {
				live = append(live, r)
			}
		}
		s.fifo = live
	}
	return e.ds
}
