-- Release a lock only if we still hold it. ARGV: name, owner
local lk = k('lock', ARGV[1])
if redis.call('GET', lk) == ARGV[2] then redis.call('DEL', lk) end
return cjson.encode({ok = true})
