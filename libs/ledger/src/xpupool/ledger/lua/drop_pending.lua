-- Take a request out of the pending queue for good (the scheduler rejected it) and queue its
-- terminal event in the scheduler's outbox, in one step. ARGV: job_id, reason, field, detail
local jk = k('job', ARGV[1])
if redis.call('HGET', jk, 'state') ~= 'pending' then
  return fail('not_pending', ARGV[1])
end
local request = unpend(ARGV[1])
redis.call('HSET', jk, 'state', 'rejected', 'reason', ARGV[2], 'detail', ARGV[4])
job_over(ARGV[1])
redis.call('XADD', k('outbox', 'scheduler'), '*', 'kind', 'rejected', 'job_id', ARGV[1],
  'reason', ARGV[2], 'field', ARGV[3], 'detail', ARGV[4], 'request', request or '{}')
return cjson.encode({ok = true})
