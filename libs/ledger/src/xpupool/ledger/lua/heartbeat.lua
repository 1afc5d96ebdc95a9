-- Record that a node's collector is alive, on the ledger's clock, with the live load it sampled
-- in the same tick (record_samples), so that a collector's tick is one script and one fsync of
-- the AOF instead of two. A node already declared lost must register again (its devices were
-- reset), so it is told so instead of silently revived, and its samples are not written.
-- ARGV[1]: node_id; then device_id, util ('' = unknown), mem_used ('' = unknown), repeated.
local nk = k('node', ARGV[1])
local status = redis.call('HGET', nk, 'status')
if not status then return fail('unknown_node', ARGV[1]) end
if status ~= 'up' then return fail('node_' .. status, ARGV[1]) end
local now = now_ms()
record_samples(ARGV, 2, now)
redis.call('HSET', nk, 'last_seen_ms', now)
-- The heartbeat index reap_nodes.lua reads: it looks at the overdue nodes only.
redis.call('ZADD', k('node-seen'), now, ARGV[1])
return cjson.encode({ok = true})
