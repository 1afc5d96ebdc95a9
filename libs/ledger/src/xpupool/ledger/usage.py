"""Usage records in the ledger: the ones ``end_lease`` writes when a lease ends (usage-rec,
indexed by end time in usage-ended), the running leases' usage up to now, and retention."""

from __future__ import annotations

import math
from typing import Any

import msgspec

from xpupool.contracts import UsageRecord, UsageSlice
from xpupool.ledger.ledger import LeaseRecord, Ledger

_RECORD = msgspec.json.Decoder(UsageRecord)
_BASE = msgspec.json.Decoder(dict[str, tuple[float, float]])


#: A sample's value is held at most this long (LOAD_HOLD_MS in _prelude.lua).
LOAD_HOLD_MS = 60_000
_LOAD_FIELDS = ("util_int", "mem_int", "util", "mem_used", "load_ms")


def carried_load(fields: list[Any], now_ms: int) -> tuple[float, float]:
    """A device's (util_int, mem_int) carried forward to ``now_ms`` from its hash fields
    ``_LOAD_FIELDS``, as ``load_integrals`` in ``_prelude.lua`` does."""
    util_int, mem_int, util, mem_used, load_ms = (_finite(f) for f in fields)
    u, m = util_int or 0.0, mem_int or 0.0
    if load_ms is not None:
        dt = max(0.0, min(now_ms - load_ms, LOAD_HOLD_MS)) / 1000
        u += (util or 0.0) * dt
        m += (mem_used or 0.0) * dt
    return u, m


def _finite(field: Any) -> float | None:
    """A stored value as a number; a NaN or an infinity (a ledger written before samples were
    checked) counts as zero, as ``finite`` in ``_prelude.lua``."""
    if field is None:
        return None
    value = float(field)
    return value if math.isfinite(value) else 0.0


def running_usage(
    lease: LeaseRecord,
    base: dict[str, tuple[float, float]],
    loads: dict[str, tuple[float, float]],
    now_ms: int,
) -> UsageRecord:
    """A granted lease's usage up to ``now_ms``, figured as the ledger figures it at the end
    (see ``write_usage`` in ``_prelude.lua``): ``base`` and ``loads`` map each device to its
    (util_int, mem_int) integrals at the grant and now."""
    granted = lease.granted_ms or 0
    dur_s = max(0, now_ms - granted) / 1000 if granted else 0.0
    slices = []
    for s in lease.slices:
        share = 1.0 if s.whole else s.compute_pct / 100
        b_util, b_mem = base.get(s.device_id, (0.0, 0.0))
        c_util, c_mem = loads.get(s.device_id, (0.0, 0.0))
        granted_s, granted_mem = dur_s * share, dur_s * s.memory_mib
        slices.append(
            UsageSlice(
                device_id=s.device_id,
                node_id=s.node_id,
                vendor=s.meta.vendor if s.meta else "simulated",
                model=s.meta.model if s.meta else "unknown",
                whole=s.whole,
                share=share,
                memory_mib=s.memory_mib,
                granted_capacity_s=granted_s,
                used_capacity_s=min(granted_s, max(0.0, (c_util - b_util) / 100)),
                granted_memory_mib_s=granted_mem,
                used_memory_mib_s=min(granted_mem, max(0.0, c_mem - b_mem)),
            )
        )
    return UsageRecord(
        lease_id=lease.lease_id,
        job_id=lease.job_id,
        tenant=lease.tenant,
        queue=lease.queue,
        granted_ms=granted,
        ended_ms=now_ms,
        end_reason="",
        duration_s=dur_s,
        slices=slices,
        running=True,
    )


async def ended_usage(ledger: Ledger, since_ms: int, until_ms: int) -> list[UsageRecord]:
    """The records of leases that ended in [since_ms, until_ms], oldest first; a record that
    does not decode is reported, never skipped silently."""
    redis = ledger.redis
    ids: list[Any] = list(await redis.zrangebyscore(ledger.key("usage-ended"), since_ms, until_ms))
    if not ids:
        return []
    raws = await redis.hmget(ledger.key("usage-rec"), ids)
    records = []
    for lease_id, raw in zip(ids, raws, strict=True):
        if raw is None:
            continue  # trimmed between the two reads
        try:
            records.append(_RECORD.decode(raw))
        except msgspec.DecodeError as error:
            raise ValueError(f"usage record of lease {lease_id!r} is malformed: {error}") from error
    return records


async def live_usage(ledger: Ledger) -> list[UsageRecord]:
    """Every granted, still running lease's usage up to the ledger's now."""
    now = await ledger.now_ms()
    leases = [lease for lease in await ledger.leases() if lease.state == "active"]
    redis = ledger.redis
    out = []
    for lease in leases:
        raw_base = await redis.hget(ledger.key("lease", lease.lease_id), "load_base")
        base = _BASE.decode(raw_base) if raw_base and raw_base not in (b"{}", "{}") else {}
        loads: dict[str, tuple[float, float]] = {}
        for s in lease.slices:
            fields = await redis.hmget(ledger.key("dev", s.device_id), list(_LOAD_FIELDS))
            loads[s.device_id] = carried_load(fields, now)
        out.append(running_usage(lease, base, loads, now))
    return out


async def trim_usage(ledger: Ledger, retention_s: float) -> int:
    """Drop usage records of leases that ended more than ``retention_s`` ago; returns how many."""
    redis = ledger.redis
    cutoff = await ledger.now_ms() - int(retention_s * 1000)
    ids = await redis.zrangebyscore(ledger.key("usage-ended"), "-inf", cutoff, start=0, num=1000)
    if not ids:
        return 0
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hdel(ledger.key("usage-rec"), *ids)
        pipe.zrem(ledger.key("usage-ended"), *ids)
        await pipe.execute()
    return len(ids)
