-- Extend an active lease from the ledger's clock, for its holder only (see holder_refusal).
-- ARGV: lease_id, tenant, lease secret, fencing token, ttl_ms ('' = the lease's own term),
-- outbox ('' = the lease-manager's; 'direct' as in end.lua: the entry and the lease's hash come
-- back for the caller to publish the LeaseRenewed itself, with the grant's entry while that is
-- unconfirmed: ``unconfirmed_grant``)
local lk = k('lease', ARGV[1])
local now = now_ms()
local refusal = holder_refusal(lk, ARGV[1], ARGV[2], ARGV[3], ARGV[4], now)
if refusal then return refusal end
local ttl = tonumber(ARGV[5] ~= '' and ARGV[5] or redis.call('HGET', lk, 'ttl_ms'))
local expires = now + ttl
local deadline = tonumber(redis.call('HGET', lk, 'deadline_ms') or '')
if deadline then expires = math.min(expires, deadline) end
redis.call('HSET', lk, 'expires_ms', expires)
redis.call('ZADD', k('expiry'), expires, ARGV[1])
local outbox = ARGV[6] ~= '' and ARGV[6] or nil
local entry = lease_event(outbox or 'lease-manager', ARGV[1], 'renewed', 'expires_ms', expires)
if outbox then
  return announced({expires_ms = expires, grant = unconfirmed_grant(lk)}, ARGV[1], entry)
end
return cjson.encode({ok = true, expires_ms = expires})
