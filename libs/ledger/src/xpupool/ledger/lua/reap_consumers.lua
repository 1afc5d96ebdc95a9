-- Delete the consumers of an outbox's relay group that hold no entry and have had none delivered
-- for ARGV[3] ms, but the caller's own (ARGV[2]): a relay names itself anew each time its process
-- starts, so without this a group keeps one consumer per restart, for ever. Checked and deleted in
-- one step because XGROUP DELCONSUMER drops the consumer's pending entries with it, and an entry
-- dropped so is never delivered again; a relay deleted while idle is made again by its next read.
-- Writes only when it deletes. ARGV: the outbox's service, the caller's consumer name, the idle
-- time in ms, the group. Returns the names deleted ({} when the group is not there yet).
local stream = k('outbox', ARGV[1])
local consumers = redis.pcall('XINFO', 'CONSUMERS', stream, ARGV[4])
if consumers.err then return {} end
local min_idle, deleted = tonumber(ARGV[3]), {}
for _, consumer in ipairs(consumers) do
  local info = {}
  for i = 1, #consumer, 2 do info[consumer[i]] = consumer[i + 1] end
  if info.name ~= ARGV[2] and info.pending == 0 and info.idle >= min_idle then
    redis.call('XGROUP', 'DELCONSUMER', stream, ARGV[4], info.name)
    deleted[#deleted + 1] = info.name
  end
end
return deleted
