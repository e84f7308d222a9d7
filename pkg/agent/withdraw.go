package agent

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/allot-dev/allot/pkg/policy"
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

// poolKeys returns the keys of a global quota's pool in the regional store,
// as pkg/admission lays them out (compile.go, keys.go):
//
//	<namespace>:{<tag>}:pool:<quota>:z and :h
//
// where the tag is the tenant's tag t:<tenant> for a tenant-scoped quota
// with a fixed tenant, and g:<quota> otherwise. A test deposits through the
// engine and withdraws through these keys, so a change of the layout fails
// it rather than silently withdrawing nothing.
func poolKeys(namespace string, r *policy.Rule) (z, h string) {
	tag := "g:" + r.Name
	if r.Scope == policy.ScopeTenant {
		for _, m := range r.Match {
			if m.Key == "tenant" && m.HasValue {
				tag = tenantTag(m.Value)
				break
			}
		}
	}
	base := namespace + ":{" + tag + "}:pool:" + r.Name
	return base + ":z", base + ":h"
}

// tenantTag mirrors admission's tenant hash tag.
func tenantTag(tenant string) string {
	if strings.ContainsAny(tenant, "{}") {
		sum := sha256.Sum256([]byte(tenant))
		return "t:#" + hex.EncodeToString(sum[:8])
	}
	return "t:" + tenant
}

// withdrawer runs withdrawScript.
type withdrawer struct {
	rdb    redis.UniversalClient
	script *redis.Script
	ns     string
}

func newWithdrawer(rdb redis.UniversalClient, namespace string) *withdrawer {
	return &withdrawer{rdb: rdb, script: redis.NewScript(withdrawScript), ns: namespace}
}

// withdraw takes grants out of rule's pool and returns the tokens each held.
func (w *withdrawer) withdraw(ctx context.Context, r *policy.Rule, grants []string) ([]int64, error) {
	if len(grants) == 0 {
		return nil, nil
	}
	z, h := poolKeys(w.ns, r)
	args := make([]any, len(grants))
	for i, g := range grants {
		args[i] = g
	}
	vals, err := w.script.Run(ctx, w.rdb, []string{z, h}, args...).Int64Slice()
	if err != nil {
		return nil, fmt.Errorf("withdraw %s: %w", r.Name, err)
	}
	if len(vals) != len(grants) {
		return nil, fmt.Errorf("withdraw %s: %d results for %d grants", r.Name, len(vals), len(grants))
	}
	return vals, nil
}
