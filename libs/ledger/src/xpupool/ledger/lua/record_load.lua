-- Record live load for many devices (telemetry, not a capacity change: last value wins and the
-- version is not bumped). A device whose utilisation changed goes into the change log, since
-- placement reads it. ARGV: device_id, util ('' = unknown), mem_used ('' = unknown), repeated.
-- Each device also keeps the running integrals of its load (util_int in %·s, mem_int in MiB·s;
-- see load_integrals): usage accounting reads a lease's used capacity from their values at its
-- grant and end instead of scanning samples.
local now = now_ms()
for i = 1, #ARGV, 3 do
  local dk = k('dev', ARGV[i])
  local util_int, mem_int = load_integrals(ARGV[i], now)
  redis.call('HSET', dk, 'util_int', util_int, 'mem_int', mem_int, 'load_ms', now)
  if ARGV[i + 1] ~= '' and redis.call('HGET', dk, 'util') ~= ARGV[i + 1] then
    redis.call('HSET', dk, 'util', ARGV[i + 1])
    touched_load('dev', ARGV[i])
  end
  -- When it last did any work: what idle reclaim measures a lease's devices by.
  if ARGV[i + 1] ~= '' and tonumber(ARGV[i + 1]) > 0 then
    redis.call('HSET', dk, 'active_ms', now)
  end
  if ARGV[i + 2] ~= '' then redis.call('HSET', dk, 'mem_used', ARGV[i + 2]) end
end
return cjson.encode({ok = true})
