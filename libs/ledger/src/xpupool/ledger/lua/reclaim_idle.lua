-- Idle reclaim: a watched lease (its queue opted in with idle_reclaim_s) whose devices have done
-- no work for that long is warned and ends ``idle`` after ARGV[1] ms (see begin_ending). Work is
-- the devices' last non-zero utilisation (record_load's active_ms); a lease is never idle for
-- longer than it has existed. ARGV: warning_ms, the most to look at in one call
local now = now_ms()
local watched = redis.call('ZRANGE', k('idle-watch'), 0, tonumber(ARGV[2]) - 1)
local warned = {}
for _, lease_id in ipairs(watched) do
  local lk = k('lease', lease_id)
  local l = redis.call('HMGET', lk, 'state', 'granted_ms', 'idle_after_ms', 'slices',
    'ending_reason')
  if l[1] ~= 'active' then
    redis.call('ZREM', k('idle-watch'), lease_id)
  elseif not l[5] then
    local last = tonumber(l[2])
    for _, s in ipairs(cjson.decode(l[4])) do
      local active = tonumber(redis.call('HGET', k('dev', s.device_id), 'active_ms') or '0')
      if active > last then last = active end
    end
    if now - last >= tonumber(l[3]) and begin_ending(lease_id, 'idle', tonumber(ARGV[1]), now) then
      table.insert(warned, lease_id)
    end
  end
end
return cjson.encode({ok = true, ended = warned})
