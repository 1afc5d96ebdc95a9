-- Drain a node (it takes no new grants; its leases run on) or take it back into service.
-- ARGV: node_id, '1' to drain or '0' to undrain, '1' to hold a node the ledger has not seen
-- (optional): the autoscaler gives back a node that never registered by its deadline, and one
-- that registers after all while it is being given back must take no grant, so the drain is
-- kept for it (node-held-drained, for a day) and register_node.lua drains it as it registers.
-- Without that flag (an operator's drain) an unknown node is refused, not remembered.
local nk, held = k('node', ARGV[1]), k('node-held-drained', ARGV[1])
if redis.call('EXISTS', nk) == 0 then
  if ARGV[3] ~= '1' then return fail('unknown_node', ARGV[1]) end
  local previous = redis.call('EXISTS', held) == 1 and 'draining' or 'in_service'
  if ARGV[2] == '1' then
    redis.call('SET', held, '1', 'EX', 86400)
  elseif previous == 'draining' then
    redis.call('DEL', held)
  end
  return cjson.encode({ok = true, previous = previous})
end
-- Registered: the node's own record says it from now on (an undrain lifts a held drain too).
if ARGV[2] == '0' and redis.call('EXISTS', held) == 1 then redis.call('DEL', held) end
local previous = redis.call('HGET', nk, 'draining') or '0'
if previous ~= ARGV[2] then
  redis.call('HSET', nk, 'draining', ARGV[2])
  bump()
  touched('node', ARGV[1])
end
return cjson.encode({ok = true, previous = previous == '1' and 'draining' or 'in_service'})
