-- Drain a node (it takes no new grants; its leases run on) or take it back into service.
-- ARGV: node_id, '1' to drain or '0' to undrain
local nk = k('node', ARGV[1])
if redis.call('EXISTS', nk) == 0 then return fail('unknown_node', ARGV[1]) end
local previous = redis.call('HGET', nk, 'draining') or '0'
if previous ~= ARGV[2] then
  redis.call('HSET', nk, 'draining', ARGV[2])
  bump()
  touched('node', ARGV[1])
end
return cjson.encode({ok = true, previous = previous == '1' and 'draining' or 'in_service'})
