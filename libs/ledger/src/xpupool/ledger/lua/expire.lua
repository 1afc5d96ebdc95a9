-- End every lease and unclaimed reservation whose term has passed on the ledger's clock.
-- ARGV[1]: the most to end in one call (keeps each script short)
local now = now_ms()
local due = redis.call('ZRANGEBYSCORE', k('expiry'), '-inf', now, 'LIMIT', 0, tonumber(ARGV[1]))
local ended = {}
for _, lease_id in ipairs(due) do
  local state = redis.call('HGET', k('lease', lease_id), 'state')
  local detail = state == 'reserved' and 'reservation was never claimed' or 'not renewed in time'
  if end_lease(lease_id, 'expired', detail, now) == 'ended' then
    table.insert(ended, lease_id)
  else
    redis.call('ZREM', k('expiry'), lease_id)
  end
end
return cjson.encode({ok = true, ended = ended})
