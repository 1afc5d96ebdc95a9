-- End every pending request whose max_wait has passed; their terminal events go out through the
-- scheduler's outbox. ARGV[1]: the most to end in one call
local now = now_ms()
local due = redis.call('ZRANGEBYSCORE', k('pending-deadline'), '-inf', now, 'LIMIT', 0,
  tonumber(ARGV[1]))
local ended = {}
for _, job_id in ipairs(due) do
  redis.call('ZREM', k('pending-deadline'), job_id)
  local jk = k('job', job_id)
  if redis.call('HGET', jk, 'state') == 'pending' then
    local request = unpend(job_id)
    redis.call('HSET', jk, 'state', 'timed_out')
    job_over(job_id)
    local since = tonumber(redis.call('HGET', jk, 'since_ms'))
    redis.call('XADD', k('outbox', 'scheduler'), '*', 'kind', 'timed_out', 'job_id', job_id,
      'waited_ms', now - since, 'request', request or '{}')
    table.insert(ended, job_id)
  end
end
return cjson.encode({ok = true, ended = ended})
