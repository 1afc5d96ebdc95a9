-- Extend an active lease from the ledger's clock. A stale fencing token or a lapsed term fails.
-- ARGV[1]: lease_id, ARGV[2]: fencing token, ARGV[3]: ttl_ms ('' = the lease's own term)
local lk = k('lease', ARGV[1])
local l = redis.call('HMGET', lk, 'state', 'token', 'expires_ms', 'ttl_ms')
if not l[1] then return fail('unknown_lease', ARGV[1]) end
if l[1] ~= 'active' then return fail('lease_' .. l[1], ARGV[1]) end
if tonumber(l[2]) ~= tonumber(ARGV[2]) then return fail('stale_token', l[2]) end
local now = now_ms()
if now >= tonumber(l[3]) then return fail('lease_expired', ARGV[1]) end
local ttl = tonumber(ARGV[3] ~= '' and ARGV[3] or l[4])
local expires = now + ttl
redis.call('HSET', lk, 'expires_ms', expires)
redis.call('ZADD', k('expiry'), expires, ARGV[1])
redis.call('XADD', k('outbox', 'lease-manager'), '*', 'kind', 'renewed', 'lease_id', ARGV[1],
  'expires_ms', expires)
return cjson.encode({ok = true, expires_ms = expires})
