-- Put a node and its devices into the ledger, or reconcile them on a collector restart: usage of
-- surviving devices is kept, new devices join free, and leases on vanished devices end as lost.
-- ARGV[1]: JSON {node_id, cpu_milli, memory_mib, labels_json, devices=[{device_id, spec=<json>,
--   memory_mib}]}
local r = cjson.decode(ARGV[1])
local nk = k('node', r.node_id)
local wanted = {}
for _, d in ipairs(r.devices) do
  if wanted[d.device_id] then return fail('duplicate_device_id', d.device_id) end
  wanted[d.device_id] = d
end
local now = now_ms()
local removed, lost = {}, {}
for _, device_id in ipairs(redis.call('SMEMBERS', k('node-devices', r.node_id))) do
  if not wanted[device_id] then
    for _, lease_id in ipairs(redis.call('SMEMBERS', k('dev-leases', device_id))) do
      if end_lease(lease_id, 'lost', 'device ' .. device_id .. ' vanished', now) == 'ended' then
        table.insert(lost, lease_id)
      end
    end
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
  local old_total = redis.call('HGET', dk, 'mem_total')
  if old_total then
    -- A device whose visible memory changed keeps what is leased out of it.
    redis.call('HINCRBY', dk, 'mem_free', d.memory_mib - tonumber(old_total))
    redis.call('HSET', dk, 'spec', d.spec, 'mem_total', d.memory_mib, 'node', r.node_id)
    if redis.call('HGET', dk, 'health') == 'lost' then redis.call('HSET', dk, 'health', 'healthy') end
  else
    redis.call('HSET', dk, 'spec', d.spec, 'node', r.node_id, 'mem_total', d.memory_mib,
      'mem_free', d.memory_mib, 'compute_free', 100, 'holders', 0, 'exclusive', 0,
      'health', 'healthy')
    table.insert(added, d.device_id)
  end
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
  'status', 'up', 'last_seen_ms', now)
redis.call('SADD', k('nodes'), r.node_id)
redis.call('ZADD', k('node-seen'), now, r.node_id)
bump()
touched('node', r.node_id)
return cjson.encode({ok = true, added = added, removed = removed, lost = lost})
