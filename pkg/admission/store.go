package admission

import (
	"context"
	"slices"
	"strconv"
	"time"
)

// Store is where the counters live and where a group of rules sharing one
// hash tag is decided atomically. It is implemented by *MemoryStore (the
// embedded, single-process store) and *RedisStore (Redis standalone or
// Cluster); both run the same operations with the same results.
type Store interface {
	// run executes o and fills its results, or returns an error (the caller's
	// fail mode decides). It returns when o is done, when ctx ends, or when
	// o.timeout (if positive) has passed.
	run(ctx context.Context, o *op) error
}

// Store operation codes; see script.lua.
const (
	opDecide  = 'd'
	opRefund  = 'r'
	opTake    = 't'
	opDeposit = 'p'
	opStats   = 's'
	opExhaust = 'e'
	opRelease = 'x'
	opRenew   = 'n'
)

// Rule kinds as the script numbers them.
const (
	kindBucket  = 1
	kindFixed   = 2
	kindSliding = 3
	kindSlots   = 4
	kindPool    = 5
)

// ruleArg is one rule of a decide or refund operation.
type ruleArg struct {
	kind       int
	key        int // 1-based index of the rule's (first) key in op.keys, as in Lua
	a, b, c, d int64
	shadow     bool
	box        *argBox // the same arguments boxed once per policy version; may be nil
}

// argBox holds a rule's script arguments already converted to interface
// values, so that encoding a call does not allocate for them.
type argBox struct {
	kind, a, b, d, shadow any
	unit                  int64 // the cost of one hit; unitBox is it boxed
	unitBox               any
}

func newArgBox(kind int, a, b, d, unit int64, shadow bool) *argBox {
	sh := "0"
	if shadow {
		sh = "1"
	}
	return &argBox{kind: kind, a: a, b: b, d: d, shadow: sh, unit: unit, unitBox: unit}
}

// op is one store operation. The arguments are set by the engine; the store
// sets out, outID and err. Keys: for decide and refund, keys[0] is the
// idempotency key, then the keys of the rules with string state (buckets and
// windows), then the others (a slot set; a pool's set and hash), each rule
// naming its key by index; for pool operations keys are the pool's sorted set
// and hash; for slots, the set.
type op struct {
	code    byte
	now     int64 // milliseconds; 0 means the store's own clock
	keys    []string
	id      string // decision id
	member  string // concurrency slot member, or grant id for deposit
	idemTTL int64  // milliseconds; 0 disables the idempotency record
	rules   []ruleArg
	strKeys int           // decide, refund: keys[1:1+strKeys] hold string state (one MGET)
	n1, n2  int64         // take: want; deposit: tokens, ttl; exhaust: ms; renew: ttl
	n3      int64         // deposit: ms until a pre-grant's window opens (0: now)
	timeout time.Duration // the caller stops waiting after it; 0: only ctx

	out   []int64 // decide: replay, firstDeny, then 4 per rule; others: the script's array
	outID string  // decide: the decision id (the earlier one on a replay)
	err   error
	done  chan struct{} // room for one signal: see finish

	// keys and rules of a small decide use these, saving two allocations.
	keyBuf  [3]string
	ruleBuf [1]ruleArg
}

// finish signals the caller waiting on done that o is complete. done has
// room for the one signal, so finish never blocks, even when the caller has
// stopped waiting.
func (o *op) finish() { o.done <- struct{}{} }

// args encodes o's ARGV for the script.
func (o *op) args() []any { return o.appendArgs(nil) }

// appendArgs appends o's ARGV for the script to a.
func (o *op) appendArgs(a []any) []any {
	switch o.code {
	case opDecide, opRefund:
		a = slices.Grow(a, 7+7*len(o.rules))
		var id, member any = o.id, o.member
		if o.member == o.id {
			member = id // box the string once
		}
		a = append(a, opName(o.code), o.now, id, member, o.idemTTL, len(o.rules), o.strKeys)
		for _, r := range o.rules {
			if b := r.box; b != nil {
				c := b.unitBox
				if r.c != b.unit {
					c = r.c
				}
				a = append(a, b.kind, r.key, b.a, b.b, c, b.d, b.shadow)
				continue
			}
			sh := "0"
			if r.shadow {
				sh = "1"
			}
			a = append(a, r.kind, r.key, r.a, r.b, r.c, r.d, sh)
		}
		return a
	case opTake, opExhaust:
		return append(a, opName(o.code), o.now, o.n1)
	case opDeposit:
		return append(a, opName(o.code), o.now, o.member, o.n1, o.n2, o.n3)
	case opStats:
		return append(a, opName(o.code), o.now)
	case opRelease:
		return append(a, opName(o.code), o.now, o.member)
	case opRenew:
		return append(a, opName(o.code), o.now, o.member, o.n1)
	}
	return append(a, opName(o.code))
}

// ScriptCall is one invocation of the admission script: what the engine
// would send for a request. It exists for benchmarks (allotbench's raw
// modes) and for debugging. The ARGV layout is the script's private
// contract and changes with it: do not parse it (to free a request's slots,
// use Engine.ReleaseRequest).
type ScriptCall struct {
	// Keys are the script's KEYS, all sharing one hash tag.
	Keys []string
	// Args are the script's ARGV.
	Args []any
}

// String formats the call as an EVALSHA command line.
func (c ScriptCall) String() string {
	s := "EVALSHA " + ScriptSHA() + " " + strconv.Itoa(len(c.Keys))
	for _, k := range c.Keys {
		s += " " + k
	}
	for _, a := range c.Args {
		switch v := a.(type) {
		case string:
			s += " " + v
		case int:
			s += " " + strconv.Itoa(v)
		case int64:
			s += " " + strconv.FormatInt(v, 10)
		}
	}
	return s
}

// opName returns the operation's ARGV[1] as a constant string, which boxes
// without allocating.
func opName(code byte) any {
	switch code {
	case opDecide:
		return "d"
	case opRefund:
		return "r"
	case opTake:
		return "t"
	case opDeposit:
		return "p"
	case opStats:
		return "s"
	case opExhaust:
		return "e"
	case opRelease:
		return "x"
	case opRenew:
		return "n"
	}
	return "?"
}
