-- Put a node and its devices into the ledger, or reconcile them on a collector restart: usage of
-- surviving devices is kept, new devices join free, and leases on vanished devices end as lost.
-- A device id that now names another unit (its uuid changed: a MIG instance destroyed and made
-- again with the same GPU and compute instance ids, another card at the same index) is the old
-- unit vanished and a new one joined: its leases end as lost, since the unit their holders were
-- told (CUDA_VISIBLE_DEVICES=<its uuid>) is gone, and the new one joins free.
-- The registering collector process (``instance``) holds the node from now on: heartbeat.lua
-- refuses another's (a restarted collector registers first, so it takes over from its dead
-- predecessor; two live ones under one node id leave the last to register holding it).
-- ARGV[1]: JSON {node_id, instance, cpu_milli, memory_mib, labels_json, devices=[{device_id, spec=<json>,
--   memory_mib, uuid, health?, health_reason?}]}; a device's health, when given, is what its
--   backend reads now and is written with the rest (else a new device is healthy, one the node's
--   loss marked lost is healthy again, and any other keeps its health). A device quarantined by
--   the node's loss (reap_nodes.lua) stays unhealthy until its quarantine ends, and takes that
--   health then, when the collector that registers is the one that held the node (see cut_off).
local r = cjson.decode(ARGV[1])
local nk = k('node', r.node_id)
local wanted = {}
for _, d in ipairs(r.devices) do
  if wanted[d.device_id] then return fail('duplicate_device_id', d.device_id) end
  wanted[d.device_id] = d
end
local now = now_ms()
local removed, lost = {}, {}
-- The very collector process that held the node is back (its heartbeats were refused: the node
-- was declared lost while it ran): the node was cut off, and so were the holders of its lost
-- leases, who may still run; their devices' quarantines (reap_nodes.lua) stand. Another process
-- (the collector restarted, over a network that was up: the holders heard their leases end) or
-- none named ends them now.
local cut_off = (r.instance or '') ~= '' and redis.call('HGET', nk, 'instance') == r.instance
local function end_leases_of(device_id, detail)
  for _, lease_id in ipairs(redis.call('SMEMBERS', k('dev-leases', device_id))) do
    if end_lease(lease_id, 'lost', detail, now) == 'ended' then table.insert(lost, lease_id) end
  end
end
for _, device_id in ipairs(redis.call('SMEMBERS', k('node-devices', r.node_id))) do
  if not wanted[device_id] then
    end_leases_of(device_id, 'device ' .. device_id .. ' vanished')
    redis.call('DEL', k('dev', device_id), k('dev-leases', device_id))
    redis.call('SREM', k('devices'), device_id)
    redis.call('SREM', k('node-devices', r.node_id), device_id)
    touched('dev', device_id)
    table.insert(removed, device_id)
  end
end
local added = {}
for _, d in ipairs(r.devices) do
  local dk = k('dev', d.device_id)
  local held = redis.call('HMGET', dk, 'mem_total', 'spec')
  local old_uuid = held[2] and cjson.decode(held[2]).uuid
  if held[1] and d.uuid and old_uuid ~= d.uuid then
    end_leases_of(d.device_id, 'device ' .. d.device_id .. ' replaced: uuid ' ..
      tostring(old_uuid) .. ' is now ' .. d.uuid)
    -- Nothing holds the old unit now; the new one starts from nothing, as a new device does.
    redis.call('DEL', dk, k('dev-leases', d.device_id))
    table.insert(removed, d.device_id)
    held[1] = false
  end
  if held[1] and not cut_off and redis.call('HEXISTS', dk, 'quarantine_until') == 1 then
    end_quarantine(dk)
  end
  if held[1] then
    -- A device whose visible memory changed keeps what is leased out of it.
    redis.call('HINCRBY', dk, 'mem_free', d.memory_mib - tonumber(held[1]))
    redis.call('HSET', dk, 'spec', d.spec, 'mem_total', d.memory_mib, 'node', r.node_id)
    if not d.health and redis.call('HGET', dk, 'health') == 'lost' then
      set_device_health(dk, 'healthy', '', now)
    end
  else
    redis.call('HSET', dk, 'spec', d.spec, 'node', r.node_id, 'mem_total', d.memory_mib,
      'mem_free', d.memory_mib, 'compute_free', 100, 'holders', 0, 'exclusive', 0,
      'health', 'healthy')
    table.insert(added, d.device_id)
  end
  -- The backend's reading, in the same step: a device is never grantable in between as
  -- healthy when it is not, and one that recovered while no collector ran is healthy again.
  if d.health then set_device_health(dk, d.health, d.health_reason or '', now) end
  redis.call('SADD', k('devices'), d.device_id)
  redis.call('SADD', k('node-devices', r.node_id), d.device_id)
  touched('dev', d.device_id)
end
local used_cpu, used_mem = 0, 0
local old = redis.call('HMGET', nk, 'cpu_total', 'cpu_free', 'mem_total', 'mem_free')
if old[1] then
  used_cpu = tonumber(old[1]) - tonumber(old[2])
  used_mem = tonumber(old[3]) - tonumber(old[4])
end
redis.call('HSET', nk, 'cpu_total', r.cpu_milli, 'cpu_free', r.cpu_milli - used_cpu,
  'mem_total', r.memory_mib, 'mem_free', r.memory_mib - used_mem, 'labels', r.labels_json,
  'status', 'up', 'last_seen_ms', now, 'instance', r.instance or '')
-- Drained before it ever registered (set_draining.lua: the autoscaler is giving it back): it
-- comes up draining, so no grant lands on a node on its way out. (Only the autoscaler lifts it.)
if redis.call('EXISTS', k('node-held-drained', r.node_id)) == 1 then
  redis.call('HSET', nk, 'draining', '1')
end
redis.call('SADD', k('nodes'), r.node_id)
redis.call('ZADD', k('node-seen'), now, r.node_id)
bump()
touched('node', r.node_id)
return cjson.encode({ok = true, added = added, removed = removed, lost = lost})
