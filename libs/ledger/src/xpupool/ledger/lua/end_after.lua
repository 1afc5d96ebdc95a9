-- End a lease after a grace period (a preemption with grace), idempotently: see begin_ending.
-- A lease that is not active (reserved: nothing to warn; ended) ends now, as an EndLease without
-- grace would. ARGV: lease_id, reason, grace_ms
local lk = k('lease', ARGV[1])
local now = now_ms()
local state = redis.call('HGET', lk, 'state')
if not state then return fail('unknown_lease', ARGV[1]) end
if state ~= 'active' then
  local outcome = end_lease(ARGV[1], ARGV[2], 'ended without grace: not active', now)
  return cjson.encode({ok = true, outcome = outcome})
end
if not begin_ending(ARGV[1], ARGV[2], tonumber(ARGV[3]), now) then
  return cjson.encode({ok = true, duplicate = true})
end
return cjson.encode({ok = true})
