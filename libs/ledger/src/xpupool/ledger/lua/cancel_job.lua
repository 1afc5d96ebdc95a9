-- Cancel a job for its tenant, in one step. A waiting job leaves the pending queue and its
-- terminal JobCancelled goes to the scheduler's outbox; a reserved or granted job's lease is
-- marked and an EndLease (reason released) goes to the outbox, as a preemption's does. A job of
-- another tenant is unknown_job (its existence is not revealed); an ended one is job_ended.
-- ARGV: job_id, tenant
local jk = k('job', ARGV[1])
local j = redis.call('HMGET', jk, 'state', 'tenant', 'lease_id', 'since_ms')
if not j[1] or j[2] ~= ARGV[2] then return fail('unknown_job', ARGV[1]) end
if j[1] == 'pending' then
  local request = unpend(ARGV[1])
  local now = now_ms()
  redis.call('HSET', jk, 'state', 'cancelled', 'ended_ms', now)
  job_over(ARGV[1])
  redis.call('XADD', k('outbox', 'scheduler'), '*', 'kind', 'cancelled', 'job_id', ARGV[1],
    'waited_ms', now - tonumber(j[4] or now), 'request', request or '{}')
  return cjson.encode({ok = true, outcome = 'cancelled'})
end
if j[1] == 'reserved' or j[1] == 'leased' then
  local lk = k('lease', j[3])
  if redis.call('HGET', lk, 'state') == 'ended' then
    return fail('job_ended', job_outcome(ARGV[1]) or 'its lease ended')
  end
  if redis.call('HSETNX', lk, 'cancel_requested', 1) == 0 then
    return cjson.encode({ok = true, outcome = 'releasing', duplicate = true, lease_id = j[3]})
  end
  redis.call('XADD', k('outbox', 'scheduler'), '*', 'kind', 'end_lease', 'lease_id', j[3],
    'job_id', ARGV[1], 'reason', 'released', 'detail', 'cancelled by its tenant')
  return cjson.encode({ok = true, outcome = 'releasing', lease_id = j[3]})
end
return fail('job_ended', job_outcome(ARGV[1]) or j[1])
