-- Shared by every ledger script (prepended at load time). KEYS[1] is the key prefix, a Redis
-- Cluster hash tag such as "{xpupool}:", so every key of one ledger lives in one slot.
local P = KEYS[1]
local function k(...) return P .. table.concat({...}, ':') end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function fail(reason, detail)
  return cjson.encode({ok = false, reason = reason, detail = detail or ''})
end
-- Lua 5.1 turns -0 into the string "-0", which HINCRBY refuses mid-script (after earlier
-- writes): always negate through this.
local function neg(x) return 0 - math.floor(tonumber(x)) end
local function bump() redis.call('INCR', k('ver')) end
local RETAIN_S = 7 * 24 * 3600

-- Ends one lease: gives every slice, host share and quota unit back, records why, and queues the
-- terminal event in the lease-manager's outbox. Idempotent: an ended lease stays ended.
local function end_lease(lease_id, reason, detail, now)
  local lk = k('lease', lease_id)
  local l = redis.call('HMGET', lk, 'state', 'slices', 'host', 'usage', 'job_id', 'queue')
  if not l[1] then return 'unknown' end
  if l[1] == 'ended' then return 'already_ended' end
  for _, s in ipairs(cjson.decode(l[2])) do
    local dk = k('dev', s.device_id)
    if redis.call('EXISTS', dk) == 1 then
      redis.call('HINCRBY', dk, 'mem_free', s.memory_mib)
      redis.call('HINCRBY', dk, 'compute_free', s.compute_pct)
      redis.call('HINCRBY', dk, 'holders', -1)
      if s.whole then redis.call('HSET', dk, 'exclusive', 0) end
    end
    redis.call('SREM', k('dev-leases', s.device_id), lease_id)
  end
  for node_id, h in pairs(cjson.decode(l[3])) do
    local nk = k('node', node_id)
    if redis.call('EXISTS', nk) == 1 then
      redis.call('HINCRBY', nk, 'cpu_free', h.cpu_milli)
      redis.call('HINCRBY', nk, 'mem_free', h.memory_mib)
    end
    redis.call('SREM', k('node-leases', node_id), lease_id)
  end
  for _, u in ipairs(cjson.decode(l[4])) do
    redis.call('HINCRBYFLOAT', k('usage', u.scope), u.field, 0 - tonumber(u.inc))
  end
  redis.call('ZREM', k('expiry'), lease_id)
  redis.call('SREM', k('leases'), lease_id)
  redis.call('HSET', lk, 'state', 'ended', 'end_reason', reason, 'end_detail', detail or '',
    'ended_ms', now)
  redis.call('EXPIRE', lk, RETAIN_S)
  redis.call('HSET', k('job', l[5]), 'state', 'ended')
  redis.call('XADD', k('outbox', 'lease-manager'), '*', 'kind', 'ended', 'lease_id', lease_id)
  bump()
  return 'ended'
end
