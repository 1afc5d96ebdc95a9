-- Included by the scripts that take reservations (`-- include: _reservation`), not by every
-- script: a role's Redis ACL allows the commands of the scripts it runs and what they include.
-- Take a reservation for a job (r: the JSON of reserve.lua's ARGV[1]): re-check device health,
-- capacity, host resources and quota, then write slices, host charges, quota counters and the
-- lease at once. With r.secret the lease is granted at once (``activation``, written with the
-- rest of its hash); without one it stays reserved and the scheduler's outbox announces that.
-- Shared by reserve.lua (a pending job) and pend.lua (a new job placed on admission). A grant is
-- announced through ``grant_outbox`` (the lease-manager's unless the caller publishes it itself:
-- 'direct', see outbox.py); the lease keeps the entry (``grant_entry_fields``, for
-- ``unconfirmed_grant``). Returns the taken slices, the fencing token (0 when only reserved)
-- and the grant's outbox entry id, or nil and the refusal; nothing is written before every check
-- passed. ``new_job`` (pend.lua, for a job it admits now and found no job waiting ahead of):
-- {trace = {traceparent, tracestate} or false, record = the job record's fields as pend.lua
-- would write them}: the record is written here, once, with its new state and lease (one AOF
-- entry instead of two); such a job has no pending entries to clear.
local function take_reservation(r, grant_outbox, new_job)
  if #r.slices == 0 and next(r.host) == nil then
    return nil, fail('empty_reservation', r.job_id)
  end
  local jk = k('job', r.job_id)
  -- ``counts``: each taken device's free memory, free compute and holders as read, and each
  -- charged node's free CPU and memory: the writes below set the new values in one HSET per
  -- record (an AOF entry each) instead of one HINCRBY per field.
  local seen, taken, counts, host_counts = {}, {}, {}, {}
  for i, s in ipairs(r.slices) do
    if seen[s.device_id] then return nil, fail('duplicate_device', s.device_id) end
    seen[s.device_id] = true
    local d = redis.call('HMGET', k('dev', s.device_id), 'health', 'mem_free', 'compute_free',
      'holders', 'exclusive', 'node', 'mem_total')
    if not d[1] then return nil, fail('device_gone', s.device_id) end
    if d[1] ~= 'healthy' then return nil, fail('device_unhealthy', s.device_id) end
    local node = redis.call('HMGET', k('node', d[6]), 'status', 'draining')
    if node[1] ~= 'up' then return nil, fail('node_down', d[6]) end
    if node[2] == '1' then return nil, fail('node_draining', d[6]) end
    local mem_free, compute_free, holders = tonumber(d[2]), tonumber(d[3]), tonumber(d[4])
    counts[i] = {mem_free, compute_free, holders}
    if s.whole then
      if holders > 0 then return nil, fail('insufficient_capacity', s.device_id) end
      taken[i] = {device_id = s.device_id, node_id = d[6], whole = true,
        memory_mib = tonumber(d[7]), compute_pct = 100, meta = s.meta}
    else
      if tonumber(d[5]) == 1 or mem_free < s.memory_mib or compute_free < s.compute_pct then
        return nil, fail('insufficient_capacity', s.device_id)
      end
      taken[i] = {device_id = s.device_id, node_id = d[6], whole = false,
        memory_mib = s.memory_mib, compute_pct = s.compute_pct, meta = s.meta}
    end
  end
  for node_id, h in pairs(r.host) do
    local n = redis.call('HMGET', k('node', node_id), 'cpu_free', 'mem_free', 'status', 'draining')
    if n[3] ~= 'up' then return nil, fail('node_down', node_id) end
    if n[4] == '1' then return nil, fail('node_draining', node_id) end
    local cpu_free, host_mem_free = tonumber(n[1] or '0'), tonumber(n[2] or '0')
    if cpu_free < h.cpu_milli or host_mem_free < h.memory_mib then
      return nil, fail('insufficient_host_resources', node_id)
    end
    host_counts[node_id] = {cpu_free, host_mem_free}
  end
  for _, u in ipairs(r.usage) do
    -- The amount the lease's record keeps (cjson writes 14 significant digits), which its end
    -- gives back: checked and added as that, so the counter comes back to what it was. (A
    -- share's fraction, a third of a device, rarely has a short decimal form; the difference
    -- left by each lease added up, with the same sign for the same share.)
    u.inc = cjson.decode(cjson.encode(u.inc))
    -- Read only where a limit applies: most counters (every ancestor's, every model's) have none.
    if u.limit >= 0 then
      local current = tonumber(redis.call('HGET', k('usage', u.scope), u.field) or '0')
      if current + u.inc > u.limit + 1e-9 then
        return nil, fail('quota_exceeded', u.scope .. '/' .. u.field)
      end
    end
  end

  -- Every check passed: write.
  local now = now_ms()
  local lk = k('lease', r.lease_id)
  for i, s in ipairs(taken) do
    local dk, c = k('dev', s.device_id), counts[i]
    local fields = {'mem_free', c[1] + neg(s.memory_mib), 'compute_free', c[2] + neg(s.compute_pct),
      'holders', c[3] + 1}
    if s.whole then fields[7], fields[8] = 'exclusive', 1 end
    redis.call('HSET', dk, unpack(fields))
    redis.call('SADD', k('dev-leases', s.device_id), r.lease_id)
    redis.call('SADD', k('node-leases', s.node_id), r.lease_id)
    touched('dev', s.device_id)
  end
  for node_id, h in pairs(r.host) do
    local c = host_counts[node_id]
    redis.call('HSET', k('node', node_id), 'cpu_free', c[1] + neg(h.cpu_milli),
      'mem_free', c[2] + neg(h.memory_mib))
    redis.call('SADD', k('node-leases', node_id), r.lease_id)
    touched('node', node_id)
  end
  for _, u in ipairs(r.usage) do
    redis.call('HINCRBYFLOAT', k('usage', u.scope), u.field, u.inc)
  end
  -- A lease granted as it is created (a secret given) is written once, active.
  local granting = r.secret and r.secret ~= ''
  local token, expires, activated = 0, now + r.hold_ms, {}
  if granting then
    token, expires, activated = activation(r.lease_id, r.ttl_ms, r.max_runtime_ms,
      r.idle_after_ms, taken, r.secret, now)
  else
    redis.call('ZADD', k('expiry'), expires, r.lease_id)
  end
  -- cjson writes an empty table as {}: a host-only lease's slices must still read back as a list.
  local slices_json = #taken > 0 and cjson.encode(taken) or '[]'
  local lease = {'job_id', r.job_id, 'tenant', r.tenant, 'owner', r.owner, 'queue', r.queue,
    'priority', r.priority, 'state', granting and 'active' or 'reserved', 'slices', slices_json,
    'host', cjson.encode(r.host), 'usage', cjson.encode(r.usage), 'ttl_ms', r.ttl_ms,
    'created_ms', now, 'expires_ms', expires, 'token', token,
    'max_runtime_ms', r.max_runtime_ms or 0, 'idle_after_ms', r.idle_after_ms or 0}
  for _, v in ipairs(activated) do lease[#lease + 1] = v end
  -- The lease continues its job's trace: the relay, renewals and the end read it from here.
  local trace = new_job and new_job.trace
  if trace == nil then
    trace = redis.call('HMGET', jk, 'traceparent', 'tracestate')
    trace = trace[1] and trace
  end
  if trace then
    for _, v in ipairs({'traceparent', trace[1], 'tracestate', trace[2] or ''}) do
      lease[#lease + 1] = v
    end
  end
  local entry = nil
  if granting then
    local outbox = grant_outbox or 'lease-manager'
    entry = traced_event(outbox, r.lease_id, 'granted', trace, 'expires_ms', expires)
    for _, v in ipairs(grant_entry_fields(outbox, entry)) do lease[#lease + 1] = v end
  end
  redis.call('HSET', lk, unpack(lease))
  redis.call('SADD', k('leases'), r.lease_id)
  -- The tenant's live leases, for its lease.list (whatever became of its job's record).
  redis.call('SADD', k('tenant-leases', r.tenant), r.lease_id)
  local job_state = granting and 'leased' or 'reserved'
  if new_job then
    local record = new_job.record
    for i = 1, #record, 2 do
      if record[i] == 'state' then record[i + 1] = job_state end
    end
    record[#record + 1], record[#record + 2] = 'lease_id', r.lease_id
    redis.call('HSET', jk, unpack(record))
  else
    redis.call('HSET', jk, 'state', job_state, 'lease_id', r.lease_id)
    -- A live job's record does not expire (one pended by a version that set its expiry then).
    redis.call('PERSIST', jk)
    unpend(r.job_id)
  end
  if not granting then
    traced_event('scheduler', r.lease_id, 'reserved', trace)
  end
  bump()
  touched('lease', r.lease_id)
  return {taken = taken, token = token, entry = entry}
end
