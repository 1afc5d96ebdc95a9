-- Record live load for many devices (telemetry, not a capacity change: last value wins and the
-- version is not bumped). A device whose utilisation changed goes into the change log, since
-- placement reads it. ARGV: device_id, util ('' = unknown), mem_used ('' = unknown), repeated.
for i = 1, #ARGV, 3 do
  local dk = k('dev', ARGV[i])
  if ARGV[i + 1] ~= '' and redis.call('HGET', dk, 'util') ~= ARGV[i + 1] then
    redis.call('HSET', dk, 'util', ARGV[i + 1])
    touched('dev', ARGV[i])
  end
  -- When it last did any work: what idle reclaim measures a lease's devices by.
  if ARGV[i + 1] ~= '' and tonumber(ARGV[i + 1]) > 0 then
    redis.call('HSET', dk, 'active_ms', now_ms())
  end
  if ARGV[i + 2] ~= '' then redis.call('HSET', dk, 'mem_used', ARGV[i + 2]) end
end
return cjson.encode({ok = true})
