-- End a lease after a grace period (a preemption with grace), idempotently: its deadline becomes
-- now + grace (or stays, if sooner), renewals stop there, the holder is warned once through the
-- lease-manager's outbox (LeaseEnding), and the expiry sweep ends it at the deadline for
-- ``reason``. A lease that is not active (reserved: nothing to warn; ended) ends now, as an
-- EndLease without grace would. ARGV: lease_id, reason, grace_ms
local lk = k('lease', ARGV[1])
local now = now_ms()
local l = redis.call('HMGET', lk, 'state', 'deadline_ms', 'expires_ms', 'ending_reason')
if not l[1] then return fail('unknown_lease', ARGV[1]) end
if l[1] ~= 'active' then
  local outcome = end_lease(ARGV[1], ARGV[2], 'ended without grace: not active', now)
  return cjson.encode({ok = true, outcome = outcome})
end
if l[4] then return cjson.encode({ok = true, duplicate = true}) end
local deadline = now + tonumber(ARGV[3])
if l[2] then deadline = math.min(deadline, tonumber(l[2])) end
local expires = math.min(tonumber(l[3]), deadline)
redis.call('HSET', lk, 'deadline_ms', deadline, 'ending_reason', ARGV[2], 'expires_ms', expires,
  'warned', 1)
redis.call('ZADD', k('expiry'), expires, ARGV[1])
redis.call('XADD', k('outbox', 'lease-manager'), '*', 'kind', 'ending', 'lease_id', ARGV[1],
  'reason', ARGV[2], 'deadline_ms', deadline)
touched('lease', ARGV[1])
return cjson.encode({ok = true, expires_ms = expires})
