-- How many of the named leases are in each state (``Ledger.lease_states`` sends the live lease
-- set a chunk at a time). Writes nothing. ARGV: lease ids. Returns {state, count, ...}.
local counts = {}
for _, lease_id in ipairs(ARGV) do
  local state = redis.call('HGET', k('lease', lease_id), 'state')
  if state then counts[state] = (counts[state] or 0) + 1 end
end
local out = {}
for state, n in pairs(counts) do
  out[#out + 1] = state
  out[#out + 1] = n
end
return out
