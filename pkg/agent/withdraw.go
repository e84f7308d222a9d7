package agent

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/redis/go-redis/v9"
)

// withdrawScript takes the unspent tokens of the named grants out of a
// leased pool atomically, so no gateway can spend them after, and returns
// them per grant: the tokens a live grant held (0 when spent or expired), or
// -1 for a grant the pool does not hold. With a tombstone TTL (ARGV[1], ms,
// 0 for none) every named grant stays recorded as live with 0 tokens until
// then: the script's deposit adds nothing for a grant id the pool holds, so
// no deposit still on its way (a first attempt or a retry) can land after
// the withdrawal. (The agent tombstones the grants whose deposit outcome it
// does not know.)
//
// It is the agent's only script of its own: pkg/admission has no withdraw
// operation (the agent needs one to hand tokens back without a double
// spend). It works on admission's pool layout: a sorted set of grant ids
// scored by expiry (ms, Redis TIME) and a hash with each grant's remaining
// tokens as g:<id> ("tokens@start" for a pre-grant not open yet); withdrawn
// tokens are counted in the hash's "withdrawn" field.
const withdrawScript = `
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local tomb = tonumber(ARGV[1])
local out = {}
local total = 0
for i = 2, #ARGV do
  local g = ARGV[i]
  local n = -1
  local exp = tonumber(redis.call('ZSCORE', KEYS[1], g))
  if exp and exp > now then
    local v = redis.call('HGET', KEYS[2], 'g:' .. g)
    n = tonumber(v) or tonumber(string.match(v or '', '^(%d+)@')) or 0
    total = total + n
    if tomb == 0 then
      redis.call('ZREM', KEYS[1], g)
      redis.call('HDEL', KEYS[2], 'g:' .. g)
    end
  elseif exp then
    n = 0
  end
  if tomb > 0 then
    redis.call('ZADD', KEYS[1], now + tomb, g)
    redis.call('HSET', KEYS[2], 'g:' .. g, '0')
    if redis.call('PTTL', KEYS[1]) < tomb then redis.call('PEXPIRE', KEYS[1], tomb) end
    if redis.call('PTTL', KEYS[2]) < tomb then redis.call('PEXPIRE', KEYS[2], tomb) end
  end
  out[#out + 1] = n
end
if total > 0 then redis.call('HINCRBY', KEYS[2], 'withdrawn', total) end
return out
`

// withdrawer runs withdrawScript. Without a Redis client (an agent on a
// store given with WithStore) it withdraws nothing: the tokens stay in that
// store until their leases end, and none is handed back.
type withdrawer struct {
	rdb    redis.UniversalClient
	script *redis.Script
	ns     string
}

func newWithdrawer(rdb redis.UniversalClient, namespace string) *withdrawer {
	return &withdrawer{rdb: rdb, script: redis.NewScript(withdrawScript), ns: namespace}
}

// errNoWithdraw: the agent has no Redis client to withdraw with.
var errNoWithdraw = errors.New("no Redis client to withdraw with")

// enabled reports whether w withdraws: without a Redis client, withdraw
// takes nothing out and reports every grant as holding 0 tokens.
func (w *withdrawer) enabled() bool { return w != nil && w.rdb != nil }

// withdraw takes grants out of the pool named name, whose keys z and h
// the engine gives (admission.Engine.PoolKeys: the layout lives there), and
// returns the tokens each held, or -1 for a grant the pool does not hold;
// with tomb > 0 such a grant is tombstoned for tomb (see withdrawScript).
func (w *withdrawer) withdraw(ctx context.Context, name, z, h string, grants []string, tomb time.Duration) ([]int64, error) {
	if len(grants) == 0 {
		return nil, nil
	}
	if w.rdb == nil {
		return make([]int64, len(grants)), nil
	}
	if prefix := w.ns + ":{"; !strings.HasPrefix(z, prefix) || !strings.HasPrefix(h, prefix) {
		return nil, fmt.Errorf("withdraw %s: keys %q and %q are outside namespace %q", name, z, h, w.ns)
	}
	args := make([]any, 0, 1+len(grants))
	args = append(args, max(tomb.Milliseconds(), 0))
	for _, g := range grants {
		args = append(args, g)
	}
	vals, err := w.script.Run(ctx, w.rdb, []string{z, h}, args...).Int64Slice()
	if err != nil {
		return nil, fmt.Errorf("withdraw %s: %w", name, err)
	}
	if len(vals) != len(grants) {
		return nil, fmt.Errorf("withdraw %s: %d results for %d grants", name, len(vals), len(grants))
	}
	return vals, nil
}
