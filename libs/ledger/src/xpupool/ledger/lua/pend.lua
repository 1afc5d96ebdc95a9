-- Park a request that cannot be placed now in the persistent pending queue (idempotent).
-- ARGV: job_id, priority (higher goes first), request JSON, max_wait_ms ('' = none), reason,
-- detail. The score orders by priority, then arrival in seconds (both exact in a double).
local jk = k('job', ARGV[1])
local state = redis.call('HGET', jk, 'state')
if state and state ~= 'pending' then return cjson.encode({ok = false, reason = 'job_' .. state}) end
if state == 'pending' then
  -- A duplicate of a waiting job: the first admission stands, its recorded reason too.
  return cjson.encode({ok = true, duplicate = true})
end
local now = now_ms()
local since = now
redis.call('HSET', jk, 'state', 'pending', 'since_ms', since, 'reason', ARGV[5], 'detail', ARGV[6])
redis.call('EXPIRE', jk, RETAIN_S)
redis.call('ZADD', k('pending'), 'NX', -tonumber(ARGV[2]) * 1e10 + since / 1000, ARGV[1])
redis.call('SET', k('pending-req', ARGV[1]), ARGV[3])
if ARGV[4] ~= '' then
  redis.call('ZADD', k('pending-deadline'), 'NX', since + tonumber(ARGV[4]), ARGV[1])
end
return cjson.encode({ok = true, since_ms = since, now_ms = now})
