-- Shared by reserve.lua, settle.lua and charge.lua (prepended to each; docs/ledger.md, "Redis keys").
--
-- KEYS[1]  <prefix>:{<tag>}:holds   the tag's holds, scored by expiry (ms)
-- KEYS[2]  <prefix>:{<tag>}:h:<id>  this request's hold
-- KEYS[3]  <prefix>:{<tag>}:s:<id>  this request's marker (settled, expired, released, charged)
-- ARGV[1]  <prefix>:{<tag>}:        base of every key of the tag: keys a script finds only inside a
--                                   hold (its counters, other ids' holds) are built from it, so they
--                                   carry the same hash tag and live in the same Cluster slot
-- ARGV[2]  id
-- ARGV[3]  most expired holds swept by one call
--
-- A hold is JSON: {"t": hold TTL s, "e": expiry ms, "c": [[counter key, amount], ...]}; amounts are
-- kept as the decimal strings the service sent, so they are never rounded through a Lua number.
-- Every number a script compares is an integer ≤ 2^53 (the service refuses larger amounts and
-- limits), so Lua's doubles hold them exactly. A script raises no error after its first write
-- other than on keys someone else corrupted: Redis does not roll a script back.

local base = ARGV[1]
local holds_key = KEYS[1]

-- An integer as Redis expects it (tostring would write 1e+15 for large values).
local function int(n)
  return string.format('%d', n)
end

-- Redis's own clock, so that every ledger instance agrees on when a hold expires.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function decode_hold(raw)
  local ok, hold = pcall(cjson.decode, raw)
  if not ok or type(hold) ~= 'table' or type(hold.c) ~= 'table' or type(hold.e) ~= 'number'
      or type(hold.t) ~= 'number' then
    return nil
  end
  for _, c in ipairs(hold.c) do
    if type(c) ~= 'table' or type(c[1]) ~= 'string' or type(c[2]) ~= 'string' or tonumber(c[2]) == nil then
      return nil
    end
  end
  return hold
end

-- Appends a counter's `used` and `reserved` (decimal strings, "0" when absent) to out.
local function push_state(out, key)
  local v = redis.call('HMGET', key, 'used', 'reserved')
  out[#out + 1] = v[1] or '0'
  out[#out + 1] = v[2] or '0'
end

-- Replaces the hold's reservation by a charge on each of its counters: reserved -= held (never
-- below 0), used += charge (charges[i], or the held amount itself when charges is nil). A counter
-- that no longer exists (its window ended and the key expired) is left alone: the charge belongs
-- to a window that is over. With out, appends each counter's state afterwards.
local function release(hold, charges, out)
  for i, c in ipairs(hold.c) do
    local key = base .. 'c:' .. c[1]
    local charge = c[2]
    if charges then
      charge = charges[i]
    end
    if redis.call('EXISTS', key) == 1 then
      local reserved = tonumber(redis.call('HGET', key, 'reserved') or '0') or 0
      local take = math.min(tonumber(c[2]), reserved)
      if take > 0 then
        redis.call('HINCRBY', key, 'reserved', int(-take))
      end
      redis.call('HINCRBY', key, 'used', charge)
    end
    if out then
      push_state(out, key)
    end
  end
end

-- Ends a hold that outlived its TTL: charged at its reserved amount, deleted, marked `expired`.
local function expire_hold(id, hold_key, marker_key)
  local raw = redis.call('GET', hold_key)
  if raw then
    local hold = decode_hold(raw)
    if hold then
      release(hold, nil, nil)
      redis.call('SET', marker_key, 'expired', 'EX', int(2 * hold.t))
    end
    redis.call('DEL', hold_key)
  end
  redis.call('ZREM', holds_key, id)
end

-- Expires at most `bound` of the tag's holds whose expiry has passed, oldest first.
local function sweep(now, bound)
  local ids = redis.call('ZRANGEBYSCORE', holds_key, '-inf', int(now), 'LIMIT', '0', int(bound))
  for _, id in ipairs(ids) do
    expire_hold(id, base .. 'h:' .. id, base .. 's:' .. id)
  end
  return #ids
end

