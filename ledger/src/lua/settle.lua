-- settle (after common.lua). ARGV[4] n, ARGV[5..4+n] the charges, in the hold's counter order.
-- Replies: {'settled', swept, used_1, reserved_1, ...}
--          {'already_settled' | 'expired' | 'unknown', swept}
--          {'mismatch', swept, counters in the hold}   (nothing changed but the sweep)

local now = now_ms()
local swept = sweep(now, tonumber(ARGV[3]))
local id = ARGV[2]
local n = tonumber(ARGV[4])

local raw = redis.call('GET', KEYS[2])
if not raw then
  local marker = redis.call('GET', KEYS[3])
  if marker == 'settled' then
    return { 'already_settled', swept }
  elseif marker == 'expired' then
    return { 'expired', swept }
  elseif marker == 'charged' or marker == 'released' then
    -- No hold was ever made under this id, and the marker already says what became of it: kept
    -- as it is (a charge's lives until its last window ends; a tombstone in its place would end the
    -- charge's idempotency after two hours).
    return { 'unknown', swept }
  end
  -- Never held (yet): leave a tombstone, so that a reservation with this id still queued behind a
  -- stall (its caller already gave up and released it) holds nothing when it finally runs. Two
  -- hours outlive any hold TTL the plugin sends (at most 60 minutes).
  redis.call('SET', KEYS[3], 'released', 'EX', 7200)
  return { 'unknown', swept }
end

local hold = decode_hold(raw)
if not hold then
  redis.call('DEL', KEYS[2])
  redis.call('ZREM', holds_key, id)
  return { 'unknown', swept }
end
if hold.e <= now then
  -- Expired but not swept yet: it is charged at its reserved amount, like any expired hold.
  expire_hold(id, KEYS[2], KEYS[3])
  return { 'expired', swept + 1 }
end
if #hold.c ~= n then
  return { 'mismatch', swept, #hold.c }
end

local charges = {}
for i = 1, n do
  charges[i] = ARGV[4 + i]
end
local out = { 'settled', swept }
release(hold, charges, out)
redis.call('DEL', KEYS[2])
redis.call('ZREM', holds_key, id)
redis.call('SET', KEYS[3], 'settled', 'EX', int(2 * hold.t))
return out
