-- allot admission script. ONE script, loaded once (EVALSHA, reloaded on
-- NOSCRIPT), runs every store operation of the admission engine; ARGV[1]
-- selects the operation. All KEYS of one call share a hash tag, so the call is
-- atomic on one Redis node, standalone or cluster. memstore.go implements the
-- same operations for the embedded store; the conformance suite checks that
-- both give the same answers.
--
-- Clock: ARGV[2] is 0 in production and the script reads Redis TIME, the one
-- clock every gateway shares. Tests may pass a fixed time in milliseconds.
-- Amounts are integers: token buckets count millitokens, windows and pools
-- count cost units, times are milliseconds.
--
-- Operations
--   d  decide   KEYS: idem, then the string-state keys (buckets, windows),
--               then the others (slots, pools)
--               ARGV: op now id member idemTTL n ns rules (ns: how many
--               string-state keys); rules packs the n rules one after the
--               other, little-endian (struct '<BIddddB'): kind u8,
--               keyIndex u32, a b c d as doubles, shadow u8. Binary numbers
--               cost a fraction of decimal ones to create and convert, and
--               one argument for all rules spares Redis and the script an
--               argument per rule.
--               Checks every rule in order, then debits all of them or
--               none. Returns ONE string (see decision_reply):
--               {replay, firstDeny, then per rule: ok remaining retry reset}
--               packed after the earlier decision's id on a replay (empty
--               otherwise: the caller knows its own). A concurrency rule
--               that admits has retry 1 when the member held its slot
--               before this call (a retry of a running request), 0 when
--               the call took the slot.
--   r  refund   same layout as d: gives back what a decide debited (the
--               caller sends only the rules it debited, not a slot its
--               member held before) and deletes the decide's idempotency
--               record (idemTTL > 0, the record id's)
--   D, R        d and r writing state in the text form (see below)
--   t  take     KEYS: pool z, pool h   ARGV: op now want -> {taken, ttl, retry}
--   p  deposit  KEYS: pool z, pool h   ARGV: op now grant tokens ttl start
--               -> {added, available}   (start: ms until a pre-grant opens, 0 now)
--   s  stats    KEYS: pool z, pool h   ARGV: op now
--               -> {available, consumed, starved, deposited, expired, chunks, exhausted, pending}
--   e  exhaust  KEYS: pool z, pool h   ARGV: op now ms -> {1}
--   x  release  KEYS: slots            ARGV: op now member -> {released}
--   n  renew    KEYS: slots            ARGV: op now member ttl -> {held}
--
-- Rule kinds, their state and their arguments (a b c d):
--   1 token bucket    tokens stamp expiry   capacity_m refill_m_per_s cost_m idle_ttl_ms
--   2 fixed window    index count 0         limit window_ms cost -
--   3 sliding window  index count prev      limit window_ms cost -
--   4 concurrency     sorted set            max_in_flight slot_ttl_ms - -
--   5 leased pool     sorted set + hash     cost - - -   (keys z, then h)
--
-- State of buckets and windows: one string of 25 bytes, struct '<Bddd', a
-- tag byte (2 bucket, 3 window) and the three numbers, all integers below
-- 2^53. Builds before this form wrote decimal text, "tokens:stamp:expiry"
-- and "index:count[:prev]"; both forms are always read, and the ops D and R
-- still write text, for a rolling upgrade from such a build (an older script
-- cannot read the binary form). Parsing and formatting the text cost the
-- script ~1 us per rule, more than a third of a rule's cost.
--
-- TTLs: a debit rewrites a string-state key with SET ... KEEPTTL unless its
-- TTL must grow, because SET ... PX costs Redis about twice as much (it is
-- rewritten to PXAT for propagation). A window's expiry depends only on its
-- index, so it is set when the index changes. A bucket must outlive the time
-- it takes to refill to full; its value carries the expiry last set
-- (absolute ms, 0 when unknown), and a debit that needs a later one sets
-- twice the idle TTL, so a draining bucket sets its TTL at most once per idle
-- TTL and an idle key lives at most two idle TTLs.

-- Library functions as locals: a global's lookup is two table reads on
-- every use, and the decide loop uses these several times per rule.
local call = redis.call
local spack, sunpack = struct.pack, struct.unpack
local floor, ceil = math.floor, math.ceil

local op = ARGV[1]
local text = false -- write the text form of state (ops D and R)
if op == 'D' then op, text = 'd', true elseif op == 'R' then op, text = 'r', true end
local now = tonumber(ARGV[2])
if now == 0 then
  local t = call('TIME')
  now = tonumber(t[1]) * 1000 + floor(tonumber(t[2]) / 1000)
end

local SLACK = 1000          -- ms added to every idle TTL
local POOL_TTL = 86400000   -- ms a pool's counters outlive its last write
local EMPTY_RETRY = 1000    -- ms hint when a pool is empty but not exhausted
local CLOCK_STEP = 3600000  -- ms: the largest step back of the clock a window counts through

local function fmt(v) return string.format('%d', v) end

-- bucket_state and window_state encode a bucket's or a window's state.
local function bucket_state(tok, ts, exp)
  if text then return string.format('%d:%d:%d', tok, ts, exp) end
  return spack('<Bddd', 2, tok, ts, exp)
end

local function window_state(kind, idx, cnt, prev)
  if not text then return spack('<Bddd', 3, idx, cnt, prev) end
  if kind == 2 then return string.format('%d:%d', idx, cnt) end
  return string.format('%d:%d:%d', idx, cnt, prev)
end

-- read_state decodes a bucket's (tag 2) or a window's (tag 3) state in
-- either form; nil when it is neither (a corrupt value).
local function read_state(v, tag)
  if #v == 25 then
    local t, x, y, z = sunpack('<Bddd', v)
    if t == tag then
      if x == x and y == y and z == z then return x, y, z end -- not NaN
      return nil
    end
  end
  local x, y, z = string.match(v, '^(%-?%d+):(%-?%d+):?(%-?%d*)$')
  return tonumber(x), tonumber(y), tonumber(z) or 0
end

-- Leased pools: z is a sorted set of grant ids scored by expiry (ms); h holds
-- each grant's remaining tokens as field g:<id> and the counters. A
-- pre-grant (deposited before its window opens) holds "tokens@start" until
-- the first load at or after start rewrites it to plain tokens: before that
-- it neither spends nor counts as available.
local function grant_value(h, g)
  local v = redis.call('HGET', h, 'g:' .. g)
  local r = tonumber(v)
  if r or not v then return r or 0, 0 end
  local tk, st = string.match(v, '^(%d+)@(%d+)$')
  return tonumber(tk) or 0, tonumber(st) or 0
end

local function pool_load(z, h)
  local gone = redis.call('ZRANGEBYSCORE', z, '-inf', now)
  if #gone > 0 then
    local lost = 0
    for _, g in ipairs(gone) do
      lost = lost + grant_value(h, g)
      redis.call('HDEL', h, 'g:' .. g)
    end
    redis.call('ZREMRANGEBYSCORE', z, '-inf', now)
    if lost > 0 then redis.call('HINCRBY', h, 'expired', lost) end
  end
  local live = redis.call('ZRANGE', z, 0, -1, 'WITHSCORES')
  local ids, rem, exp, total, pend = {}, {}, {}, 0, 0
  for j = 1, #live, 2 do
    local g = live[j]
    local r, st = grant_value(h, g)
    if st > now then
      pend = pend + r
    else
      if st > 0 then redis.call('HSET', h, 'g:' .. g, fmt(r)) end
      ids[#ids + 1] = g
      rem[#rem + 1] = r
      exp[#exp + 1] = tonumber(live[j + 1])
      total = total + r
    end
  end
  return ids, rem, exp, total, pend
end

-- pool_spend debits want tokens from the earliest-expiring grants first and
-- returns the expiry of the first grant it touched.
local function pool_spend(h, ids, rem, exp, want)
  local first = 0
  local left = want
  for j = 1, #ids do
    if left <= 0 then break end
    if rem[j] > 0 then
      local d = math.min(rem[j], left)
      redis.call('HINCRBY', h, 'g:' .. ids[j], -d)
      rem[j] = rem[j] - d
      left = left - d
      if first == 0 then first = exp[j] end
    end
  end
  redis.call('HINCRBY', h, 'consumed', want - left)
  -- No PEXPIRE here: the deposit of every grant spent from set both keys to
  -- outlive it (POOL_TTL is the longest lease), so the hash is still alive.
  return first
end

-- decision_reply packs a decision: the width of its numbers (u8, 4 or 8),
-- the id's length (u16) and the id, then the numbers, little-endian, as
-- 32-bit integers when they all fit, else as doubles (all integers below
-- 2^53). One string costs Redis and the client less than an array of
-- 2 + 4n integers (the client parses and keeps one value, not one per
-- number), and 4-byte numbers halve it in the usual case. nums[1..n] are
-- the numbers. The usual reply (no id, up to three rules) is one pack with
-- a literal format: no strings made and joined per call.
local function decision_reply(id, nums, n)
  for j = 1, n do
    local v = nums[j]
    if v >= 2147483648 or v < -2147483648 then
      return spack('<BH', 8, #id) .. id .. spack('<' .. string.rep('d', n), unpack(nums, 1, n))
    end
  end
  if id == '' then
    local f
    if n == 6 then f = '<BHi4i4i4i4i4i4'
    elseif n == 10 then f = '<BHi4i4i4i4i4i4i4i4i4i4'
    elseif n == 14 then f = '<BHi4i4i4i4i4i4i4i4i4i4i4i4i4i4'
    else f = '<BH' .. string.rep('i4', n) end
    return spack(f, 4, 0, unpack(nums, 1, n))
  end
  return spack('<BH', 4, #id) .. id .. spack('<' .. string.rep('i4', n), unpack(nums, 1, n))
end

local function pool_retry(h)
  local exh = tonumber(redis.call('HGET', h, 'exh')) or 0
  if exh > now then return exh - now end
  return EMPTY_RETRY
end

if op == 'd' or op == 'r' then
  local refund = op == 'r'
  local idemTTL = tonumber(ARGV[5])
  if not refund and idemTTL > 0 then
    local prev = redis.call('GET', KEYS[1])
    if prev then
      local bar = string.find(prev, '|', 1, true)
      local nums = {1}
      for v in string.gmatch(string.sub(prev, bar + 1), '[^,]+') do nums[#nums + 1] = tonumber(v) end
      return decision_reply(string.sub(prev, 1, bar - 1), nums, #nums)
    end
  end
  local member = ARGV[4]
  local n = tonumber(ARGV[6])
  local ns = tonumber(ARGV[7])
  local rules = ARGV[8] or ''
  if #rules ~= n * 38 then return redis.error_reply('allot: rules argument of ' .. #rules .. ' bytes for ' .. n .. ' rules') end
  local at = 1 -- where the next rule starts in rules
  -- The string-state keys (buckets and windows) come first, after the
  -- idempotency key: one MGET reads them all.
  local vals
  if ns > 0 then vals = call('MGET', unpack(KEYS, 2, 1 + ns)) end
  -- Presized for three rules, so that the usual decision grows no table
  -- (each growth reallocates and rehashes it).
  local out = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0} -- replay, firstDeny, then four numbers per rule
  local o = 2
  local w = {false, false, false, false, false, false, false, false, false} -- string writes: key, value, ttl
  local wn = 0
  local zs, zn, pools -- slot acquisitions (key, deadline, ttl) and pool debits, made when needed
  local deny = 0
  for i = 1, n do
    local kind, ki, a, bb, c, d, sh, nxt = sunpack('<BIddddB', rules, at)
    at = nxt
    local shadow = sh == 1
    local key = KEYS[ki]
    local ok, remaining, retry, reset = 1, 0, 0, 0
    local write
    if kind == 1 then
      -- token bucket "tokens:stamp": a = capacity_m, bb = refill_m per s,
      -- c = cost_m, d = idle ttl
      local v = vals[ki - 1]
      local tok, ts, exp
      if v then
        tok, ts, exp = read_state(v, 2)
        if not ts then return redis.error_reply('allot: corrupt bucket at ' .. key) end
      end
      local fresh = not tok
      if fresh then tok, ts = a, now end
      if tok > a then tok = a end
      if tok >= a then
        if now > ts then ts = now end
      elseif bb > 0 and now > ts then -- never refill for negative time
        local delta = now - ts
        local full = ceil((a - tok) * 1000 / bb)
        if delta >= full then
          tok, ts = a, now
        else
          local add = floor(delta * bb / 1000)
          tok = tok + add
          ts = ts + ceil(add * 1000 / bb) -- keep the fraction for later
        end
      end
      if refund then
        if not fresh then call('SET', key, bucket_state(math.min(a, tok + c), ts, exp), 'KEEPTTL') end
      elseif tok >= c then
        remaining = tok - c
        local need = now + d
        if bb > 0 then
          reset = ceil((a - remaining) * 1000 / bb)
          need = now + reset + SLACK
        end
        if fresh or exp < need then
          exp, d = now + 2 * d, 2 * d
        else
          d = false -- the key's TTL already covers the refill: KEEPTTL
        end
        write = bucket_state(remaining, ts, exp)
      else
        ok = 0
        remaining = tok
        if bb > 0 then
          retry = ceil((c - tok) * 1000 / bb)
          reset = ceil((a - tok) * 1000 / bb)
        else
          retry = -1
        end
      end
      remaining = floor(remaining / 1000)
    elseif kind == 2 or kind == 3 then
      -- windows "index:count[:previous]": a = limit, bb = window ms, c = cost
      local idx = floor(now / bb)
      local v = vals[ki - 1]
      local w, cnt, prev
      if v then
        w, cnt, prev = read_state(v, 3)
        if not cnt then return redis.error_reply('allot: corrupt window at ' .. key) end
      end
      local stored = w
      if not w or (w > idx + 1 and (w - idx) * bb > CLOCK_STEP) then
        -- No state, or an index further ahead than any step back of the
        -- store's clock: the window's length grew (a rule's digest leaves
        -- its numbers out, so its counter outlives a retune), and the index
        -- counts windows of the old length. A fresh window, as when a
        -- length shrinks.
        w, cnt, prev = idx, 0, 0
      elseif w > idx then
        idx = w -- the clock went back: keep counting in the newest window
      elseif w == idx - 1 and kind == 3 then
        prev, cnt = cnt, 0
      elseif w < idx then
        prev, cnt = 0, 0
      end
      local elapsed = now - idx * bb
      if elapsed < 0 then elapsed = 0 end
      local wend = (idx + 1) * bb - now
      if wend < 0 then wend = 0 end
      if refund then
        if stored == idx then
          call('SET', key, window_state(kind, idx, math.max(0, cnt - c), prev), 'KEEPTTL')
        end
      elseif kind == 2 then
        reset = wend
        if cnt + c <= a then
          write, d = window_state(kind, idx, cnt + c, 0), wend + SLACK
          if stored == idx then d = false end -- same window, same expiry
          remaining = a - cnt - c
        else
          ok, retry, remaining = 0, wend, math.max(0, a - cnt)
        end
      else
        local est = prev * (bb - elapsed) / bb + cnt
        reset = wend
        if est + c <= a then
          write, d = window_state(kind, idx, cnt + c, prev), wend + bb + SLACK
          if stored == idx then d = false end -- same window, same expiry
          remaining = floor(a - est - c)
        else
          ok = 0
          remaining = math.max(0, floor(a - est))
          if cnt + c <= a then
            -- wait until the previous window's weight has decayed enough
            retry = math.ceil(bb - bb * (a - cnt - c) / prev) - elapsed
          else
            -- wait for the next window, where this window becomes the previous
            retry = wend + math.ceil(bb - bb * (a - c) / cnt)
          end
          if retry < 1 then retry = 1 end
        end
      end
    elseif kind == 4 then
      -- concurrency: a = max in flight, bb = slot ttl
      if refund then
        redis.call('ZREM', key, member)
      else
        redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
        local held = redis.call('ZSCORE', key, member)
        local used = redis.call('ZCARD', key)
        if held or used < a then
          write = true
          -- retry (unused when a rule admits) says the member held the slot
          -- already: a refund must leave such a slot to its holder.
          if held then remaining, retry = a - used, 1 else remaining = a - used - 1 end
        else
          ok, retry, remaining = 0, EMPTY_RETRY, 0
        end
      end
    elseif kind == 5 then
      -- leased pool: a = cost; KEYS[ki + 1] is the pool's hash. Pool debits
      -- are not refunded: tokens spent stay spent (the safe side).
      local h = KEYS[ki + 1]
      if not refund then
        local ids, rem, exp, total = pool_load(key, h)
        if total >= a then
          write = {h = h, ids = ids, rem = rem, exp = exp, cost = a}
          remaining = total - a
        else
          ok, remaining = 0, total
          retry = pool_retry(h)
          redis.call('HINCRBY', h, 'starved', 1)
          redis.call('PEXPIRE', h, POOL_TTL)
        end
      end
    end
    if not refund then
      if ok == 1 then
        if kind <= 3 then
          w[wn + 1], w[wn + 2], w[wn + 3] = key, write, d
          wn = wn + 3
        elseif kind == 4 then
          if not zs then zs, zn = {}, 0 end
          zs[zn + 1], zs[zn + 2], zs[zn + 3] = key, now + bb, bb + SLACK
          zn = zn + 3
        else
          if not pools then pools = {} end
          pools[#pools + 1] = write
        end
      elseif not shadow and deny == 0 then
        deny = i
      end
      out[o + 1], out[o + 2], out[o + 3], out[o + 4] = ok, remaining, retry, reset
      o = o + 4
    end
  end
  if refund then
    -- The decision being undone leaves no record to replay: a retry of its
    -- request must be charged again.
    if idemTTL > 0 then
      local prev = call('GET', KEYS[1])
      if prev and string.sub(prev, 1, #ARGV[3] + 1) == ARGV[3] .. '|' then call('DEL', KEYS[1]) end
    end
    return decision_reply('', out, 2)
  end
  out[2] = deny
  if deny == 0 then
    -- every live rule allows: debit them all (and each allowing shadow rule)
    for j = 1, wn, 3 do
      if w[j + 2] then
        call('SET', w[j], w[j + 1], 'PX', w[j + 2])
      else
        call('SET', w[j], w[j + 1], 'KEEPTTL')
      end
    end
    if zs then
      for j = 1, zn, 3 do
        call('ZADD', zs[j], zs[j + 1], member)
        call('PEXPIRE', zs[j], zs[j + 2])
      end
    end
    if pools then
      for _, p in ipairs(pools) do pool_spend(p.h, p.ids, p.rem, p.exp, p.cost) end
    end
    if idemTTL > 0 then
      local rest = {}
      for j = 2, o do rest[#rest + 1] = fmt(out[j]) end
      call('SET', KEYS[1], ARGV[3] .. '|' .. table.concat(rest, ','), 'PX', idemTTL)
    end
  end
  return decision_reply('', out, o)
end

if op == 't' then
  local want = tonumber(ARGV[3])
  local ids, rem, exp, total = pool_load(KEYS[1], KEYS[2])
  if total <= 0 then
    redis.call('HINCRBY', KEYS[2], 'starved', 1)
    redis.call('PEXPIRE', KEYS[2], POOL_TTL)
    return {0, 0, pool_retry(KEYS[2])}
  end
  local take = math.min(want, total)
  local first = pool_spend(KEYS[2], ids, rem, exp, take)
  return {take, first - now, 0}
end

if op == 'p' then
  local grant, tokens, ttl, start = ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]) or 0
  local added = 0
  if tokens > 0 and ttl > start and not redis.call('ZSCORE', KEYS[1], grant) then
    redis.call('ZADD', KEYS[1], now + ttl, grant)
    if start > 0 then
      -- A pre-grant: the exhausted mark is about the current window; leave it.
      redis.call('HSET', KEYS[2], 'g:' .. grant, fmt(tokens) .. '@' .. fmt(now + start))
    else
      redis.call('HSET', KEYS[2], 'g:' .. grant, fmt(tokens))
      redis.call('HDEL', KEYS[2], 'exh')
    end
    redis.call('HINCRBY', KEYS[2], 'deposited', tokens)
    -- Both keys outlive every grant, so expired grants are always pruned
    -- (and counted) by the script, never dropped silently by Redis.
    redis.call('PEXPIRE', KEYS[1], POOL_TTL)
    redis.call('PEXPIRE', KEYS[2], POOL_TTL)
    added = 1
  end
  local _, _, _, total = pool_load(KEYS[1], KEYS[2])
  return {added, total}
end

if op == 's' then
  local ids, _, _, total, pend = pool_load(KEYS[1], KEYS[2])
  local v = redis.call('HMGET', KEYS[2], 'consumed', 'starved', 'deposited', 'expired', 'exh')
  local exh = tonumber(v[5]) or 0
  if exh > now then exh = exh - now else exh = 0 end
  return {total, tonumber(v[1]) or 0, tonumber(v[2]) or 0, tonumber(v[3]) or 0, tonumber(v[4]) or 0, #ids, exh, pend}
end

if op == 'e' then
  redis.call('HSET', KEYS[2], 'exh', fmt(now + tonumber(ARGV[3])))
  redis.call('PEXPIRE', KEYS[2], POOL_TTL)
  return {1}
end

if op == 'x' then
  return {redis.call('ZREM', KEYS[1], ARGV[3])}
end

if op == 'n' then
  local ttl = tonumber(ARGV[4])
  local dl = tonumber(redis.call('ZSCORE', KEYS[1], ARGV[3]))
  if not dl then return {0} end
  if dl <= now then
    redis.call('ZREM', KEYS[1], ARGV[3])
    return {0}
  end
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[3])
  if redis.call('PTTL', KEYS[1]) < ttl + SLACK then redis.call('PEXPIRE', KEYS[1], ttl + SLACK) end
  return {1}
end

return redis.error_reply('allot: unknown operation ' .. tostring(op))
