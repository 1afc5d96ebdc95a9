-- Turn a reservation into a lease: stamp a fencing token, start the term on the ledger's clock.
-- ARGV[1]: lease_id, ARGV[2]: the lease secret its holder must present (random, from the caller:
-- Lua has no source of secure randomness); a duplicate grant keeps the first secret.
local lk = k('lease', ARGV[1])
local l = redis.call('HMGET', lk, 'state', 'token', 'expires_ms')
if not l[1] then return fail('unknown_lease', ARGV[1]) end
if l[1] == 'active' then
  return cjson.encode({ok = true, duplicate = true, token = tonumber(l[2]),
    expires_ms = tonumber(l[3])})
end
if l[1] ~= 'reserved' then return fail('lease_' .. l[1], ARGV[1]) end
local token, expires = activate(ARGV[1], ARGV[2], now_ms())
bump()
touched('lease', ARGV[1])
return cjson.encode({ok = true, token = token, expires_ms = expires})
