-- Idle reclaim: a watched lease (its queue opted in with idle_reclaim_s) whose devices have done
-- no work for that long is warned and ends ``idle`` after ARGV[1] ms (see begin_ending). Work is
-- the devices' last non-zero utilisation (heartbeat.lua's active_ms); a lease is never idle for
-- longer than it has existed. The index is scored by the earliest time each lease could be idle,
-- so a sweep reads only the leases due; one that worked since is put back at its next chance.
-- ARGV: warning_ms, the most to look at in one call
local now = now_ms()
local due = redis.call('ZRANGEBYSCORE', k('idle-watch'), '-inf', now, 'LIMIT', 0,
  tonumber(ARGV[2]))
local warned = {}
for _, lease_id in ipairs(due) do
  local l = redis.call('HMGET', k('lease', lease_id), 'state', 'granted_ms', 'idle_after_ms',
    'slices', 'ending_reason')
  if l[1] ~= 'active' or l[5] then
    redis.call('ZREM', k('idle-watch'), lease_id)
  else
    local last = tonumber(l[2])
    -- A record without its slices (damaged) counts as idle since its grant, as it ends whole
    -- (end_lease): an error here would refuse every sweep while the lease stays watched.
    for _, s in ipairs(cjson.decode(l[4] or '[]')) do
      local active = tonumber(redis.call('HGET', k('dev', s.device_id), 'active_ms') or '0')
      if active > last then last = active end
    end
    local idle_after = tonumber(l[3])
    if now - last >= idle_after then
      redis.call('ZREM', k('idle-watch'), lease_id)
      if begin_ending(lease_id, 'idle', tonumber(ARGV[1]), now) then
        table.insert(warned, lease_id)
      end
    else
      redis.call('ZADD', k('idle-watch'), last + idle_after, lease_id)
    end
  end
end
return cjson.encode({ok = true, ended = warned})
