-- Record that a node's collector is alive, on the ledger's clock, with the live load it sampled
-- in the same tick (record_samples), so that a collector's tick is one script and one fsync of
-- the AOF instead of two. A node already declared lost must register again (its devices were
-- reset), so it is told so instead of silently revived, and its samples are not written.
-- A collector process other than the one that registered the node last is refused
-- (node_claimed, naming the holder) and writes nothing: two collectors under one node id would
-- keep each other's node alive and write each other's load.
-- ARGV[1]: node_id; ARGV[2]: the collector's instance ('' = not checked); then device_id, util
-- ('' = unknown), mem_used ('' = unknown), repeated.

-- One device's sample: its integrals carried forward to ``now`` and the new values stored
-- (``last``: its SAMPLED_FIELDS as they stood; a changed utilisation goes into the change log), in
-- one HSET: each command a script writes is its own entry in the AOF, key name and all.
local function record_sample(dk, device_id, util, mem_used, last, now)
  local util_int, mem_int = integrals_of(last, now)
  local fields = {'util_int', util_int, 'mem_int', mem_int, 'load_ms', now}
  if util ~= '' then
    if last[3] ~= util then
      fields[#fields + 1], fields[#fields + 2] = 'util', util
      touched_load('dev', device_id)
    end
    -- When it last did any work: what idle reclaim measures a lease's devices by.
    if tonumber(util) > 0 then fields[#fields + 1], fields[#fields + 2] = 'active_ms', now end
  end
  if mem_used ~= '' and last[4] ~= mem_used then
    fields[#fields + 1], fields[#fields + 2] = 'mem_used', mem_used
  end
  redis.call('HSET', dk, unpack(fields))
end
-- A sampled value as it is stored: '' (unknown) for anything but a finite number of at least
-- zero. A tool's NaN or infinity would stay in the device's integrals for ever, and a grant on it
-- could no longer encode its load baseline.
local function sampled(value)
  local n = tonumber(value)
  if not n or n ~= n or n < 0 or n == math.huge then return '' end
  return value
end
-- Whether a device was idle and stays so: its stored value (false, as HMGET gives a missing
-- field: never sampled) and the new sample's ('' = unknown, which keeps the stored value) are
-- the same zero. Held any length of time, a zero adds nothing to an integral, so such a sample
-- needs no write at all: an idle pool's ticks write only their heartbeats to the AOF.
local function still_idle(stored, sampled)
  if sampled == '' then return not stored or tonumber(stored) == 0 end
  return stored == sampled and tonumber(sampled) == 0
end
-- Live load for the node's devices from ``args`` (device_id, util ('' = unknown), mem_used ('' =
-- unknown), repeated, from index ``first``): last value wins and the version is not bumped; a
-- device whose utilisation changed goes into the change log, since placement reads it. Each
-- device also keeps the running integrals of its load (util_int in %·s, mem_int in MiB·s; see
-- load_integrals): usage accounting reads a lease's used capacity from their values at its grant
-- and end instead of scanning samples. A sample of a device that is not the node's in the ledger
-- (another node's, or one sampled before the node registers it again) is not written: it would
-- leave a hash with load and no spec, kept for ever, or move another node's load.
local SAMPLED_FIELDS = {'util_int', 'mem_int', 'util', 'mem_used', 'load_ms', 'node'}
local function record_samples(node_id, args, first, now)
  for i = first, #args, 3 do
    local dk = k('dev', args[i])
    local last = redis.call('HMGET', dk, unpack(SAMPLED_FIELDS))
    local util, mem_used = sampled(args[i + 1]), sampled(args[i + 2])
    if last[6] == node_id and not (still_idle(last[3], util) and still_idle(last[4], mem_used)) then
      record_sample(dk, args[i], util, mem_used, last, now)
    end
  end
end

local nk = k('node', ARGV[1])
local status, holder = unpack(redis.call('HMGET', nk, 'status', 'instance'))
if not status then return fail('unknown_node', ARGV[1]) end
if status ~= 'up' then return fail('node_' .. status, ARGV[1]) end
if ARGV[2] ~= '' and holder and holder ~= '' and holder ~= ARGV[2] then
  return fail('node_claimed', holder)
end
local now = now_ms()
record_samples(ARGV[1], ARGV, 3, now)
redis.call('HSET', nk, 'last_seen_ms', now)
-- The heartbeat index reap_nodes.lua reads: it looks at the overdue nodes only.
redis.call('ZADD', k('node-seen'), now, ARGV[1])
return cjson.encode({ok = true})
