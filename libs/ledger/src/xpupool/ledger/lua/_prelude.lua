-- Shared by every ledger script (prepended at load time). KEYS[1] is the key prefix, a Redis
-- Cluster hash tag such as "{xpupool}:", so every key of one ledger lives in one slot.
local P = KEYS[1]
-- A key name: the prefix and one or two parts ("dev", id). No script names three; building a
-- table to join them cost a script a third of a microsecond per key, about fifty per job.
local function k(kind, id)
  if id == nil then return P .. kind end
  return P .. kind .. ':' .. id
end
-- The server's clock, read once per script: a script runs atomically, so each of its steps is
-- at the same instant (and each TIME is a command, about 2 us inside a script).
local clock = nil
local function server_time()
  if not clock then clock = redis.call('TIME') end
  return clock
end
local function now_ms()
  local t = server_time()
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function fail(reason, detail)
  return cjson.encode({ok = false, reason = reason, detail = detail or ''})
end
-- Lua 5.1 turns -0 into the string "-0", which HINCRBY refuses mid-script (after earlier
-- writes): always negate through this.
local function neg(x) return 0 - math.floor(tonumber(x)) end
local function bump() redis.call('INCR', k('ver')) end
-- How long the ledger keeps what is over, in seconds: a job's record after the job ended (its
-- id is refused as a duplicate that long; a live job's record never expires) and an ended
-- lease's record (lease.get answers for it that long, and an outbox entry about it can still be
-- built). The lease-manager writes them to the retention hash (set_retention.lua, from
-- XPUPOOL_JOB_RETENTION_S and XPUPOOL_LEASE_RETENTION_S); a week each until one is written.
local DEFAULT_RETAIN_S = 7 * 24 * 3600
local retention = nil
local function retain_s(kind)
  if not retention then
    local r = redis.call('HMGET', k('retention'), 'job_s', 'lease_s')
    retention = {job = tonumber(r[1]) or DEFAULT_RETAIN_S,
      lease = tonumber(r[2]) or DEFAULT_RETAIN_S}
  end
  return retention[kind]
end
-- A job's record once the job is over (ended, rejected, timed out, cancelled).
local function job_over(job_id) redis.call('EXPIRE', k('job', job_id), retain_s('job')) end

-- The change log, for readers that keep a copy of the ledger (the scheduler's snapshot cache):
-- a sorted set of "node:<id>", "dev:<id>" and "lease:<id>", each scored with the change sequence
-- of the last script that touched that record, so a reader that remembers the sequence it read
-- re-reads only what changed since. Every script that writes a node, device or lease hash, or
-- the membership of nodes, node-devices or leases, calls touched() for each record. The log keeps
-- one entry per record and is trimmed oldest-first past CHANGE_LOG_MAX; changes-floor says up to
-- which sequence entries may be gone (a reader older than that reads everything again), and
-- changes-epoch, stamped when the log starts, tells a reader that the log started over.
-- A script that changes anything also publishes its sequence once on the changes-feed channel,
-- so a reader can keep its copy warm instead of asking the log first (a subscriber sees the
-- message only after the whole script ran, and, with AOF, after it was made durable).
-- Live load (a device's utilisation, heartbeat.lua) is telemetry, not capacity: it is logged
-- like any change (placement scores by it), but it is announced as "<seq>:load" and leaves
-- capacity-seq alone. capacity-seq is the sequence of the last change that was more than live
-- load; pend.lua takes a placement decided on a kept copy as long as nothing but live load
-- changed since that copy was read (a sample is seconds old when it is written anyway).
-- A caller that follows the feed itself and counts its own changes as unread until it reads
-- them (the scheduler's SnapshotCache.own_change) may ask a script not to announce its change
-- when that caller is the feed's only subscriber (quiet_if_only_reader): nobody else would hear
-- it, and the caller would only skip it. A second subscriber (another scheduler replica) hears
-- every change as before. Live load is always announced: the caller does not count it.
local CHANGE_LOG_MAX, CHANGE_LOG_TRIM = 50000, 5000
local change_seq, capacity_noted, announce_capacity = nil, false, true
local function quiet_if_only_reader(caller_follows_feed)
  if caller_follows_feed and redis.call('PUBSUB', 'NUMSUB', k('changes-feed'))[2] == 1 then
    announce_capacity = false
  end
end
local function log_change(kind, id, load_only)
  if not change_seq then
    change_seq = redis.call('INCR', k('changes-seq'))
    local t = server_time()
    redis.call('SET', k('changes-epoch'), t[1] .. '.' .. t[2], 'NX')
    local size = redis.call('ZCARD', k('changes'))
    if size >= CHANGE_LOG_MAX then
      local cut = size - CHANGE_LOG_MAX + CHANGE_LOG_TRIM
      local last = redis.call('ZRANGE', k('changes'), cut - 1, cut - 1, 'WITHSCORES')
      redis.call('ZREMRANGEBYRANK', k('changes'), 0, cut - 1)
      redis.call('SET', k('changes-floor'), last[2])
    end
    if load_only then redis.call('PUBLISH', k('changes-feed'), change_seq .. ':load') end
  end
  if not load_only and not capacity_noted then
    capacity_noted = true
    redis.call('SET', k('capacity-seq'), change_seq)
    if announce_capacity then redis.call('PUBLISH', k('changes-feed'), change_seq) end
  end
  redis.call('ZADD', k('changes'), change_seq, kind .. ':' .. id)
end
local function touched(kind, id) log_change(kind, id, false) end
local function touched_load(kind, id) log_change(kind, id, true) end

-- A device quarantined by reap_nodes.lua (``quarantine_until``): a lease on it ended lost with its
-- node, and the holder may run on it until then. Its health stays 'unhealthy' until then; the
-- health it is given meanwhile (a registration, its collector's reading) is kept for then
-- (``health_after``). Sets ``dk``'s health, or keeps it for later; true when set now.
local function set_device_health(dk, health, reason, now)
  local q = redis.call('HMGET', dk, 'quarantine_until', 'quarantine_lease')
  local until_ms = tonumber(q[1] or '')
  if until_ms and until_ms > now then
    redis.call('HSET', dk, 'health', 'unhealthy', 'health_reason', 'quarantined until ' ..
      until_ms .. ' (ms since the epoch): lease ' .. (q[2] or '?') .. ' ended lost with its ' ..
      'node, and its holder may run on this device until its term ends',
      'health_after', health, 'health_after_reason', reason)
    return false
  end
  redis.call('HSET', dk, 'health', health, 'health_reason', reason)
  return true
end
-- A quarantine's end: the device takes the health it was given meanwhile (if any). True when
-- its health changed.
local function forget_quarantine(dk)
  redis.call('HDEL', dk, 'quarantine_until', 'quarantine_lease', 'health_after',
    'health_after_reason')
end
local function end_quarantine(dk)
  local q = redis.call('HMGET', dk, 'health_after', 'health_after_reason')
  forget_quarantine(dk)
  if not q[1] then return false end
  redis.call('HSET', dk, 'health', q[1], 'health_reason', q[2] or '')
  return true
end
-- The quarantine of ``device_id`` once it ran out (reap_nodes.lua), if its node is up (a node
-- lost again keeps its devices lost; its next registration gives them their health).
local function lift_quarantine(device_id, now)
  local dk = k('dev', device_id)
  local q = redis.call('HMGET', dk, 'quarantine_until', 'node')
  if not q[1] or tonumber(q[1]) > now then return end
  if redis.call('HGET', k('node', q[2]), 'status') ~= 'up' then
    forget_quarantine(dk)
  elseif end_quarantine(dk) then
    bump()
    touched('dev', device_id)
  end
end

-- Queue an event about a lease in ``service``'s outbox with the trace context the lease keeps
-- (its job's: ``trace`` = {traceparent, tracestate} as the lease holds them, or false for none),
-- so the relay continues that trace without reading the lease again. Returns the entry's id.
local function traced_event(service, lease_id, kind, trace, ...)
  local fields = {'kind', kind, 'lease_id', lease_id, ...}
  if trace and trace[1] then
    fields[#fields + 1] = 'traceparent'
    fields[#fields + 1] = trace[1]
    if trace[2] and trace[2] ~= '' then
      fields[#fields + 1] = 'tracestate'
      fields[#fields + 1] = trace[2]
    end
  end
  return redis.call('XADD', k('outbox', service), '*', unpack(fields))
end
-- ``traced_event`` with the trace read from the lease.
local function lease_event(service, lease_id, kind, ...)
  local trace = redis.call('HMGET', k('lease', lease_id), 'traceparent', 'tracestate')
  return traced_event(service, lease_id, kind, trace, ...)
end

-- The lease's fields that name its grant's outbox entry, written with the grant: the entry's id
-- and, unless it is the direct outbox's, the outbox (for ``unconfirmed_grant``).
local function grant_entry_fields(outbox, entry)
  if outbox == 'direct' then return {'grant_entry', entry} end
  return {'grant_entry', entry, 'grant_outbox', outbox}
end

-- The fields of a lease's grant entry while it is still in its outbox, else nil: its publisher
-- (the scheduler, which answers a grant on admission before it publishes the grant's event, or
-- the relay of any lease-manager replica) has not yet confirmed that JetStream stored the event.
-- Whoever publishes a later event of the lease then waits until JetStream holds the grant, or
-- publishes a copy of it first (the same ``Nats-Msg-Id``: JetStream keeps one), so no later
-- event of a lease is stored ahead of its grant (lease_manager/grant_watch.py).
local function unconfirmed_grant(lk)
  local g = redis.call('HMGET', lk, 'grant_entry', 'grant_outbox')
  if not g[1] then return nil end
  local found = redis.call('XRANGE', k('outbox', g[2] or 'direct'), g[1], g[1])
  if #found == 0 then return nil end
  return found[1][2]
end

-- The answer of a script that queued a lease's event in the direct outbox, for its caller to
-- publish itself (see outbox.py): ``answer`` with the entry and the lease's hash as it stands,
-- from which the caller builds the same event the relay would (Ledger.announced_lease).
local function announced(answer, lease_id, entry)
  answer.ok, answer.lease_id, answer.entry = true, lease_id, entry
  answer.lease = redis.call('HGETALL', k('lease', lease_id))
  return cjson.encode(answer)
end

-- The holder check every lease command from a tenant passes before it touches anything: the
-- lease must exist, belong to the tenant whose subject sent the command, match the grant's
-- secret, still be active within its term, and the fencing token must be its current one.
-- Returns nil when the holder is good, else the refusal to return.
local function holder_refusal(lk, lease_id, tenant, secret, token, now)
  local l = redis.call('HMGET', lk, 'state', 'tenant', 'secret', 'token', 'expires_ms')
  if not l[1] then return fail('unknown_lease', lease_id) end
  if l[2] ~= tenant then return fail('not_owner', lease_id) end
  if not l[3] or l[3] == '' or l[3] ~= secret then return fail('bad_secret', lease_id) end
  if l[1] == 'ended' then return fail('lease_ended', lease_id) end
  if l[1] ~= 'active' then return fail('lease_not_granted', lease_id) end
  if tonumber(l[4]) ~= tonumber(token) then return fail('stale_token', l[4]) end
  if now >= tonumber(l[5]) then return fail('lease_ended', 'its term passed') end
  return nil
end

-- Takes a job out of the pending queue (whatever took it: a reservation, a rejection, a timeout)
-- and gives its tenant's pending count back. Returns the stored request, if any.
local function unpend(job_id)
  if redis.call('ZREM', k('pending'), job_id) == 1 then
    local tenant = redis.call('HGET', k('job', job_id), 'tenant')
    if tenant and redis.call('HINCRBY', k('pending-count'), tenant, -1) <= 0 then
      redis.call('HDEL', k('pending-count'), tenant)
    end
  end
  redis.call('ZREM', k('pending-deadline'), job_id)
  local request = redis.call('GET', k('pending-req', job_id))
  redis.call('DEL', k('pending-req', job_id))
  return request
end

-- How an ended job ended, in a few words (nil while it has not ended): what a resubmission of
-- its id, or a cancel, is told.
local function job_outcome(job_id)
  local j = redis.call('HMGET', k('job', job_id), 'state', 'reason', 'lease_id')
  if j[1] == 'ended' then
    local reason = redis.call('HGET', k('lease', j[3] or ''), 'end_reason') or 'ended'
    return 'its lease ' .. (j[3] or '') .. ' ended (' .. reason .. ')'
  elseif j[1] == 'rejected' then
    return 'it was rejected (' .. (j[2] or '') .. ')'
  elseif j[1] == 'timed_out' then
    return 'it timed out waiting'
  elseif j[1] == 'cancelled' then
    return 'it was cancelled'
  end
  return nil
end

-- Starts a lease's announced end (a preemption with grace, idle reclaim): its deadline becomes
-- now + grace_ms (or stays, if sooner), renewals stop there, the holder is warned through the
-- lease-manager's outbox (LeaseEnding, once per reason), and the expiry sweep ends it then for
-- ``reason``. A lease already ending keeps its end unless this one is sooner and for another
-- reason (a preemption's grace for a lease warned of its maximum run time or of idle reclaim:
-- the preemptor waits the grace, not the rest of the older warning), which then replaces it and
-- is announced too. Returns false when nothing changed.
local function begin_ending(lease_id, reason, grace_ms, now)
  local lk = k('lease', lease_id)
  local l = redis.call('HMGET', lk, 'deadline_ms', 'expires_ms', 'ending_reason')
  local deadline = now + grace_ms
  if l[1] then deadline = math.min(deadline, tonumber(l[1])) end
  if l[3] and (l[3] == reason or not l[1] or deadline >= tonumber(l[1])) then return false end
  local expires = math.min(tonumber(l[2]), deadline)
  redis.call('HSET', lk, 'deadline_ms', deadline, 'ending_reason', reason, 'expires_ms', expires,
    'warned', 1)
  redis.call('ZADD', k('expiry'), expires, lease_id)
  lease_event('lease-manager', lease_id, 'ending', 'reason', reason, 'deadline_ms', deadline)
  touched('lease', lease_id)
  return true
end

-- Usage accounting: when a lease ends, one record of what it held and for how long, written in
-- the same script that ends it (end_lease is the only way a lease ends, and it ends once), into
-- usage-rec (lease_id -> JSON) indexed by end time in usage-ended. Used capacity comes from the
-- devices' load integrals (heartbeat.lua's util_int, mem_int) less their values at the grant
-- (load_base): a device's load is counted toward a share up to that share's grant, since the
-- ledger cannot tell which holder of a shared device did the work.
-- A device's load integrals (util_int, mem_int) carried forward to ``now``: the last sample's
-- value held since it, at most LOAD_HOLD_MS, as heartbeat.lua does at the next sample.
local LOAD_HOLD_MS = 60000
local LOAD_FIELDS = {'util_int', 'mem_int', 'util', 'mem_used', 'load_ms'}
-- A stored integral, 0 where it is not a finite number (a ledger written before samples were
-- checked may hold a NaN, which would fail every grant's encoding of its load baseline).
local function finite(v)
  local n = tonumber(v or '0') or 0
  if n ~= n or n == math.huge or n == -math.huge then return 0 end
  return n
end
-- ``d``: a device's LOAD_FIELDS as HMGET returns them.
local function integrals_of(d, now)
  local u, m = finite(d[1]), finite(d[2])
  if d[5] then
    local dt = math.max(0, math.min(now - tonumber(d[5]), LOAD_HOLD_MS)) / 1000
    if d[3] then u = u + finite(d[3]) * dt end
    if d[4] then m = m + finite(d[4]) * dt end
  end
  return u, m
end
local function load_integrals(device_id, now)
  return integrals_of(redis.call('HMGET', k('dev', device_id), unpack(LOAD_FIELDS)), now)
end
-- What makes a lease active: a fencing token, the term started on the ledger's clock (capped by
-- the maximum run time), the devices' load integrals as usage accounting's baseline, and the
-- expiry, deadline and idle-watch indexes, which it writes. The caller writes the lease's hash:
-- state 'active', the token, expires_ms, and the fields returned (``slices``: a table of
-- {device_id}), so that a lease granted as it is created is written once. Returns the token, the
-- term's end and those fields.
local function activation(lease_id, ttl_ms, max_runtime_ms, idle_after_ms, slices, secret, now)
  local token = redis.call('INCR', k('fence'))
  local expires = now + tonumber(ttl_ms)
  local fields = {}
  local max_runtime = tonumber(max_runtime_ms or '0') or 0
  if max_runtime > 0 then
    -- The term never runs past the maximum run time; renewals are capped there too.
    expires = math.min(expires, now + max_runtime)
    fields = {'deadline_ms', now + max_runtime}
    redis.call('ZADD', k('deadlines'), now + max_runtime, lease_id)
  end
  local load_base = {}
  for _, s in ipairs(slices) do
    local u, m = load_integrals(s.device_id, now)
    load_base[s.device_id] = {u, m}
  end
  for _, v in ipairs({'granted_ms', now, 'secret', secret, 'load_base', cjson.encode(load_base)}) do
    fields[#fields + 1] = v
  end
  redis.call('ZADD', k('expiry'), expires, lease_id)
  local idle_after = tonumber(idle_after_ms or '0') or 0
  if idle_after > 0 then redis.call('ZADD', k('idle-watch'), now + idle_after, lease_id) end
  return token, expires, fields
end
-- Turn the reserved lease into an active one (``activation``) and tell the lease-manager's outbox
-- to announce the grant (grant.lua: the lease-manager granting a reservation); the lease keeps the
-- entry (``grant_entry_fields``). Returns the fencing token, the term's end and the entry id.
local function activate(lease_id, secret, now)
  local lk = k('lease', lease_id)
  local l = redis.call('HMGET', lk, 'ttl_ms', 'job_id', 'max_runtime_ms', 'idle_after_ms',
    'slices')
  local token, expires, fields = activation(lease_id, l[1], l[3], l[4],
    cjson.decode(l[5] or '[]'), secret, now)
  local entry = lease_event('lease-manager', lease_id, 'granted', 'expires_ms', expires)
  for _, v in ipairs(grant_entry_fields('lease-manager', entry)) do fields[#fields + 1] = v end
  redis.call('HSET', lk, 'state', 'active', 'token', token, 'expires_ms', expires, unpack(fields))
  redis.call('HSET', k('job', l[2]), 'state', 'leased')
  return token, expires, entry
end

-- ``l``: the lease's job_id, tenant, queue, granted_ms and load_base, and its slices decoded.
local function write_usage(lease_id, reason, now, l, lease_slices)
  local granted = tonumber(l.granted_ms or '0') or 0
  local dur_s = 0
  if granted > 0 then dur_s = math.max(0, now - granted) / 1000 end
  local base = cjson.decode(l.load_base or '{}')
  local slices = {}
  for _, s in ipairs(lease_slices) do
    local share = s.whole and 1 or (tonumber(s.compute_pct) or 0) / 100
    local meta = type(s.meta) == 'table' and s.meta or {}
    local cur_u, cur_m = load_integrals(s.device_id, now)
    local b = base[s.device_id] or {0, 0}
    local granted_s = dur_s * share
    local granted_mem = dur_s * (tonumber(s.memory_mib) or 0)
    local used_s, used_mem = 0, 0
    if granted > 0 then
      used_s = math.min(granted_s, math.max(0, (cur_u - b[1]) / 100))
      used_mem = math.min(granted_mem, math.max(0, cur_m - b[2]))
    end
    table.insert(slices, {device_id = s.device_id, node_id = s.node_id,
      vendor = meta.vendor or 'simulated', model = meta.model or 'unknown', whole = s.whole,
      share = share, memory_mib = s.memory_mib, granted_capacity_s = granted_s,
      used_capacity_s = used_s, granted_memory_mib_s = granted_mem, used_memory_mib_s = used_mem})
  end
  local body = cjson.encode({lease_id = lease_id, job_id = l.job_id or '', tenant = l.tenant or '',
    queue = l.queue or '', granted_ms = granted, ended_ms = now, end_reason = reason,
    duration_s = dur_s})
  -- cjson writes an empty table as {}: a host-only lease's slices must still read as a list.
  local sj = #slices > 0 and cjson.encode(slices) or '[]'
  redis.call('HSET', k('usage-rec'), lease_id, '{"slices":' .. sj .. ',' .. string.sub(body, 2))
  redis.call('ZADD', k('usage-ended'), now, lease_id)
end

-- Ends one lease: gives every slice, host share and quota unit back, records why, and queues the
-- terminal event in ``outbox`` (the lease-manager's unless the caller publishes it itself:
-- 'direct', see outbox.py). Idempotent: an ended lease stays ended. Returns the outcome and, when
-- it ended the lease now, the entry id.
local function end_lease(lease_id, reason, detail, now, outbox)
  local lk = k('lease', lease_id)
  local f = redis.call('HMGET', lk, 'state', 'slices', 'host', 'usage', 'job_id', 'tenant',
    'queue', 'granted_ms', 'load_base', 'traceparent', 'tracestate')
  if not f[1] then return 'unknown' end
  if f[1] == 'ended' then return 'already_ended' end
  local l = {host = f[3], usage = f[4], job_id = f[5], tenant = f[6], queue = f[7],
    granted_ms = f[8], load_base = f[9]}
  local slices = cjson.decode(f[2] or '[]')
  write_usage(lease_id, reason, now, l, slices)
  -- Counters are read and set in one HSET per record (one AOF entry, not one per field); a
  -- device or node no longer registered has none to give back to.
  for _, s in ipairs(slices) do
    local dk = k('dev', s.device_id)
    local c = redis.call('HMGET', dk, 'mem_free', 'compute_free', 'holders')
    if c[1] then
      local fields = {'mem_free', tonumber(c[1]) + math.floor(s.memory_mib),
        'compute_free', tonumber(c[2] or '0') + math.floor(s.compute_pct),
        'holders', tonumber(c[3] or '0') - 1}
      if s.whole then fields[7], fields[8] = 'exclusive', 0 end
      redis.call('HSET', dk, unpack(fields))
    end
    touched('dev', s.device_id)
    redis.call('SREM', k('dev-leases', s.device_id), lease_id)
    -- take_reservation indexed the lease under its slices' nodes too, not only under those it
    -- charges host resources on (a request without host CPU or memory has none): left there,
    -- every lease a node ever ran would stay listed, for reap_nodes.lua to walk all at once.
    if s.node_id then redis.call('SREM', k('node-leases', s.node_id), lease_id) end
  end
  for node_id, h in pairs(cjson.decode(l.host)) do
    local nk = k('node', node_id)
    local c = redis.call('HMGET', nk, 'cpu_free', 'mem_free')
    if c[1] or c[2] then
      redis.call('HSET', nk, 'cpu_free', tonumber(c[1] or '0') + math.floor(h.cpu_milli),
        'mem_free', tonumber(c[2] or '0') + math.floor(h.memory_mib))
    end
    touched('node', node_id)
    redis.call('SREM', k('node-leases', node_id), lease_id)
  end
  for _, u in ipairs(cjson.decode(l.usage)) do
    redis.call('HINCRBYFLOAT', k('usage', u.scope), u.field, 0 - tonumber(u.inc))
  end
  redis.call('ZREM', k('expiry'), lease_id)
  redis.call('ZREM', k('idle-watch'), lease_id)
  redis.call('ZREM', k('deadlines'), lease_id)
  redis.call('SREM', k('leases'), lease_id)
  redis.call('SREM', k('tenant-leases', l.tenant), lease_id)
  redis.call('HSET', lk, 'state', 'ended', 'end_reason', reason, 'end_detail', detail or '',
    'ended_ms', now)
  redis.call('EXPIRE', lk, retain_s('lease'))
  redis.call('HSET', k('job', l.job_id), 'state', 'ended')
  job_over(l.job_id)
  local entry = traced_event(outbox or 'lease-manager', lease_id, 'ended', {f[10], f[11]})
  bump()
  touched('lease', lease_id)
  return 'ended', entry
end
