-- Set how long the ledger keeps what is over (retain_s in the prelude), in whole seconds:
-- ARGV: job_s, lease_s. Records that are over already keep the expiry they were given; the new
-- values apply from their next write. Returns the values it replaced ('' where none was set).
local rk = k('retention')
local before = redis.call('HMGET', rk, 'job_s', 'lease_s')
redis.call('HSET', rk, 'job_s', ARGV[1], 'lease_s', ARGV[2])
return cjson.encode({ok = true, job_s = before[1] or '', lease_s = before[2] or ''})
