-- Record why a waiting job waits (for ``xpupool explain`` and its JobPending), only while it
-- waits: a cycle decides on a list read before a cancel, a timeout or a peer's rejection, and a
-- plain write would then put a wait on an ended job (a JobPending after its terminal event) or
-- make a record of a job whose own has expired, which nothing would ever remove.
-- ARGV: job_id, reason, detail, nominated ('' to leave it, '1' or '0')
local jk = k('job', ARGV[1])
if redis.call('HGET', jk, 'state') ~= 'pending' then
  return fail('not_pending', ARGV[1])
end
redis.call('HSET', jk, 'reason', ARGV[2], 'detail', ARGV[3])
if ARGV[4] ~= '' then redis.call('HSET', jk, 'nominated', ARGV[4]) end
return cjson.encode({ok = true})
