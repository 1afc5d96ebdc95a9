-- End a lease on request (release, preemption). With a token, a stale holder cannot end a
-- lease that has moved on. ARGV: lease_id, reason, token ('' = no check, for the scheduler), detail
local lk = k('lease', ARGV[1])
local l = redis.call('HMGET', lk, 'state', 'token')
if not l[1] then return fail('unknown_lease', ARGV[1]) end
if ARGV[3] ~= '' and tonumber(l[2]) ~= tonumber(ARGV[3]) then
  return fail('stale_token', l[2])
end
local outcome = end_lease(ARGV[1], ARGV[2], ARGV[4], now_ms())
return cjson.encode({ok = true, outcome = outcome})
