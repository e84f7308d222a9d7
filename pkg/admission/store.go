package admission

import (
	"context"
	"encoding/binary"
	"math"
	"slices"
	"strconv"
	"sync/atomic"
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
	// shard returns the index, in [0, maxShards), of the part of the store
	// that serves key, an op's first key (all keys of an op share one hash
	// tag, so one slot): on Redis Cluster the master that owns the key's
	// slot, elsewhere 0. The engine keeps a circuit breaker per shard, and
	// a RedisStore a batcher per shard, so that one slow or dead node does
	// not stop the calls of the others. It never waits on the network.
	shard(key string) int
}

// maxShards bounds the shards of a store (Store.shard): a power of two,
// so that an index masked with maxShards-1 needs no bounds check.
const maxShards = 64

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
}

// packedRuleLen is the length of a packed rule argument.
const packedRuleLen = 1 + 4 + 4*8 + 1

// packRule appends a rule's part of the script's rules argument to dst,
// laid out as the script's struct.unpack('<BIddddB') reads it: kind, key
// index, a, b, c, d (as doubles, which is what Lua numbers are: exact up to
// 2^53) and the shadow flag. Binary numbers cost the script a fraction of
// what seven decimal arguments cost to create and convert (measured: ~0.03
// against ~0.5 µs per rule).
func packRule(dst []byte, kind, key int, a, b, c, d int64, shadow bool) []byte {
	dst = append(dst, byte(kind))
	dst = binary.LittleEndian.AppendUint32(dst, uint32(key))
	for _, v := range [4]int64{a, b, c, d} {
		dst = binary.LittleEndian.AppendUint64(dst, math.Float64bits(float64(v)))
	}
	if shadow {
		return append(dst, 1)
	}
	return append(dst, 0)
}

// packedRules is a decide's or a refund's rules packed into the script's
// one rules argument (packRule's layout, rule after rule). One argument for
// all rules, rather than one per rule, spares Redis an argument to parse and
// the script a string to intern for each rule. go-redis reads it through
// MarshalBinary, so a pointer to it goes into the argument list without
// boxing, and a decision of up to four rules packs into arr without
// allocating.
type packedRules struct {
	b   []byte
	arr [4 * packedRuleLen]byte
}

// MarshalBinary returns the packed rules; go-redis writes them as the
// argument.
func (p *packedRules) MarshalBinary() ([]byte, error) { return p.b, nil }

// pack packs rules into p.
func (p *packedRules) pack(rules []ruleArg) {
	p.b = p.arr[:0]
	for _, r := range rules {
		p.b = packRule(p.b, r.kind, r.key, r.a, r.b, r.c, r.d, r.shadow)
	}
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
	shard   uint8         // Store.shard of keys[0], set by Engine.call: the batcher it joins

	out   []int64 // decide: replay, firstDeny, then 4 per rule; others: the script's array
	outID string  // decide: the decision id (the earlier one on a replay)
	err   error
	done  chan struct{} // room for one signal: see finish
	// state says who owns a call queued in a RedisStore's batcher (opQueued,
	// opTaken, opAbandoned); changed only by CAS (claim, abandon), so that
	// of a caller giving up and the batcher sending, exactly one wins.
	state int32
	// moving is set (atomically) by a RedisStore while Redis Cluster has
	// refused the call with TRYAGAIN (its slot is being moved) and it
	// waits to be sent again: a caller that stops waiting meanwhile gives
	// up on a node that was serving (errSlotMoving), which its shard's
	// breaker does not count.
	moving int32

	// keys and rules of a small decide use these: with ops reused (see
	// Engine.recycle), a decision of up to four rules allocates neither.
	keyBuf  [6]string
	ruleBuf [4]ruleArg
	packed  packedRules // rules packed for the script (appendArgs with refs)
}

// finish signals the caller waiting on done that o is complete. done has
// room for the one signal, so finish never blocks, even when the caller has
// stopped waiting.
func (o *op) finish() { o.done <- struct{}{} }

// Who owns a call queued in a RedisStore's batcher (op.state).
const (
	opQueued    int32 = iota // waiting to be sent: the caller may still abandon it
	opTaken                  // taken by the batcher to be sent: it may reach Redis
	opAbandoned              // its caller gave up first: it is never sent
)

// claim takes o for sending. It fails when o's caller has abandoned it.
func (o *op) claim() bool { return atomic.CompareAndSwapInt32(&o.state, opQueued, opTaken) }

// abandon gives up on o before it is sent. It fails when the batcher has
// taken o already: o may then reach Redis, and its outcome is unknown.
func (o *op) abandon() bool { return atomic.CompareAndSwapInt32(&o.state, opQueued, opAbandoned) }

// abandoned reports whether o's caller has given up on it before it was
// taken; once set, that never changes.
func (o *op) abandoned() bool { return atomic.LoadInt32(&o.state) == opAbandoned }

// drop finishes an abandoned o without sending it.
func (o *op) drop() {
	o.err = errDropped
	o.finish()
}

// args encodes o's ARGV for the script.
func (o *op) args(text bool) []any { return o.appendArgs(nil, text, false) }

// appendArgs appends o's ARGV for the script to a; text asks a decide or a
// refund to write counter state in the text form (RedisConfig.StateForm).
//
// refs passes a decide's or a refund's strings and numbers as pointers
// into o, which go-redis writes as their values: boxing a string or an
// int64 of 256 or more into an interface allocates, a pointer does not.
// The list is then valid only while o is not reused, which the store's
// pipeline guarantees (it drops the list before it finishes o).
func (o *op) appendArgs(a []any, text, refs bool) []any {
	switch o.code {
	case opDecide, opRefund:
		a = slices.Grow(a, 8)
		var now, id, member, idemTTL any
		if refs {
			now, id, member, idemTTL = &o.now, &o.id, &o.member, &o.idemTTL
		} else {
			now, id, member, idemTTL = o.now, o.id, o.member, o.idemTTL
		}
		if o.member == o.id {
			member = id // box the string once
		}
		name := opName(o.code)
		if text {
			name = textOpName(o.code)
		}
		a = append(a, name, now, id, member, idemTTL, len(o.rules), o.strKeys)
		if refs {
			o.packed.pack(o.rules)
			return append(a, &o.packed)
		}
		var p packedRules
		p.pack(o.rules)
		return append(a, string(p.b))
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

// textOpName returns ARGV[1] of a decide or a refund that writes counter
// state in the text form.
func textOpName(code byte) any {
	if code == opRefund {
		return "R"
	}
	return "D"
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
