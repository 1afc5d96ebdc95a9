-- Put live leases into their tenant's set of live leases (tenant-leases:<tenant>, which every
-- reservation and end keeps since it was introduced), a chunk of the live lease set at a time, so
-- a ledger written before it lists every tenant's leases. Idempotent. ARGV: SSCAN cursor, chunk
-- size. Returns the next cursor ('0': done) and the leases it added. A finished pass is
-- remembered (tenant-leases-indexed): the scripts keep the sets from then on, so a later start
-- has nothing to walk.
if redis.call('EXISTS', k('tenant-leases-indexed')) == 1 then
  return cjson.encode({ok = true, cursor = '0', added = {}})
end
local scanned = redis.call('SSCAN', k('leases'), ARGV[1], 'COUNT', tonumber(ARGV[2]))
local added = {}
for _, lease_id in ipairs(scanned[2]) do
  local tenant = redis.call('HGET', k('lease', lease_id), 'tenant')
  if tenant and redis.call('SADD', k('tenant-leases', tenant), lease_id) == 1 then
    added[#added + 1] = lease_id
  end
end
if scanned[1] == '0' then redis.call('SET', k('tenant-leases-indexed'), 1) end
return cjson.encode({ok = true, cursor = scanned[1], added = added})
