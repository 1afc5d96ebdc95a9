-- Included by the scripts that name the ledger's view as a change-log reader holds it
-- (`-- include: _view`): read_changes.lua answers it, pend.lua checks a kept copy against it.
-- The redis-server process: a restarted or failed-over server may have rewound the log.
local function server_run_id()
  return string.match(redis.call('INFO', 'server'), 'run_id:(%w+)') or ''
end
-- Whether a reader that read the log up to the view "epoch|seq|server" (Ledger's
-- ChangeCursor.view) has seen every change but live load: same log, same server, and no change
-- beyond live load logged after its sequence (capacity-seq; a ledger written before that key
-- existed counts every change).
local function view_current(view)
  local epoch, seq, server = string.match(view, '^(.*)|(%d+)|(.*)$')
  if not seq or epoch ~= (redis.call('GET', k('changes-epoch')) or '')
      or server ~= server_run_id() then
    return false
  end
  local last = redis.call('GET', k('capacity-seq')) or redis.call('GET', k('changes-seq')) or '0'
  return tonumber(last) <= tonumber(seq)
end
