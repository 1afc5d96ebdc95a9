-- Declare lost every node whose last heartbeat is older than the grace period, end its leases
-- as lost and mark its devices lost. ARGV[1]: grace_ms
-- The candidates come from the heartbeat index (node-seen: node id scored by its last heartbeat,
-- written by register_node and heartbeat), so a check costs what is overdue, not the fleet: it
-- runs every second, and a scan of every node held the ledger for milliseconds at a thousand
-- nodes. A node that is not up (lost) leaves the candidates (+inf) until it registers again.
local now = now_ms()
local grace = tonumber(ARGV[1])
local seen = k('node-seen')
-- Nodes the index lacks (a ledger written before it) are indexed first, from their records.
if redis.call('ZCARD', seen) < redis.call('SCARD', k('nodes')) then
  for _, node_id in ipairs(redis.call('SMEMBERS', k('nodes'))) do
    if not redis.call('ZSCORE', seen, node_id) then
      redis.call('ZADD', seen, redis.call('HGET', k('node', node_id), 'last_seen_ms') or 0, node_id)
    end
  end
end
local lost_nodes = {}
for _, node_id in ipairs(redis.call('ZRANGEBYSCORE', seen, '-inf', '(' .. (now - grace))) do
  local n = redis.call('HMGET', k('node', node_id), 'status', 'last_seen_ms')
  if n[1] == 'up' and now - tonumber(n[2]) > grace then
    redis.call('HSET', k('node', node_id), 'status', 'lost')
    for _, lease_id in ipairs(redis.call('SMEMBERS', k('node-leases', node_id))) do
      end_lease(lease_id, 'lost', 'node ' .. node_id .. ' stopped heartbeating', now)
    end
    for _, device_id in ipairs(redis.call('SMEMBERS', k('node-devices', node_id))) do
      redis.call('HSET', k('dev', device_id), 'health', 'lost')
      touched('dev', device_id)
    end
    redis.call('XADD', k('outbox', 'lease-manager'), '*', 'kind', 'node_lost', 'node_id', node_id,
      'last_seen_ms', n[2])
    table.insert(lost_nodes, node_id)
    bump()
    touched('node', node_id)
  end
  if n[1] ~= 'up' or now - tonumber(n[2] or 0) > grace then
    redis.call('ZADD', seen, '+inf', node_id)
  elseif n[2] then
    redis.call('ZADD', seen, n[2], node_id)  -- the index lagged its record: catch up
  end
end
return cjson.encode({ok = true, lost = lost_nodes})
