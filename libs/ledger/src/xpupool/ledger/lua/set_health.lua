-- Move a device to a health state; returns the previous one so only real transitions are events.
-- ARGV: device_id, health, reason. A quarantined device (set_device_health) keeps it for later.
local dk = k('dev', ARGV[1])
local previous = redis.call('HGET', dk, 'health')
if not previous then return fail('unknown_device', ARGV[1]) end
if previous ~= ARGV[2] or redis.call('HEXISTS', dk, 'quarantine_until') == 1 then
  local set_now = set_device_health(dk, ARGV[2], ARGV[3], now_ms())
  -- (Quarantined, a lost device still turns unhealthy: readers must see that change too.)
  if redis.call('HGET', dk, 'health') ~= previous then
    bump()
    touched('dev', ARGV[1])
  end
  if not set_now then
    -- Kept for the quarantine's end: no transition of the reading to announce now.
    return cjson.encode({ok = true, previous = ARGV[2]})
  end
end
return cjson.encode({ok = true, previous = previous})
