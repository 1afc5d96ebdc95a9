-- include: _reservation
-- include: _view
-- Park a request that cannot be placed now in the persistent pending queue (idempotent).
-- ARGV: job_id, priority (higher goes first), request JSON, max_wait_ms ('' = none), reason,
-- detail, tenant, rate_per_s (<= 0: unlimited), burst, max_pending (< 0: unlimited),
-- traceparent, tracestate ('' = none): the job's trace, which every later step continues;
-- placement ('' = none): a reservation as reserve.lua takes it, with its secret, for a job the
-- scheduler found room for on arrival. Such a grant is announced through the direct outbox: the
-- scheduler publishes it at once from what this script answers (the lease's record and the
-- entry's id) and then deletes the entry; the lease-manager's relay publishes only what a
-- scheduler left there (outbox.py);
-- view ('' = none): the ledger view the placement was decided on (view_current), when the
-- scheduler decided on its kept copy without reading the log first: after any change since but
-- live load, the placement might not be the one a fresh read would give, so the request is
-- refused before anything is written (view_changed) and the scheduler decides it again on a
-- read. (Live load moves every few seconds on every busy device; a decision is as good on a
-- sample a few milliseconds older, and capacity is checked here anyway.)
-- caller_follows_feed ('1' = yes): the scheduler follows the change feed and counts this
-- admission's change as its own (SnapshotCache.own_change), so, when it is the feed's only
-- subscriber, the grant is not announced there (quiet_if_only_reader in _prelude.lua).
-- source ('' = none): the stream message the request came in (<stream>:<sequence>), kept with
-- the job: that very message delivered again after the job ended (its acknowledgement lost) is
-- answered job_redelivered, nothing to publish, where a resubmission gets duplicate_job.
-- The score orders by priority, then arrival in seconds (both exact in a double).
-- A new request of a tenant over its rate (a token bucket kept as its theoretical arrival time,
-- GCRA) or at its maximum of pending requests is refused before anything is written. Another
-- request under a used job id (or another tenant's job id) is refused with duplicate_job, saying
-- where that job stands or how it ended; the same request again is a retry: ignored while the
-- job waits, answered 'job_<state>' (with how it ended, once over) and nothing to publish (its
-- one outcome is on its way or out).
local jk = k('job', ARGV[1])
local state, owner, source, digest = unpack(redis.call('HMGET', jk, 'state', 'tenant', 'source',
  'digest'))
if state and owner and owner ~= ARGV[7] then
  -- Job ids are global: another tenant's id is refused without a word about that job.
  return fail('duplicate_job', 'this job id is taken; submit with a new one')
end
-- The request's fingerprint, kept with the job: a resubmission of the same request (a retry) is
-- told apart from another request under a used job id.
local request_digest = string.sub(redis.sha1hex(ARGV[3]), 1, 16)
-- How the job ended (nil while it waits or runs: a waiting job is never over).
local ended = state and state ~= 'pending' and job_outcome(ARGV[1]) or nil
if state and digest and digest ~= request_digest and not ended then
  -- Another request under the id of a job that waits or runs: the job goes on as first asked;
  -- the newcomer is refused, never dropped without a word. (A record from before fingerprints
  -- has none to compare: its duplicates are taken for retries, as they were.)
  return fail('duplicate_job', 'job ' .. ARGV[1] .. ' is ' .. state ..
    ' with another request; submit with a new job id')
end
if state and state ~= 'pending' then
  if ended and (ARGV[16] or '') ~= '' and source == ARGV[16] then
    -- The very message that admitted the job, delivered again (its acknowledgement was lost):
    -- the job's outcome is out; a duplicate_job rejection now would be a second one.
    return cjson.encode({ok = false, reason = 'job_redelivered'})
  end
  if ended and digest ~= request_digest then
    return fail('duplicate_job', 'job ' .. ARGV[1] .. ' already ended: ' .. ended)
  end
  -- Reserved or leased: the first submission's outcome is on its way (or out). Over, and this is
  -- the same request again (a retry whose first try's outcome its sender may have missed): its
  -- one outcome is out; a second (a duplicate_job rejection) would tell a subscriber the job
  -- both ran and was refused. Answered with where the job stands and how it ended.
  return cjson.encode({ok = false, reason = 'job_' .. state, detail = ended or ''})
end
if state == 'pending' then
  -- A duplicate of a waiting job: the first admission stands, its recorded reason too.
  return cjson.encode({ok = true, duplicate = true})
end
local now = now_ms()
local tenant, rate, burst, max_pending = ARGV[7], tonumber(ARGV[8]), tonumber(ARGV[9]),
  tonumber(ARGV[10])
local placement = nil
if (ARGV[13] or '') ~= '' then
  placement = cjson.decode(ARGV[13])
  if placement.job_id ~= ARGV[1] or placement.tenant ~= tenant then
    return fail('placement_mismatch', 'the placement is for another job or tenant')
  end
  if (ARGV[14] or '') ~= '' and not view_current(ARGV[14]) then
    return fail('view_changed', 'the ledger changed since the view the placement was decided on')
  end
  quiet_if_only_reader(ARGV[15] == '1')
end
local waiting = tonumber(redis.call('HGET', k('pending-count'), tenant) or '0')
if max_pending >= 0 and waiting >= max_pending then
  return fail('too_many_pending', waiting .. ' pending, limit ' .. max_pending)
end
if rate > 0 then
  local interval = 1000 / rate
  local rk = k('rate', tenant)
  local tat = math.max(tonumber(redis.call('GET', rk) or '0'), now) + interval
  if tat - now > interval * math.max(burst, 1) then
    return fail('rate_limited', string.format('over %g requests/s (burst %d)', rate, burst))
  end
  redis.call('SET', rk, string.format('%d', math.ceil(tat)), 'PX', math.ceil(tat - now) + 1000)
end
local since = now
local job = {'state', 'pending', 'since_ms', since, 'reason', ARGV[5], 'detail', ARGV[6],
  'tenant', tenant, 'digest', request_digest}
if (ARGV[16] or '') ~= '' then job[#job + 1], job[#job + 2] = 'source', ARGV[16] end
local trace = false
if (ARGV[11] or '') ~= '' then
  trace = {ARGV[11], ARGV[12] or ''}
  for _, v in ipairs({'traceparent', trace[1], 'tracestate', trace[2]}) do job[#job + 1] = v end
end
-- The tenant's jobs, newest last, for its queries: those submitted within the job retention,
-- at most 1,000. The index outlives its newest entry's retention: its expiry is set to twice the
-- retention once less than one is left, not at every admission (an EXPIRE is an AOF write).
local tk, job_retain_s = k('tenant-jobs', tenant), retain_s('job')
redis.call('ZADD', tk, since, ARGV[1])
redis.call('ZREMRANGEBYSCORE', tk, '-inf', since - job_retain_s * 1000)
redis.call('ZREMRANGEBYRANK', tk, 0, -1001)
if redis.call('TTL', tk) < job_retain_s then redis.call('EXPIRE', tk, 2 * job_retain_s) end
-- Placed on admission: the job is granted here, in the same atomic step, when the scheduler
-- found room for it and no other job waits (one placed ahead of the queue would overtake those).
-- A placement the ledger refuses (decided on a view that is stale by now) is not an error: the
-- job waits like any other and a scheduling cycle decides it again.
-- Why a placement was not taken is answered with the job's admission (``reason``).
local not_placed = ''
if placement then
  if redis.call('ZCARD', k('pending')) > 0 then
    not_placed = 'jobs_waiting'
  else
    -- Granted, the job's record is written by take_reservation, with its lease.
    local taken, refusal = take_reservation(placement, 'direct', {trace = trace, record = job})
    if taken then
      return announced({outcome = 'granted', token = taken.token, since_ms = since,
        now_ms = now, change_seq = change_seq}, placement.lease_id, taken.entry)
    end
    not_placed = cjson.decode(refusal).reason
  end
end
-- A live job's record does not expire (job_over sets its retention once it is over).
redis.call('HSET', jk, unpack(job))
redis.call('ZADD', k('pending'), 'NX', -tonumber(ARGV[2]) * 1e10 + since / 1000, ARGV[1])
redis.call('HINCRBY', k('pending-count'), tenant, 1)
redis.call('SET', k('pending-req', ARGV[1]), ARGV[3])
if ARGV[4] ~= '' then
  redis.call('ZADD', k('pending-deadline'), 'NX', since + tonumber(ARGV[4]), ARGV[1])
end
return cjson.encode({ok = true, outcome = 'pending', reason = not_placed, since_ms = since,
  now_ms = now})
