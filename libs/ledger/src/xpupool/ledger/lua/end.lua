-- End a lease. From a holder (a release: tenant, secret and token given) only after the holder
-- check, so a stale or foreign holder cannot end a lease and learns that it lost it; from the
-- scheduler (preemption: tenant '') unconditionally and idempotently.
-- ARGV: lease_id, reason, tenant ('' = internal), lease secret, fencing token, detail, outbox
-- ('' = the lease-manager's; 'direct' when the caller publishes the LeaseEnded itself, which
-- then gets the entry and the ended lease's hash to build it from, as pend.lua answers a grant,
-- and the grant's entry while that is unconfirmed: ``unconfirmed_grant``)
local lk = k('lease', ARGV[1])
local now = now_ms()
if ARGV[3] ~= '' then
  local refusal = holder_refusal(lk, ARGV[1], ARGV[3], ARGV[4], ARGV[5], now)
  if refusal then return refusal end
elseif redis.call('EXISTS', lk) == 0 then
  return fail('unknown_lease', ARGV[1])
end
local outbox = ARGV[7] ~= '' and ARGV[7] or nil
local grant = outbox and unconfirmed_grant(lk)
local outcome, entry = end_lease(ARGV[1], ARGV[2], ARGV[6], now, outbox)
if outbox and entry then
  return announced({outcome = outcome, grant = grant}, ARGV[1], entry)
end
return cjson.encode({ok = true, outcome = outcome})
