package admission

import (
	"context"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
)

// MemoryConfig configures a MemoryStore.
type MemoryConfig struct {
	// MaxKeys caps the live keys the store holds; an operation that would
	// create one more fails with ErrStoreFull (and the rule's fail mode
	// decides) rather than let memory grow without bound.
	MaxKeys int
}

// DefaultMemoryConfig returns a store of at most one million keys.
func DefaultMemoryConfig() MemoryConfig { return MemoryConfig{MaxKeys: 1_000_000} }

// Validate says what is wrong with c, or returns nil.
func (c MemoryConfig) Validate() error {
	if c.MaxKeys < 1 {
		return fmt.Errorf("memory store config: MaxKeys must be at least 1, got %d", c.MaxKeys)
	}
	return nil
}

// MemoryStore is the embedded in-process store (the reference design's V0):
// the same operations as the Redis script, on maps guarded by one mutex per
// shard of hash tags, so all keys of a tenant are decided atomically. It is
// correct for exactly one process: counters are private to it and lost on
// restart. Idle keys expire as in Redis, lazily and by sampling on writes.
type MemoryStore struct {
	clock  Clock
	max    int64
	keys   atomic.Int64
	shards [memShards]memShard
}

const memShards = 64

type memShard struct {
	mu sync.Mutex
	m  map[string]*mentry
	_  [40]byte // keep shards on separate cache lines
}

// mentry is one key: a hash (h), a sorted set (z) or a string (s).
type mentry struct {
	expireAt int64 // ms; 0 never
	h        map[string]int64
	z        map[string]int64
	s        string
}

var _ Store = (*MemoryStore)(nil)

// NewMemoryStore returns an empty store that reads time from clock (nil for
// the system clock).
func NewMemoryStore(cfg MemoryConfig, clock Clock) (*MemoryStore, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if clock == nil {
		clock = SystemClock{}
	}
	s := &MemoryStore{clock: clock, max: int64(cfg.MaxKeys)}
	for i := range s.shards {
		s.shards[i].m = make(map[string]*mentry)
	}
	return s, nil
}

// Len returns the number of keys held, expired ones included until swept.
func (s *MemoryStore) Len() int { return int(s.keys.Load()) }

// Keys returns the names of the live keys, sorted; for tests and debugging.
func (s *MemoryStore) Keys() []string {
	now := s.clock.Now().UnixMilli()
	var out []string
	for i := range s.shards {
		sh := &s.shards[i]
		sh.mu.Lock()
		for k, e := range sh.m {
			if e.expireAt == 0 || e.expireAt > now {
				out = append(out, k)
			}
		}
		sh.mu.Unlock()
	}
	slices.Sort(out)
	return out
}

// hashTag returns the part of key Redis Cluster hashes: the text between the
// first '{' and the next '}', when non-empty.
func hashTag(key string) string {
	if i := strings.IndexByte(key, '{'); i >= 0 {
		if j := strings.IndexByte(key[i+1:], '}'); j > 0 {
			return key[i+1 : i+1+j]
		}
	}
	return key
}

func fnv32(s string) uint32 {
	h := uint32(2166136261)
	for i := 0; i < len(s); i++ {
		h ^= uint32(s[i])
		h *= 16777619
	}
	return h
}

// shard is 0: the embedded store is one shard for the engine's breaker
// (its own locks are striped by hash tag, but it fails as one).
func (s *MemoryStore) shard(string) int { return 0 }

func (s *MemoryStore) run(ctx context.Context, o *op) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if len(o.keys) == 0 {
		return fmt.Errorf("memory store: operation %q without keys", o.code)
	}
	sh := &s.shards[fnv32(hashTag(o.keys[0]))%memShards]
	now := o.now
	if now == 0 {
		now = s.clock.Now().UnixMilli()
	}
	sh.mu.Lock()
	defer sh.mu.Unlock()
	x := &memExec{s: s, sh: sh, now: now}
	x.sweep()
	// Reserve room for every key the operation may create before it writes
	// anything, so a full store fails an operation whole, never half-done.
	missing := int64(0)
	for i, k := range o.keys {
		if i == 0 && (o.code == opRefund || o.code == opDecide && o.idemTTL == 0) {
			continue // the idempotency key is written only by a decide with a TTL
		}
		if x.get(k) == nil {
			missing++
		}
	}
	if missing > 0 && s.keys.Load()+missing > s.max {
		return ErrStoreFull
	}
	x.exec(o)
	return x.err
}

// memExec runs one operation on one locked shard.
type memExec struct {
	s   *MemoryStore
	sh  *memShard
	now int64
	err error
}

func (x *memExec) sweep() {
	n := 0
	for k, e := range x.sh.m { // map order is random: a sample, as in Redis
		if n++; n > 8 {
			break
		}
		if e.expireAt != 0 && e.expireAt <= x.now {
			delete(x.sh.m, k)
			x.s.keys.Add(-1)
		}
	}
}

// get returns the live entry for key, or nil.
func (x *memExec) get(key string) *mentry {
	e := x.sh.m[key]
	if e == nil {
		return nil
	}
	if e.expireAt != 0 && e.expireAt <= x.now {
		delete(x.sh.m, key)
		x.s.keys.Add(-1)
		return nil
	}
	return e
}

// put returns the entry for key, creating it when absent.
func (x *memExec) put(key string) *mentry {
	if e := x.get(key); e != nil {
		return e
	}
	x.s.keys.Add(1)
	e := &mentry{h: map[string]int64{}, z: map[string]int64{}}
	x.sh.m[key] = e
	return e
}

func (x *memExec) del(key string) {
	if _, ok := x.sh.m[key]; ok {
		delete(x.sh.m, key)
		x.s.keys.Add(-1)
	}
}

func (x *memExec) pexpire(key string, ms int64) {
	if e := x.get(key); e != nil {
		e.expireAt = x.now + ms
	}
}

func (x *memExec) pttl(key string) int64 {
	e := x.get(key)
	switch {
	case e == nil:
		return -2
	case e.expireAt == 0:
		return -1
	}
	return e.expireAt - x.now
}

// hget returns a hash field and whether the key and field exist.
func (x *memExec) hget(key, field string) (int64, bool) {
	e := x.get(key)
	if e == nil {
		return 0, false
	}
	v, ok := e.h[field]
	return v, ok
}

func (x *memExec) hset(key string, kv ...any) {
	e := x.put(key)
	for i := 0; i < len(kv); i += 2 {
		e.h[kv[i].(string)] = kv[i+1].(int64)
	}
}

func (x *memExec) hincr(key, field string, d int64) {
	e := x.put(key)
	e.h[field] += d
}

func (x *memExec) hdel(key, field string) {
	if e := x.get(key); e != nil {
		delete(e.h, field)
		if len(e.h) == 0 && len(e.z) == 0 && e.s == "" {
			x.del(key)
		}
	}
}

func (x *memExec) zscore(key, member string) (int64, bool) {
	e := x.get(key)
	if e == nil {
		return 0, false
	}
	v, ok := e.z[member]
	return v, ok
}

func (x *memExec) zadd(key, member string, score int64) {
	e := x.put(key)
	e.z[member] = score
}

func (x *memExec) zrem(key, member string) int64 {
	e := x.get(key)
	if e == nil {
		return 0
	}
	if _, ok := e.z[member]; !ok {
		return 0
	}
	delete(e.z, member)
	if len(e.z) == 0 && len(e.h) == 0 {
		x.del(key)
	}
	return 1
}

type zmember struct {
	m string
	s int64
}

// zrange returns the members ordered by score, then member, as Redis does.
func (x *memExec) zrange(key string) []zmember {
	e := x.get(key)
	if e == nil {
		return nil
	}
	out := make([]zmember, 0, len(e.z))
	for m, s := range e.z {
		out = append(out, zmember{m, s})
	}
	slices.SortFunc(out, func(a, b zmember) int {
		if a.s != b.s {
			if a.s < b.s {
				return -1
			}
			return 1
		}
		return strings.Compare(a.m, b.m)
	})
	return out
}

// zremUpTo removes the members scored <= max and returns them in order.
func (x *memExec) zremUpTo(key string, max int64) []zmember {
	var gone []zmember
	for _, zm := range x.zrange(key) {
		if zm.s > max {
			break
		}
		gone = append(gone, zm)
		x.zrem(key, zm.m)
	}
	return gone
}

// Constants of the script.
const (
	scriptSlack      = 1000
	scriptPoolTTL    = 86400000
	scriptEmptyRetry = 1000
	// clockStepMs is the largest step back of the store's clock a window
	// keeps counting through; an index further ahead is a retuned length.
	clockStepMs = 3600000
)

type poolView struct {
	ids   []string
	rem   []int64
	exp   []int64
	total int64
	pend  int64 // tokens of pre-grants whose window has not opened
}

func (x *memExec) poolLoad(z, h string) poolView {
	gone := x.zremUpTo(z, x.now)
	if len(gone) > 0 {
		var lost int64
		for _, g := range gone {
			v, _ := x.hget(h, "g:"+g.m)
			lost += v
			x.hdel(h, "g:"+g.m)
			x.hdel(h, "s:"+g.m)
		}
		if lost > 0 {
			x.hincr(h, "expired", lost)
		}
	}
	var pv poolView
	for _, zm := range x.zrange(z) {
		r, _ := x.hget(h, "g:"+zm.m)
		// A pre-grant keeps its start in s:<id> until it opens (the script
		// writes "tokens@start" into g:<id> instead).
		if st, pre := x.hget(h, "s:"+zm.m); pre {
			if st > x.now {
				pv.pend += r
				continue
			}
			x.hdel(h, "s:"+zm.m)
		}
		pv.ids = append(pv.ids, zm.m)
		pv.rem = append(pv.rem, r)
		pv.exp = append(pv.exp, zm.s)
		pv.total += r
	}
	return pv
}

func (x *memExec) poolSpend(h string, pv poolView, want int64) int64 {
	var first int64
	left := want
	for j := range pv.ids {
		if left <= 0 {
			break
		}
		if pv.rem[j] > 0 {
			d := min(pv.rem[j], left)
			x.hincr(h, "g:"+pv.ids[j], -d)
			pv.rem[j] -= d
			left -= d
			if first == 0 {
				first = pv.exp[j]
			}
		}
	}
	x.hincr(h, "consumed", want-left)
	x.pexpire(h, scriptPoolTTL)
	return first
}

func (x *memExec) poolRetry(h string) int64 {
	if exh, _ := x.hget(h, "exh"); exh > x.now {
		return exh - x.now
	}
	return scriptEmptyRetry
}

func ceilDiv(a, b int64) int64 { return int64(math.Ceil(float64(a) / float64(b))) }

func floorDiv(a, b int64) int64 { return int64(math.Floor(float64(a) / float64(b))) }

// pending is a debit decided in the check phase, applied if all rules allow.
type pending struct {
	kind      int
	key, h    string
	t, s, ttl int64
	w, c, p   int64
	member    string
	dl        int64
	pool      poolView
	cost      int64
}

func (x *memExec) exec(o *op) {
	now := x.now
	switch o.code {
	case opDecide, opRefund:
		x.decide(o)
	case opTake:
		z, h := o.keys[0], o.keys[1]
		pv := x.poolLoad(z, h)
		if pv.total <= 0 {
			x.hincr(h, "starved", 1)
			x.pexpire(h, scriptPoolTTL)
			o.out = []int64{0, 0, x.poolRetry(h)}
			return
		}
		take := min(o.n1, pv.total)
		first := x.poolSpend(h, pv, take)
		o.out = []int64{take, first - now, 0}
	case opDeposit:
		z, h := o.keys[0], o.keys[1]
		var added int64
		if _, dup := x.zscore(z, o.member); o.n1 > 0 && o.n2 > o.n3 && !dup {
			x.zadd(z, o.member, now+o.n2)
			x.hset(h, "g:"+o.member, o.n1)
			if o.n3 > 0 {
				x.hset(h, "s:"+o.member, now+o.n3)
			} else {
				x.hdel(h, "exh")
			}
			x.hincr(h, "deposited", o.n1)
			x.pexpire(z, scriptPoolTTL)
			x.pexpire(h, scriptPoolTTL)
			added = 1
		}
		pv := x.poolLoad(z, h)
		o.out = []int64{added, pv.total}
	case opStats:
		z, h := o.keys[0], o.keys[1]
		pv := x.poolLoad(z, h)
		get := func(f string) int64 { v, _ := x.hget(h, f); return v }
		exh := get("exh")
		if exh > now {
			exh -= now
		} else {
			exh = 0
		}
		o.out = []int64{pv.total, get("consumed"), get("starved"), get("deposited"), get("expired"), int64(len(pv.ids)), exh, pv.pend}
	case opExhaust:
		h := o.keys[1]
		x.hset(h, "exh", now+o.n1)
		x.pexpire(h, scriptPoolTTL)
		o.out = []int64{1}
	case opRelease:
		o.out = []int64{x.zrem(o.keys[0], o.member)}
	case opRenew:
		dl, ok := x.zscore(o.keys[0], o.member)
		switch {
		case !ok:
			o.out = []int64{0}
		case dl <= now:
			x.zrem(o.keys[0], o.member)
			o.out = []int64{0}
		default:
			x.zadd(o.keys[0], o.member, now+o.n1)
			if x.pttl(o.keys[0]) < o.n1+scriptSlack {
				x.pexpire(o.keys[0], o.n1+scriptSlack)
			}
			o.out = []int64{1}
		}
	default:
		x.err = fmt.Errorf("memory store: unknown operation %q", o.code)
	}
}

func (x *memExec) decide(o *op) {
	now := x.now
	refund := o.code == opRefund
	if !refund && o.idemTTL > 0 {
		if e := x.get(o.keys[0]); e != nil && e.s != "" {
			id, rest, _ := strings.Cut(e.s, "|")
			out := []int64{1}
			for _, f := range strings.Split(rest, ",") {
				v, _ := strconv.ParseInt(f, 10, 64)
				out = append(out, v)
			}
			o.out, o.outID = out, id
			return
		}
	}
	out := slices.Grow(o.out[:0], 2+4*len(o.rules))[:2] // a reused op keeps its capacity
	out[0], out[1] = 0, 0
	var pend []pending
	deny := int64(0)
	for i, r := range o.rules {
		key := o.keys[r.key-1]
		ok, remaining, retry, reset := int64(1), int64(0), int64(0), int64(0)
		p := pending{kind: r.kind, key: key}
		a, b, c, d := r.a, r.b, r.c, r.d
		switch r.kind {
		case kindBucket:
			tok, has := x.hget(key, "t")
			ts, _ := x.hget(key, "s")
			if !has {
				tok, ts = a, now
			}
			tok = min(tok, a)
			if tok >= a {
				ts = max(ts, now)
			} else if b > 0 && now > ts {
				delta := now - ts
				full := ceilDiv((a-tok)*1000, b)
				if delta >= full {
					tok, ts = a, now
				} else {
					add := floorDiv(delta*b, 1000)
					tok += add
					ts += ceilDiv(add*1000, b)
				}
			}
			switch {
			case refund:
				if has {
					x.hset(key, "t", min(a, tok+c), "s", ts)
				}
			case tok >= c:
				p.t, p.s, p.ttl = tok-c, ts, d
				remaining = tok - c
				if b > 0 {
					reset = ceilDiv((a-remaining)*1000, b)
				}
			default:
				ok = 0
				remaining = tok
				if b > 0 {
					retry = ceilDiv((c-tok)*1000, b)
					reset = ceilDiv((a-tok)*1000, b)
				} else {
					retry = -1
				}
			}
			remaining = floorDiv(remaining, 1000)
		case kindFixed, kindSliding:
			idx := floorDiv(now, b)
			w, has := x.hget(key, "w")
			cnt, _ := x.hget(key, "c")
			prev, _ := x.hget(key, "p")
			switch {
			case !has, w > idx+1 && (w-idx)*b > clockStepMs: // w far ahead: the window's length grew (see the script)
				w, cnt, prev, has = idx, 0, 0, false
			case w > idx:
				idx = w
			case w == idx-1 && r.kind == kindSliding:
				prev, cnt = cnt, 0
			case w < idx:
				prev, cnt = 0, 0
			}
			elapsed := max(0, now-idx*b)
			wend := max(0, (idx+1)*b-now)
			switch {
			case refund:
				if has && w == idx {
					x.hset(key, "c", max(0, cnt-c))
				}
			case r.kind == kindFixed:
				reset = wend
				if cnt+c <= a {
					p.w, p.c, p.ttl = idx, cnt+c, wend+scriptSlack
					remaining = a - cnt - c
				} else {
					ok, retry, remaining = 0, wend, max(0, a-cnt)
				}
			default:
				est := float64(prev)*float64(b-elapsed)/float64(b) + float64(cnt)
				reset = wend
				if est+float64(c) <= float64(a) {
					p.w, p.c, p.p, p.ttl = idx, cnt+c, prev, wend+b+scriptSlack
					remaining = int64(math.Floor(float64(a) - est - float64(c)))
				} else {
					ok = 0
					remaining = max(0, int64(math.Floor(float64(a)-est)))
					if cnt+c <= a {
						retry = int64(math.Ceil(float64(b)-float64(b)*float64(a-cnt-c)/float64(prev))) - elapsed
					} else {
						retry = wend + int64(math.Ceil(float64(b)-float64(b)*float64(a-c)/float64(cnt)))
					}
					retry = max(retry, 1)
				}
			}
		case kindSlots:
			if refund {
				x.zrem(key, o.member)
				break
			}
			x.zremUpTo(key, now)
			_, held := x.zscore(key, o.member)
			used := int64(0)
			if e := x.get(key); e != nil {
				used = int64(len(e.z))
			}
			if held || used < a {
				p.member, p.dl, p.ttl = o.member, now+b, b+scriptSlack
				if held { // retry 1: held before this call (see the script)
					remaining, retry = a-used, 1
				} else {
					remaining = a - used - 1
				}
			} else {
				ok, retry, remaining = 0, scriptEmptyRetry, 0
			}
		case kindPool:
			h := o.keys[r.key]
			p.h = h
			if refund {
				break
			}
			pv := x.poolLoad(key, h)
			if pv.total >= a {
				p.pool, p.cost = pv, a
				remaining = pv.total - a
			} else {
				ok, remaining = 0, pv.total
				retry = x.poolRetry(h)
				x.hincr(h, "starved", 1)
				x.pexpire(h, scriptPoolTTL)
			}
		}
		if refund {
			continue
		}
		if ok == 1 {
			pend = append(pend, p)
		} else if !r.shadow && deny == 0 {
			deny = int64(i + 1)
		}
		out = append(out, ok, remaining, retry, reset)
	}
	if refund {
		// The decision being undone leaves no record to replay: a retry
		// of its request must be charged again.
		if o.idemTTL > 0 {
			if e := x.get(o.keys[0]); e != nil && strings.HasPrefix(e.s, o.id+"|") {
				x.del(o.keys[0])
			}
		}
		o.out, o.outID = []int64{0, 0}, o.id
		return
	}
	out[1] = deny
	if deny == 0 {
		for _, p := range pend {
			switch p.kind {
			case kindBucket:
				x.hset(p.key, "t", p.t, "s", p.s)
				x.pexpire(p.key, p.ttl)
			case kindFixed:
				x.hset(p.key, "w", p.w, "c", p.c)
				x.pexpire(p.key, p.ttl)
			case kindSliding:
				x.hset(p.key, "w", p.w, "c", p.c, "p", p.p)
				x.pexpire(p.key, p.ttl)
			case kindSlots:
				x.zadd(p.key, p.member, p.dl)
				x.pexpire(p.key, p.ttl)
			case kindPool:
				x.poolSpend(p.h, p.pool, p.cost)
			}
		}
		if o.idemTTL > 0 {
			var sb strings.Builder
			sb.WriteString(o.id)
			sb.WriteByte('|')
			for j, v := range out[1:] {
				if j > 0 {
					sb.WriteByte(',')
				}
				sb.WriteString(strconv.FormatInt(v, 10))
			}
			e := x.put(o.keys[0])
			e.s = sb.String()
			e.expireAt = now + o.idemTTL
		}
	}
	o.out, o.outID = out, o.id
}
