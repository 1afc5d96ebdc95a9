-- A short lock (the scheduling cycle): taken if free or already ours; ARGV: name, owner, ttl_ms.
-- Correctness never rests on it (every commit re-checks in its own script); it only keeps
-- replicas from deciding the same queue twice at once.
local lk = k('lock', ARGV[1])
local holder = redis.call('GET', lk)
if holder and holder ~= ARGV[2] then return fail('held', holder) end
redis.call('SET', lk, ARGV[2], 'PX', tonumber(ARGV[3]))
return cjson.encode({ok = true})
