-- Declare lost every node whose last heartbeat is older than the grace period, end its leases
-- as lost and mark its devices lost. ARGV[1]: grace_ms; ARGV[2]: holder_grace_ms ('' = 0).
-- A lease ended lost with its node may still run: its holder was cut off with the node (a
-- partition, not a crash) and goes on until the term it last heard of, then stops its job within
-- its runner's kill grace (``xpupool run``'s ``grace_s``). So the lease's devices are quarantined
-- until its ``expires_ms`` plus holder_grace_ms: a node back sooner (the partition healed)
-- registers them unhealthy (register_node.lua) and they take no grant until then. This script
-- also lifts the quarantines that ran out (the ``quarantine`` index, device scored by its end).
-- The candidates come from the heartbeat index (node-seen: node id scored by its last heartbeat,
-- written by register_node and heartbeat), so a check costs what is overdue, not the fleet: it
-- runs every second, and a scan of every node held the ledger for milliseconds at a thousand
-- nodes. A node that is not up (lost) leaves the candidates (+inf) until it registers again.
local now = now_ms()
local grace = tonumber(ARGV[1])
local holder_grace = tonumber(ARGV[2] or '') or 0
local seen = k('node-seen')
local quarantine = k('quarantine')
for _, device_id in ipairs(redis.call('ZRANGEBYSCORE', quarantine, '-inf', now)) do
  redis.call('ZREM', quarantine, device_id)
  lift_quarantine(device_id, now)
end
-- The devices of a lease about to end lost, held until its holder has surely stopped.
local function quarantine_devices_of(lease_id)
  local l = redis.call('HMGET', k('lease', lease_id), 'expires_ms', 'slices')
  local until_ms = tonumber(l[1] or '')
  if not until_ms then return end
  until_ms = until_ms + holder_grace
  if until_ms <= now then return end
  for _, s in ipairs(cjson.decode(l[2] or '[]')) do
    local dk = k('dev', s.device_id)
    local held = tonumber(redis.call('HGET', dk, 'quarantine_until') or '')
    if redis.call('EXISTS', dk) == 1 and (not held or held < until_ms) then
      redis.call('HSET', dk, 'quarantine_until', until_ms, 'quarantine_lease', lease_id)
      redis.call('ZADD', quarantine, until_ms, s.device_id)
    end
  end
end
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
      quarantine_devices_of(lease_id)
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
