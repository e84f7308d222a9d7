package admission

import (
	"context"
	"errors"
	"fmt"
	"time"
)

// slotRef is one concurrency slot a decision holds: a member of a sorted set
// in the store, or a fallback counter in process.
type slotRef struct {
	key    string
	member string
	ttl    int64 // ms
	fb     *fbState
	// fbDeadline is when the fallback slot lapses (wall ms), which names
	// it among the state's slots.
	fbDeadline int64
}

// Release gives back the concurrency slots d holds, when the work they
// guard has finished (or failed). It is idempotent. Call it with a context of
// its own: the request's may be done. A slot that cannot be released now
// expires after the rule's slot_ttl.
func (e *Engine) Release(ctx context.Context, d *Decision) error {
	if d == nil {
		return nil
	}
	var errs []error
	for i := range d.slots {
		s := &d.slots[i]
		if s.fb != nil {
			e.fb.release(s.fb, s.fbDeadline)
			s.fb = nil
			continue
		}
		if s.key == "" {
			continue
		}
		o := &op{code: opRelease, now: e.storeNow(e.clock.Now()), keys: []string{s.key}, member: s.member}
		if err := e.run(ctx, o); err != nil {
			errs = append(errs, err)
			continue
		}
		s.key = ""
	}
	if len(errs) > 0 {
		return fmt.Errorf("release: %w", errors.Join(errs...))
	}
	return nil
}

// ReleaseRequest frees the concurrency slots that the request with
// req.RequestID took when it was decided with req.Descriptors, without the
// Decision: for callers that release from another process or after a
// restart (an agent's release endpoint, say). It returns how many slots it
// freed; 0 when they had expired or were released already. Slots taken by a
// fallback (in process, while the store was down) are only freed through the
// Decision.
func (e *Engine) ReleaseRequest(ctx context.Context, req *Request) (int64, error) {
	if req == nil || req.RequestID == "" {
		return 0, fmt.Errorf("request_id: required to find the slots: %w", ErrInvalidRequest)
	}
	items, _, err := e.plan(e.snap.Load(), req, nil, nil)
	if err != nil {
		return 0, err
	}
	var (
		released int64
		errs     []error
	)
	for i := range items {
		it := &items[i]
		if it.sp.kind != kindSlots {
			continue
		}
		o := &op{code: opRelease, now: e.storeNow(e.clock.Now()), keys: []string{it.key}, member: req.RequestID}
		if err := e.run(ctx, o); err != nil {
			errs = append(errs, err)
			continue
		}
		if len(o.out) == 1 {
			released += o.out[0]
		}
	}
	if len(errs) > 0 {
		return released, fmt.Errorf("release: %w", errors.Join(errs...))
	}
	return released, nil
}

// Renew extends every concurrency slot d holds to the rule's slot_ttl from
// now, for work that runs longer than expected. It fails with ErrSlotLost
// when a slot had already expired or been released: the work is then no
// longer counted and the caller should stop it or re-admit it.
func (e *Engine) Renew(ctx context.Context, d *Decision) error {
	if d == nil {
		return nil
	}
	for i := range d.slots {
		s := &d.slots[i]
		if s.key == "" {
			continue
		}
		o := &op{code: opRenew, now: e.storeNow(e.clock.Now()), keys: []string{s.key}, member: s.member, n1: s.ttl}
		if err := e.run(ctx, o); err != nil {
			return fmt.Errorf("renew: %w", err)
		}
		if len(o.out) != 1 || o.out[0] != 1 {
			return fmt.Errorf("renew: %w", ErrSlotLost)
		}
	}
	return nil
}

// run executes an operation off the decision path: through the breaker,
// bounded by ctx and, when ctx has no deadline, by a second.
func (e *Engine) run(ctx context.Context, o *op) error {
	if e.closed.Load() {
		return ErrClosed
	}
	if _, ok := ctx.Deadline(); !ok {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, time.Second)
		defer cancel()
	}
	refused, err := e.call(ctx, o, e.mono(e.clock.Now()), 0)
	switch {
	case refused:
		return err // ErrUnavailable and errBreakerOpen
	case err != nil:
		return fmt.Errorf("%w: %w", ErrUnavailable, err)
	}
	return nil
}
