-- include: _reservation
-- Reserve slices for a job: re-checks device health, capacity, host resources and quota, then
-- writes them all at once. Two schedulers racing for the last slice cannot both win.
-- ARGV[1]: JSON {job_id, lease_id, tenant, queue, priority, owner, ttl_ms, hold_ms,
--   slices=[{device_id, memory_mib, compute_pct, whole}], host={node_id={cpu_milli, memory_mib}},
--   usage=[{scope, field, inc, limit}], secret}   (limit < 0: unlimited)
-- With a secret the reservation is granted at once (activate, as grant.lua does): the lease is
-- active when the script returns and the lease-manager's outbox announces it; without one it
-- stays reserved, the scheduler's outbox announces that, and the lease-manager grants it.
-- A host-only reservation (count 0) has no slices and one host entry.
local r = cjson.decode(ARGV[1])
local jk = k('job', r.job_id)
local job = redis.call('HMGET', jk, 'state', 'lease_id')
if job[2] and job[2] ~= '' then
  return cjson.encode({ok = true, duplicate = true, lease_id = job[2]})
end
-- A job that ended while the cycle that placed it was deciding (timed out, cancelled by its
-- tenant, rejected by a peer replica) already has its terminal event queued: a grant now would
-- be a second outcome, and its slices would be held for a job nobody waits for. (Only pending
-- jobs are reserved; a job without a record is a caller's own, as in the ledger's tests.)
if job[1] and job[1] ~= 'pending' then return fail('job_finished', job[1]) end
local taken, refusal = take_reservation(r)
if not taken then return refusal end
return cjson.encode({ok = true, lease_id = r.lease_id, slices = taken.taken, token = taken.token})
