-- Mark a lease as being preempted for a job and queue the EndLease command in the scheduler's
-- outbox, in one step: a scheduler that dies right after deciding cannot leave a victim marked
-- but never told. ARGV: lease_id, job_id, grace_ms (the holder's warning before the end)
local lk = k('lease', ARGV[1])
local state = redis.call('HGET', lk, 'state')
if not state or state == 'ended' then return fail('lease_gone', ARGV[1]) end
-- The job ended while the cycle that chose the victim was deciding (cancelled by its tenant,
-- timed out, rejected by a peer): the victim keeps its lease. (Only a pending job preempts; a
-- job without a record is a caller's own, as in the ledger's tests.)
local job_state = redis.call('HGET', k('job', ARGV[2]), 'state')
if job_state and job_state ~= 'pending' then return fail('job_finished', job_state) end
if redis.call('HGET', lk, 'preempted_for') == ARGV[2] then
  return cjson.encode({ok = true, duplicate = true})
end
redis.call('HSET', lk, 'preempted_for', ARGV[2])
redis.call('XADD', k('outbox', 'scheduler'), '*', 'kind', 'end_lease', 'lease_id', ARGV[1],
  'job_id', ARGV[2], 'grace_ms', ARGV[3] or '0')
bump()
touched('lease', ARGV[1])
return cjson.encode({ok = true})
