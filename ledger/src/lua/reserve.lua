-- reserve (after common.lua). KEYS[4..3+n]: the counters, in request order.
-- ARGV[4] hold TTL (s), ARGV[5] n, then for counter i at a = 5 + 4(i-1):
--   ARGV[a+1] counter key (as the plugin named it), ARGV[a+2] limit, ARGV[a+3] amount,
--   ARGV[a+4] expire_at_s.
-- Replies: {'admitted'|'replayed', swept, used_1, reserved_1, ...}
--          {'refused', swept, index (0-based), used, reserved, limit}
--          {'already_settled', swept}

local now = now_ms()
local swept = sweep(now, tonumber(ARGV[3]))
local id = ARGV[2]
local ttl = tonumber(ARGV[4])
local n = tonumber(ARGV[5])

-- Idempotency: a live hold answers admitted again, holding nothing more.
local raw = redis.call('GET', KEYS[2])
if raw then
  local hold = decode_hold(raw)
  if hold and hold.e > now then
    local out = { 'replayed', swept }
    for _, c in ipairs(hold.c) do
      push_state(out, base .. 'c:' .. c[1])
    end
    return out
  end
  -- Expired but not swept yet (more than the bound expired at once), or unreadable.
  expire_hold(id, KEYS[2], KEYS[3])
  return { 'already_settled', swept + 1 }
end
if redis.call('EXISTS', KEYS[3]) == 1 then
  return { 'already_settled', swept }
end

-- Every counter must fit before any is touched: used + reserved + amount <= limit, written without
-- a sum that could leave 2^53.
for i = 1, n do
  local a = 5 + 4 * (i - 1)
  local limit = tonumber(ARGV[a + 2])
  local amount = tonumber(ARGV[a + 3])
  local v = redis.call('HMGET', KEYS[3 + i], 'used', 'reserved')
  local used = tonumber(v[1] or '0')
  local reserved = tonumber(v[2] or '0')
  if used == nil or reserved == nil then
    return redis.error_reply('counter ' .. KEYS[3 + i] .. ' holds non-numeric values')
  end
  if amount > limit or used > limit - amount or reserved > limit - amount - used then
    return { 'refused', swept, i - 1, v[1] or '0', v[2] or '0', ARGV[a + 2] }
  end
end

-- All fit: hold on every counter. A counter lives until max(its expire_at_s, the hold's expiry,
-- the expiry it already has): never shortened, and never gone while a hold still points at it.
local expires = now + ttl * 1000
local keep_until = math.ceil(expires / 1000) * 1000
local counters = {}
for i = 1, n do
  local a = 5 + 4 * (i - 1)
  local key = KEYS[3 + i]
  redis.call('HINCRBY', key, 'reserved', ARGV[a + 3])
  redis.call('HSETNX', key, 'used', '0')
  local target = math.max(tonumber(ARGV[a + 4]), math.ceil(expires / 1000)) * 1000
  local pttl = redis.call('PTTL', key)
  if pttl < 0 or now + pttl < target then
    redis.call('PEXPIREAT', key, int(target))
  else
    target = now + pttl
  end
  keep_until = math.max(keep_until, target)
  counters[i] = { ARGV[a + 1], ARGV[a + 3] }
end

-- The hold (and the tag's sorted set) live as long as the last of its counters: past that, sweeping
-- it would change nothing, so a tag that goes quiet leaves nothing behind.
redis.call('SET', KEYS[2], cjson.encode({ t = ttl, e = expires, c = counters }))
redis.call('PEXPIREAT', KEYS[2], int(keep_until))
redis.call('ZADD', holds_key, int(expires), id)
local zttl = redis.call('PTTL', holds_key)
if zttl < 0 or now + zttl < keep_until then
  redis.call('PEXPIREAT', holds_key, int(keep_until))
end

local out = { 'admitted', swept }
for i = 1, n do
  push_state(out, KEYS[3 + i])
end
return out
