-- End every lease and unclaimed reservation whose term has passed on the ledger's clock; a lease
-- at its deadline (maximum run time) ends max_runtime, the others expired.
-- ARGV[1]: the most to end in one call (keeps each script short)
local now = now_ms()
local due = redis.call('ZRANGEBYSCORE', k('expiry'), '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
local ended = {}
for _, lease_id in ipairs(due) do
  local state, deadline, ending = unpack(redis.call('HMGET', k('lease', lease_id), 'state',
    'deadline_ms', 'ending_reason'))
  local reason, detail = 'expired', 'not renewed in time'
  if state == 'reserved' then
    detail = 'reservation was never claimed'
  elseif deadline and tonumber(deadline) <= now and ending then
    reason, detail = ending, 'its grace period is over'
  elseif deadline and tonumber(deadline) <= now then
    reason, detail = 'max_runtime', 'reached its maximum run time'
  end
  if end_lease(lease_id, reason, detail, now) == 'ended' then
    table.insert(ended, lease_id)
  else
    redis.call('ZREM', k('expiry'), lease_id)
  end
end
return cjson.encode({ok = true, ended = ended})
