-- Move a device to a health state; returns the previous one so only real transitions are events.
-- ARGV: device_id, health, reason
local dk = k('dev', ARGV[1])
local previous = redis.call('HGET', dk, 'health')
if not previous then return fail('unknown_device', ARGV[1]) end
if previous ~= ARGV[2] then
  redis.call('HSET', dk, 'health', ARGV[2], 'health_reason', ARGV[3])
  bump()
  touched('dev', ARGV[1])
end
return cjson.encode({ok = true, previous = previous})
