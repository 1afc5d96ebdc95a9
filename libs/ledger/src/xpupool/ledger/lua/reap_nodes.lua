-- Declare lost every node whose last heartbeat is older than the grace period, end its leases
-- as lost and mark its devices lost. ARGV[1]: grace_ms
local now = now_ms()
local grace = tonumber(ARGV[1])
local lost_nodes = {}
for _, node_id in ipairs(redis.call('SMEMBERS', k('nodes'))) do
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
end
return cjson.encode({ok = true, lost = lost_nodes})
