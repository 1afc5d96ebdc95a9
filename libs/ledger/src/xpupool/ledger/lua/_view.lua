-- Included by the scripts that name the ledger's view as a change-log reader holds it
-- (`-- include: _view`): read_changes.lua answers it, pend.lua checks a kept copy against it.
-- The redis-server process: a restarted or failed-over server may have rewound the log.
local function server_run_id()
  return string.match(redis.call('INFO', 'server'), 'run_id:(%w+)') or ''
end
-- Epoch, sequence and server, '|'-separated (Ledger's ChangeCursor.view): equal to a reader's
-- cursor, nothing it has not read changed since.
local function change_view()
  return (redis.call('GET', k('changes-epoch')) or '') .. '|'
    .. (redis.call('GET', k('changes-seq')) or '0') .. '|' .. server_run_id()
end
