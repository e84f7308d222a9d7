package agent

import (
	"context"
	"fmt"
	"strings"

	"github.com/redis/go-redis/v9"
)

// withdrawScript takes the unspent tokens of the named grants out of a
// leased pool atomically, so no gateway can spend them after, and returns
// them per grant (0 for a grant that is gone or has expired). It is the
// agent's only script of its own: pkg/admission has no withdraw operation
// (the agent needs one to hand unspent tokens back on shutdown without a
// double spend). It works on admission's pool layout: a sorted set of grant
// ids scored by expiry (ms, Redis TIME) and a hash with each grant's
// remaining tokens as g:<id>; withdrawn tokens are counted in the hash's
// "withdrawn" field.
const withdrawScript = `
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local out = {}
local total = 0
for i, g in ipairs(ARGV) do
  local n = 0
  local exp = tonumber(redis.call('ZSCORE', KEYS[1], g))
  if exp and exp > now then
    n = tonumber(redis.call('HGET', KEYS[2], 'g:' .. g)) or 0
    redis.call('ZREM', KEYS[1], g)
    redis.call('HDEL', KEYS[2], 'g:' .. g)
  end
  out[i] = n
  total = total + n
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

// withdraw takes grants out of the pool named name, whose keys z and h
// the engine gives (admission.Engine.PoolKeys: the layout lives there), and
// returns the tokens each held.
func (w *withdrawer) withdraw(ctx context.Context, name, z, h string, grants []string) ([]int64, error) {
	if len(grants) == 0 {
		return nil, nil
	}
	if w.rdb == nil {
		return make([]int64, len(grants)), nil
	}
	if prefix := w.ns + ":{"; !strings.HasPrefix(z, prefix) || !strings.HasPrefix(h, prefix) {
		return nil, fmt.Errorf("withdraw %s: keys %q and %q are outside namespace %q", name, z, h, w.ns)
	}
	args := make([]any, len(grants))
	for i, g := range grants {
		args[i] = g
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
