-- The pending requests in score order (at most ARGV[1]), each with its request body and its
-- job's hash, in one step (a scheduling cycle's listing in one round trip, not a listing and then
-- a read of what it names): {job_id, body (false once gone), {field, value, ...}, ...}. Reads
-- only.
local listed = {}
for _, job_id in ipairs(redis.call('ZRANGE', k('pending'), 0, tonumber(ARGV[1]) - 1)) do
  listed[#listed + 1] = job_id
  listed[#listed + 1] = redis.call('GET', k('pending-req', job_id))
  listed[#listed + 1] = redis.call('HGETALL', k('job', job_id))
end
return listed
