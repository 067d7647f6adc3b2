-- charge (after common.lua). KEYS[4..3+n]: the counters, in request order.
-- ARGV[4] n, then for counter i at a = 4 + 3(i-1):
--   ARGV[a+1] counter key (as the plugin named it), ARGV[a+2] amount, ARGV[a+3] expire_at_s.
-- Replies: {'charged', swept, used_1, reserved_1, ...}
--          {'already_charged', swept}
--
-- A charge already happened (the plugin's local fallback admitted the request while the ledger was
-- unreachable): it is added without a limit check, once per id.

local now = now_ms()
local swept = sweep(now, tonumber(ARGV[3]))
local n = tonumber(ARGV[4])

-- Idempotency: the id was used already (this charge retried, or a hold or settlement under it).
if redis.call('EXISTS', KEYS[2]) == 1 or redis.call('EXISTS', KEYS[3]) == 1 then
  return { 'already_charged', swept }
end

-- The marker outlives every retry: the plugin drops a write-back once all its windows are over,
-- and never retries for two hours.
local keep_until = now + 7200 * 1000
local out = { 'charged', swept }
for i = 1, n do
  local a = 4 + 3 * (i - 1)
  local key = KEYS[3 + i]
  local target = tonumber(ARGV[a + 3]) * 1000
  -- A counter whose window is over is left alone, as release leaves a counter that is gone.
  if target > now then
    redis.call('HINCRBY', key, 'used', ARGV[a + 2])
    redis.call('HSETNX', key, 'reserved', '0')
    -- Lives until max(expire_at_s, the expiry it already has): never shortened.
    local pttl = redis.call('PTTL', key)
    if pttl < 0 or now + pttl < target then
      redis.call('PEXPIREAT', key, int(target))
    end
    keep_until = math.max(keep_until, target)
  end
  push_state(out, key)
end
redis.call('SET', KEYS[3], 'charged', 'PX', int(keep_until - now))
return out
