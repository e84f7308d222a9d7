package fsm

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"

	"github.com/allot-dev/allot/pkg/lease"
)

// Quota templates. A QuotaSpec with TemplateKeys > 0 is a template: it has
// no pool of its own, and every name "<template>/<values>" (the syntax of
// policy.InstanceName) is a pool of its own, an instance, with the
// template's spec. An instance comes into being on the first Acquire that
// names it and is forgotten as soon as it holds nothing visible: no window
// that is the current or the previous one, and no fresh demand report. That
// instant is its death, a pure function of its state:
//
//	death = max(end of the window after its latest window,
//	            latest demand report + 2 x TTL + 1)
//
// An Acquire of an instance opens its current window (or, for a pre-grant,
// the next) and records its demand at now, so its death becomes the largest
// of its template's list (see listPlain): the instances of a template, kept
// in two lists in the order of their last Acquire, are in the order of their
// deaths in each. Collecting the dead ones is
// popping the front of the list; it is invisible (only the live instances
// reach a result, a read or a snapshot), which makes the number of live
// instances, the one the cap MaxInstancesPerTemplate counts, the same on a
// replica that replayed the log and on one restored from a snapshot.

// instanceSep separates a template's name from its instance's values.
const instanceSep = "/"

// isTemplate reports whether q is a template.
func (q *quota) isTemplate() bool { return q.spec.TemplateKeys > 0 }

// computeDeath returns the first instant at which instance q holds nothing
// visible (see the comment at the top of this file).
func (q *quota) computeDeath() int64 {
	d := int64(math.MinInt64)
	if n := len(q.windows); n > 0 {
		d = lease.WindowEnd(q.windows[n-1].index+1, q.spec.WindowMs)
	}
	for _, dm := range q.demand { // a max: the order does not matter
		d = max(d, dm.at+2*q.spec.TTLMs+1)
	}
	return d
}

// alive reports whether instance q is part of the logical state at now.
func (q *quota) alive(now int64) bool { return now < q.death }

// instList is a doubly linked list of a template's instances in order of
// death.
type instList struct{ head, tail *quota }

// A template keeps its instances in two lists, each in order of death:
// listPlain holds those whose latest window is the one they were last
// acquired in (death: end of the window after it), listPregranted those
// that also hold a pre-grant of the next window (death: one window later).
// Within each list the order of the last Acquire is the order of death, so
// touching an instance is O(1) and collecting the dead pops list fronts; one
// list would need a sorted insert, O(instances) per Acquire in the worst
// case, once pre-grants and plain grants interleave.
const (
	listPlain = iota
	listPregranted
)

// listOf returns the list instance i belongs in at now.
func listOf(i *quota, now int64) uint8 {
	if n := len(i.windows); n > 0 && i.windows[n-1].index > i.currentIndex(now) {
		return listPregranted
	}
	return listPlain
}

// pushBack appends instance i to template t's list k.
func (t *quota) pushBack(i *quota, k uint8) {
	l := &t.lists[k]
	i.list, i.prev, i.next = k, l.tail, nil
	if l.tail != nil {
		l.tail.next = i
	} else {
		l.head = i
	}
	l.tail = i
}

// unlink takes instance i out of its list of template t.
func (t *quota) unlink(i *quota) {
	l := &t.lists[i.list]
	if i.prev != nil {
		i.prev.next = i.next
	} else {
		l.head = i.next
	}
	if i.next != nil {
		i.next.prev = i.prev
	} else {
		l.tail = i.prev
	}
	i.prev, i.next = nil, nil
}

// expire forgets template t's instances that are dead at now.
func (s *state) expire(t *quota, now int64) {
	for k := range t.lists {
		for t.lists[k].head != nil && !t.lists[k].head.alive(now) {
			i := t.lists[k].head
			t.unlink(i)
			delete(t.instances, i.name)
			s.dropWindows(i)
			s.instances--
		}
	}
}

// deadBy counts template t's instances that are dead at now, without
// forgetting them (they are at the fronts of the lists).
func (t *quota) deadBy(now int64) int {
	n := 0
	for k := range t.lists {
		for i := t.lists[k].head; i != nil && !i.alive(now); i = i.next {
			n++
		}
	}
	return n
}

// touch records that instance i was acquired at now: its death moves to
// the largest of its list, so it goes to the back of that list.
func (t *quota) touch(i *quota, now int64) {
	i.death = i.computeDeath()
	t.unlink(i)
	t.pushBack(i, listOf(i, now))
}

// dropInstances forgets every instance of template t.
func (s *state) dropInstances(t *quota) {
	for _, i := range t.instanceList() {
		s.dropWindows(i)
		s.instances--
	}
	t.instances, t.lists = nil, [2]instList{}
}

// instanceList returns template t's instances, list by list.
func (t *quota) instanceList() []*quota {
	out := make([]*quota, 0, len(t.instances))
	for k := range t.lists {
		for i := t.lists[k].head; i != nil; i = i.next {
			out = append(out, i)
		}
	}
	return out
}

// relink rebuilds template t's lists from its instances, sorted by death
// (then name, so that the order is the same on every replica), after their
// deaths were computed afresh.
func (t *quota) relink(is []*quota, now int64) {
	slices.SortFunc(is, func(a, b *quota) int { return cmp.Or(cmp.Compare(a.death, b.death), strings.Compare(a.name, b.name)) })
	t.lists = [2]instList{}
	for _, i := range is {
		t.pushBack(i, listOf(i, now))
	}
}

// errInstanceSyntax is the cause checkInstanceSuffix reports.
var errInstanceSyntax = errors.New("not <template>/<value>[/<value>...] as policy.InstanceName writes it")

// checkInstanceSuffix checks the part of an instance name after
// "<template>/" for a template with keys value-less entries: either the
// hashed form "#" and 32 lowercase hex digits, or exactly keys values, each
// non-empty, with '%', '/', '#', '{' and '}' (and only those) written %XX in
// uppercase hex. It is policy.ParseInstanceName's syntax, checked here so
// that the state machine depends on no policy code.
func checkInstanceSuffix(suffix string, keys int) error {
	if strings.HasPrefix(suffix, "#") {
		h := suffix[1:]
		if len(h) != 32 || strings.IndexFunc(h, func(r rune) bool { return !(r >= '0' && r <= '9' || r >= 'a' && r <= 'f') }) >= 0 {
			return fmt.Errorf("hashed instance: want '#' and 32 lowercase hex digits: %w", errInstanceSyntax)
		}
		return nil
	}
	n := 1
	seg := 0 // bytes in the current value
	for i := 0; i < len(suffix); i++ {
		switch c := suffix[i]; c {
		case '/':
			if seg == 0 {
				return fmt.Errorf("value %d is empty: %w", n, errInstanceSyntax)
			}
			n, seg = n+1, 0
			continue
		case '%':
			if i+2 >= len(suffix) {
				return fmt.Errorf("value %d: truncated escape: %w", n, errInstanceSyntax)
			}
			d, ok := unhex(suffix[i+1], suffix[i+2])
			if !ok || !strings.ContainsRune("%/#{}", rune(d)) {
				return fmt.Errorf("value %d: escape %q: %w", n, suffix[i:i+3], errInstanceSyntax)
			}
			i += 2
		case '#', '{', '}':
			return fmt.Errorf("value %d: unescaped %q: %w", n, c, errInstanceSyntax)
		}
		seg++
	}
	if seg == 0 {
		return fmt.Errorf("value %d is empty: %w", n, errInstanceSyntax)
	}
	if n != keys {
		return fmt.Errorf("%d values, the template has %d value-less match entries: %w", n, keys, errInstanceSyntax)
	}
	return nil
}

// unhex decodes two uppercase hex digits.
func unhex(a, b byte) (byte, bool) {
	const digits = "0123456789ABCDEF"
	hi, lo := strings.IndexByte(digits, a), strings.IndexByte(digits, b)
	if hi < 0 || lo < 0 {
		return 0, false
	}
	return byte(hi<<4 | lo), true
}

// lookupQuota resolves the quota a want or a read names: a single pool, or
// an instance of a template in force. For an instance that is not alive at
// now it returns a nil quota and the template; a caller that creates it
// must check the cap. Errors start with the quoted name, for the caller to
// prefix with its field: a template named itself is ErrInvalidArgument, a
// name of no quota or of an instance of a single pool ErrUnknownQuota, a
// malformed instance ErrInvalidArgument.
func (s *state) lookupQuota(name string, now int64) (q, tmpl *quota, err error) {
	if q, ok := s.quotas[name]; ok {
		if q.isTemplate() {
			return nil, nil, fmt.Errorf("%q: a template, not a pool: name one of its instances, %s%s<value>: %w",
				name, name, instanceSep, ErrInvalidArgument)
		}
		return q, nil, nil
	}
	tname, suffix, found := strings.Cut(name, instanceSep)
	t, ok := s.quotas[tname]
	switch {
	case !found || !ok:
		return nil, nil, fmt.Errorf("%q: %w", name, ErrUnknownQuota)
	case !t.isTemplate():
		return nil, nil, fmt.Errorf("%q: %q is a single pool, not a template: %w", name, tname, ErrUnknownQuota)
	}
	if err := checkInstanceSuffix(suffix, t.spec.TemplateKeys); err != nil {
		return nil, nil, fmt.Errorf("%q: %w: %w", name, err, ErrInvalidArgument)
	}
	if i, ok := t.instances[name]; ok && i.alive(now) {
		return i, t, nil
	}
	return nil, t, nil
}

// newInstance creates instance name of template t, alive from now on (the
// caller opens its window and touches it).
func (s *state) newInstance(t *quota, name string) *quota {
	i := &quota{name: name, spec: t.spec, tmpl: t}
	if t.instances == nil {
		t.instances = map[string]*quota{}
	}
	t.instances[name] = i
	t.pushBack(i, listPlain)
	s.instances++
	return i
}
