-- include: _view
-- The change log since a reader's cursor and the records it names, read in one atomic step (the
-- scheduler's snapshot cache; before, three round trips). Writes nothing.
-- ARGV[1]: the cursor's change sequence ('' for none: the header only);
-- ARGV[2]: the most records to return with the log (more: the log only, the reader reads them);
-- ARGV[3]: '1' when the reader keeps the devices it read before: a device the log does not name
-- has not changed since the cursor, so its hash is not sent again (false in its place).
-- Returns {header, entries, nodes, leases}:
--   header  = {epoch, seq, floor, version, run_id, time_s, time_us}
--   entries = the log's "kind:id" entries after the cursor
--   nodes   = {node_id, member (0/1), node hash (flat), {device id, ...}, {device hash (flat)
--             or false, ...}} for every node the log names, directly or through one of its
--             devices; its devices in device id order
--   leases  = {lease_id, live (0/1), lease hash (flat), false for a lease no longer live (the
--             reader drops it; its hash is most of an ended lease's bytes)} for every lease the
--             log names
--   (nodes and leases are false when there were more records than ARGV[2])
local t = redis.call('TIME')
local run_id = server_run_id()
local header = {
  redis.call('GET', k('changes-epoch')) or '',
  redis.call('GET', k('changes-seq')) or '0',
  redis.call('GET', k('changes-floor')) or '0',
  redis.call('GET', k('ver')) or '0',
  run_id, t[1], t[2],
}
if ARGV[1] == '' then return {header, {}, false, false} end
local entries = redis.call('ZRANGEBYSCORE', k('changes'), '(' .. ARGV[1], '+inf')

local node_ids, lease_ids, seen, changed_devices = {}, {}, {}, {}
local only_changed = ARGV[3] == '1'
local function want(list, kind, id)
  if id and not seen[kind .. ':' .. id] then
    seen[kind .. ':' .. id] = true
    list[#list + 1] = id
  end
end
for _, entry in ipairs(entries) do
  local kind, id = string.match(entry, '^(%a+):(.*)$')
  if kind == 'node' then
    want(node_ids, 'node', id)
  elseif kind == 'dev' then
    changed_devices[id] = true
    -- The node the device is on now (the reader adds any node it knew the device on before).
    local owner = redis.call('HGET', k('dev', id), 'node')
    if owner then want(node_ids, 'node', owner) end
  elseif kind == 'lease' then
    want(lease_ids, 'lease', id)
  end
end
if #node_ids + #lease_ids > tonumber(ARGV[2]) then return {header, entries, false, false} end

local nodes = {}
for _, node_id in ipairs(node_ids) do
  local device_ids = redis.call('SMEMBERS', k('node-devices', node_id))
  table.sort(device_ids)
  local devices = {}
  for i, device_id in ipairs(device_ids) do
    if only_changed and not changed_devices[device_id] then
      devices[i] = false
    else
      devices[i] = redis.call('HGETALL', k('dev', device_id))
    end
  end
  nodes[#nodes + 1] = {
    node_id, redis.call('SISMEMBER', k('nodes'), node_id),
    redis.call('HGETALL', k('node', node_id)), device_ids, devices,
  }
end
local leases = {}
for _, lease_id in ipairs(lease_ids) do
  local live = redis.call('SISMEMBER', k('leases'), lease_id)
  leases[#leases + 1] = {lease_id, live, live == 1 and redis.call('HGETALL', k('lease', lease_id))}
end
return {header, entries, nodes, leases}
