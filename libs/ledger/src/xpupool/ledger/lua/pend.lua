-- Park a request that cannot be placed now in the persistent pending queue (idempotent).
-- ARGV: job_id, score (lower goes first), request JSON, max_wait_ms ('' = none), reason, detail
local jk = k('job', ARGV[1])
local state = redis.call('HGET', jk, 'state')
if state and state ~= 'pending' then return cjson.encode({ok = false, reason = 'job_' .. state}) end
local now = now_ms()
local since = tonumber(redis.call('HGET', jk, 'since_ms') or now)
redis.call('HSET', jk, 'state', 'pending', 'since_ms', since, 'reason', ARGV[5], 'detail', ARGV[6])
redis.call('EXPIRE', jk, RETAIN_S)
redis.call('ZADD', k('pending'), 'NX', tonumber(ARGV[2]), ARGV[1])
redis.call('SET', k('pending-req', ARGV[1]), ARGV[3])
if ARGV[4] ~= '' then
  redis.call('ZADD', k('pending-deadline'), 'NX', since + tonumber(ARGV[4]), ARGV[1])
end
return cjson.encode({ok = true, since_ms = since, now_ms = now})
