-- Warn, once per lease, that its maximum run time ends soon: a lease whose deadline falls within
-- ARGV[1] ms begins its announced end (begin_ending: a LeaseEnding, then max_runtime at the
-- deadline). Only leases with a maximum run time are indexed (``deadlines``, by deadline), and
-- each leaves the index once warned, so a sweep reads just the leases due.
-- ARGV: warning_ms, the most to look at in one call
local now = now_ms()
local horizon = now + tonumber(ARGV[1])
local due = redis.call('ZRANGEBYSCORE', k('deadlines'), '-inf', horizon, 'LIMIT', 0,
  tonumber(ARGV[2]))
local warned = {}
for _, lease_id in ipairs(due) do
  redis.call('ZREM', k('deadlines'), lease_id)
  local l = redis.call('HMGET', k('lease', lease_id), 'state', 'deadline_ms')
  if l[1] == 'active' and l[2]
      and begin_ending(lease_id, 'max_runtime', math.max(0, tonumber(l[2]) - now), now) then
    table.insert(warned, lease_id)
  end
end
return cjson.encode({ok = true, ended = warned})
