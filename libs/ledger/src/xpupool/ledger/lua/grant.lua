-- Turn a reservation into a lease: stamp a fencing token, start the term on the ledger's clock.
-- ARGV[1]: lease_id, ARGV[2]: the lease secret its holder must present (random, from the caller:
-- Lua has no source of secure randomness); a duplicate grant keeps the first secret.
local lk = k('lease', ARGV[1])
local l = redis.call('HMGET', lk, 'state', 'ttl_ms', 'token', 'expires_ms', 'job_id',
  'max_runtime_ms', 'idle_after_ms')
if not l[1] then return fail('unknown_lease', ARGV[1]) end
if l[1] == 'active' then
  return cjson.encode({ok = true, duplicate = true, token = tonumber(l[3]),
    expires_ms = tonumber(l[4])})
end
if l[1] ~= 'reserved' then return fail('lease_' .. l[1], ARGV[1]) end
local now = now_ms()
local token = redis.call('INCR', k('fence'))
local expires = now + tonumber(l[2])
local max_runtime = tonumber(l[6] or '0') or 0
if max_runtime > 0 then
  -- The term never runs past the maximum run time; renewals are capped there too.
  expires = math.min(expires, now + max_runtime)
  redis.call('HSET', lk, 'deadline_ms', now + max_runtime)
  redis.call('ZADD', k('deadlines'), now + max_runtime, ARGV[1])
end
redis.call('HSET', lk, 'state', 'active', 'token', token, 'granted_ms', now, 'expires_ms', expires,
  'secret', ARGV[2])
redis.call('ZADD', k('expiry'), expires, ARGV[1])
-- Where the devices' load integrals stood at the grant: usage accounting's baseline.
local load_base = {}
for _, s in ipairs(cjson.decode(redis.call('HGET', lk, 'slices') or '[]')) do
  local u, m = load_integrals(s.device_id, now)
  load_base[s.device_id] = {u, m}
end
redis.call('HSET', lk, 'load_base', cjson.encode(load_base))
local idle_after = tonumber(l[7] or '0') or 0
if idle_after > 0 then redis.call('ZADD', k('idle-watch'), now + idle_after, ARGV[1]) end
redis.call('HSET', k('job', l[5]), 'state', 'leased')
redis.call('XADD', k('outbox', 'lease-manager'), '*', 'kind', 'granted', 'lease_id', ARGV[1])
bump()
touched('lease', ARGV[1])
return cjson.encode({ok = true, token = token, expires_ms = expires})
