"""The autoscaler's own state in the ledger's Redis: the leader lease, the journal, pool nodes.

Every key lives under the ledger's prefix (``{<namespace>}:autoscaler:...``, one hash slot):

- ``autoscaler:leader`` (string, with a TTL): the replica that acts now; ``autoscaler:term``
  (counter): the fencing token, incremented each time the lease changes hands (or lapses and is
  taken again). :meth:`AutoscalerState.hold` takes or extends the lease and answers the term;
- ``autoscaler:journal`` (hash, decision id -> :class:`JournalEntry`): every step the leader
  decided and has not finished. A step is written here **before** it is carried out, so a
  replica that takes over replays it with the same decision id (the provider request id):
  in-flight provisioning resumes, never doubles. A scale-up stays until its nodes are ready;
- ``autoscaler:nodes`` (hash, node id -> :class:`PoolNodeRecord`): what the autoscaler knows of
  each pool node (its request, when it was asked for and became ready, since when it is idle or
  draining);
- ``autoscaler:busy:<pool>`` and ``autoscaler:demand:<pool>`` (hashes, bucket start -> peak):
  busy nodes (for the scale-down watermark) and devices in use plus pending (for the forecast);
- ``autoscaler:status`` (string): the leader's last :class:`~xpupool.autoscaler.status
  .ScaleStatus`, read by ``xpupool scale status``.

Every write is **fenced**: one Lua script checks that the caller still holds the lease with the
term it acts under before it writes anything, so a replica that lost the lease (paused, cut off)
cannot overwrite its successor's state. Nothing here is in ``libs/ledger``'s scripts: these keys
are the autoscaler's alone.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Final

import msgspec
from redis.asyncio import Redis

from xpupool.contracts import ScaleDecision
from xpupool.ledger.ledger import AUTOSCALER_INCOMING, AUTOSCALER_SHAPES

__all__ = [
    "AutoscalerState",
    "JournalEntry",
    "LostLeadership",
    "PoolNodeRecord",
]

_LEADER_LUA: Final = """
-- Take or extend the autoscaler's leader lease. KEYS[1]: prefix; ARGV: owner, ttl_ms.
-- Answers the term (fencing token): the same while the owner keeps the lease, a new one when
-- the lease is taken (it was free or had lapsed).
local lk, tk = KEYS[1] .. 'autoscaler:leader', KEYS[1] .. 'autoscaler:term'
local holder = redis.call('GET', lk)
if holder == ARGV[1] then
  redis.call('PEXPIRE', lk, tonumber(ARGV[2]))
  return cjson.encode({ok = true, term = tonumber(redis.call('GET', tk) or '0'), new = false})
end
if holder then return cjson.encode({ok = false, holder = holder}) end
redis.call('SET', lk, ARGV[1], 'PX', tonumber(ARGV[2]))
return cjson.encode({ok = true, term = redis.call('INCR', tk), new = true})
"""

_RESIGN_LUA: Final = """
-- Give the lease back if this owner still holds it. KEYS[1]: prefix; ARGV: owner.
local lk = KEYS[1] .. 'autoscaler:leader'
if redis.call('GET', lk) == ARGV[1] then redis.call('DEL', lk) end
return 1
"""

_FENCED_LUA: Final = """
-- Apply writes only if the caller holds the lease under the term it acts with.
-- KEYS[1]: prefix; ARGV: owner, term, a JSON list of [op, key, args...].
local P = KEYS[1] .. 'autoscaler:'
if redis.call('GET', P .. 'leader') ~= ARGV[1]
   or tonumber(redis.call('GET', P .. 'term') or '0') ~= tonumber(ARGV[2]) then
  return 0
end
for _, op in ipairs(cjson.decode(ARGV[3])) do
  local name, key = op[1], P .. op[2]
  if name == 'HSET' then redis.call('HSET', key, op[3], op[4])
  elseif name == 'HDEL' then redis.call('HDEL', key, op[3])
  elseif name == 'HMAX' then
    local old = tonumber(redis.call('HGET', key, op[3]) or '-1')
    if tonumber(op[4]) > old then redis.call('HSET', key, op[3], op[4]) end
  elseif name == 'SET' then redis.call('SET', key, op[3])
  elseif name == 'DEL' then redis.call('DEL', key)
  else return redis.error_reply('unknown op ' .. tostring(name)) end
end
return 1
"""

JOURNAL: Final = "journal"
NODES: Final = "nodes"
STATUS: Final = "status"
INCOMING: Final = AUTOSCALER_INCOMING
"""Job id -> until when (epoch s) an in-flight scale-up is for it (``Ledger.incoming_jobs``)."""
SHAPES: Final = AUTOSCALER_SHAPES
"""The pools' node shapes (``list[PoolShape]``), read by the scheduler (``Ledger.pool_shapes``)."""


class LostLeadership(RuntimeError):
    """A fenced write was refused: another replica holds the lease (or the term moved on)."""


class JournalEntry(msgspec.Struct, kw_only=True):
    """One decided step not finished yet, as the leader wrote it before carrying it out.

    ``decision`` is the published event (re-published on a replay: JetStream drops the
    duplicate); its ``request_id`` is the provider's idempotency key. ``node_ids`` are, for a
    scale-up, the nodes the provider named for it so far. ``applied``: the provider (or the
    drain) accepted it at least once; ``attempts`` counts failed tries."""

    decision: ScaleDecision
    term: int
    started_at: float
    node_ids: list[str] = msgspec.field(default_factory=list)
    lease_ids: list[str] = msgspec.field(default_factory=list)
    grace_s: float = 0.0
    expected_ready_at: float | None = None
    applied: bool = False
    attempts: int = 0
    last_error: str = ""

    @property
    def decision_id(self) -> str:
        return self.decision.decision_id

    @property
    def request_id(self) -> str:
        return self.decision.request_id or self.decision.decision_id


class PoolNodeRecord(msgspec.Struct, kw_only=True):
    """What the autoscaler knows of one pool node (epoch seconds on the ledger's clock)."""

    node_id: str
    pool: str
    request_id: str | None = None
    requested_at: float | None = None
    ready_at: float | None = None
    idle_since: float | None = None
    draining_since: float | None = None
    drain_decision: str | None = None
    preempt_requested: bool = False


_ENTRY = msgspec.json.Decoder(JournalEntry)
_NODE = msgspec.json.Decoder(PoolNodeRecord)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class AutoscalerState:
    """Typed, fenced access to the autoscaler's keys (see the module docstring)."""

    def __init__(self, redis: Redis, prefix: str, owner: str) -> None:
        self.redis = redis
        self.prefix = prefix
        self.owner = owner
        self._leader = redis.register_script(_LEADER_LUA)
        self._resign = redis.register_script(_RESIGN_LUA)
        self._fenced = redis.register_script(_FENCED_LUA)

    def key(self, name: str) -> str:
        return f"{self.prefix}autoscaler:{name}"

    # ---- the leader lease -------------------------------------------------------------------

    async def hold(self, ttl_ms: int) -> int | None:
        """Take or extend the lease; the term this replica acts under, or None (another holds
        it)."""
        raw = await self._leader(keys=[self.prefix], args=[self.owner, ttl_ms])
        answer = json.loads(_text(raw))
        return int(answer["term"]) if answer.get("ok") else None

    async def resign(self) -> None:
        """Give the lease back (a clean shutdown: a successor need not wait for the TTL)."""
        await self._resign(keys=[self.prefix], args=[self.owner])

    async def leader(self) -> tuple[str | None, int]:
        """Who holds the lease now (None: nobody) and the current term."""
        holder, term = await self.redis.mget([self.key("leader"), self.key("term")])
        return (_text(holder) if holder is not None else None), int(_text(term or b"0"))

    # ---- fenced writes ----------------------------------------------------------------------

    async def write(self, term: int, ops: Sequence[Sequence[str | int | float]]) -> None:
        """Apply ``ops`` (``[op, key, args...]``: HSET, HDEL, HMAX, SET, DEL on keys relative to
        ``autoscaler:``) atomically if this replica still leads under ``term``; raise
        :class:`LostLeadership` otherwise."""
        if not ops:
            return
        done = await self._fenced(
            keys=[self.prefix], args=[self.owner, term, json.dumps([list(o) for o in ops])]
        )
        if int(done) != 1:
            raise LostLeadership(f"{self.owner} no longer leads under term {term}")

    async def put_entry(self, term: int, entry: JournalEntry) -> None:
        await self.write(term, [self.op_entry(entry)])

    def op_entry(self, entry: JournalEntry) -> list[str | int | float]:
        return ["HSET", JOURNAL, entry.decision_id, msgspec.json.encode(entry).decode()]

    @staticmethod
    def op_drop_entry(decision_id: str) -> list[str | int | float]:
        return ["HDEL", JOURNAL, decision_id]

    @staticmethod
    def op_node(record: PoolNodeRecord) -> list[str | int | float]:
        return ["HSET", NODES, record.node_id, msgspec.json.encode(record).decode()]

    @staticmethod
    def op_drop_node(node_id: str) -> list[str | int | float]:
        return ["HDEL", NODES, node_id]

    # ---- reads ------------------------------------------------------------------------------

    async def journal(self) -> dict[str, JournalEntry]:
        """Every unfinished step, by decision id (a record that does not decode is skipped)."""
        rows = await self.redis.hgetall(self.key(JOURNAL))
        out: dict[str, JournalEntry] = {}
        for field, value in rows.items():
            try:
                out[_text(field)] = _ENTRY.decode(value)
            except msgspec.DecodeError:
                continue
        return out

    async def nodes(self) -> dict[str, PoolNodeRecord]:
        """Every pool node the autoscaler knows, by node id."""
        rows = await self.redis.hgetall(self.key(NODES))
        out: dict[str, PoolNodeRecord] = {}
        for field, value in rows.items():
            try:
                out[_text(field)] = _NODE.decode(value)
            except msgspec.DecodeError:
                continue
        return out

    async def series(self, name: str) -> list[tuple[float, float]]:
        """One history hash (``busy:<pool>``, ``demand:<pool>``) as sorted ``(at, value)``."""
        rows: Mapping[Any, Any] = await self.redis.hgetall(self.key(name))
        return sorted((float(_text(k)), float(_text(v))) for k, v in rows.items())

    async def status_json(self) -> bytes | None:
        """The last status the leader wrote, as JSON."""
        raw = await self.redis.get(self.key(STATUS))
        return None if raw is None else (raw if isinstance(raw, bytes) else raw.encode())
