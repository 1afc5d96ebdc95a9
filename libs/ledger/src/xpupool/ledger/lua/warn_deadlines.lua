-- Warn, once per lease, that its maximum run time ends soon: a lease whose deadline falls within
-- ARGV[1] ms gets a LeaseEnding in the lease-manager's outbox. Such a lease's term is at most its
-- deadline, so the candidates are the expiry index's entries due within the window.
-- ARGV: warning_ms, the most to look at in one call
local now = now_ms()
local horizon = now + tonumber(ARGV[1])
local due = redis.call('ZRANGEBYSCORE', k('expiry'), '-inf', horizon, 'LIMIT', 0, tonumber(ARGV[2]))
local warned = {}
for _, lease_id in ipairs(due) do
  local lk = k('lease', lease_id)
  local l = redis.call('HMGET', lk, 'state', 'deadline_ms', 'warned')
  if l[1] == 'active' and l[2] and tonumber(l[2]) <= horizon and not l[3] then
    redis.call('HSET', lk, 'warned', 1)
    redis.call('XADD', k('outbox', 'lease-manager'), '*', 'kind', 'ending', 'lease_id', lease_id,
      'reason', 'max_runtime', 'deadline_ms', l[2])
    table.insert(warned, lease_id)
  end
end
return cjson.encode({ok = true, ended = warned})
