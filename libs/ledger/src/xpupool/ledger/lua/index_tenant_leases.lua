-- Put live leases into their tenant's set of live leases (tenant-leases:<tenant>, which every
-- reservation and end keeps since it was introduced), a chunk of the live lease set at a time, so
-- a ledger written before it lists every tenant's leases. Idempotent. ARGV: SSCAN cursor, chunk
-- size. Returns the next cursor ('0': done) and the leases it added.
local scanned = redis.call('SSCAN', k('leases'), ARGV[1], 'COUNT', tonumber(ARGV[2]))
local added = {}
for _, lease_id in ipairs(scanned[2]) do
  local tenant = redis.call('HGET', k('lease', lease_id), 'tenant')
  if tenant and redis.call('SADD', k('tenant-leases', tenant), lease_id) == 1 then
    added[#added + 1] = lease_id
  end
end
return cjson.encode({ok = true, cursor = scanned[1], added = added})
