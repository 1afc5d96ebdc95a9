"""An invariant checker over the ledger: recompute every device's use from the live leases and
compare it with the counters the scripts maintain. Used by tests and, later, the fault suite."""

from __future__ import annotations

import math
from collections import defaultdict

from xpupool.ledger.ledger import LeaseRecord, Ledger

# A record of what is over expires (retain_s in _prelude.lua); one of what is live never does.
_LIVE_STATES = {
    "job": frozenset({"pending", "reserved", "leased"}),
    "lease": frozenset({"reserved", "active"}),
}
_OVER_STATES = {
    "job": frozenset({"ended", "rejected", "timed_out", "cancelled"}),
    "lease": frozenset({"ended"}),
}
# Records whose state and expiry one transaction reads.
_CHUNK = 1000
# How far a quota counter may be from the sum of its live leases' claims: each claim is added
# and given back as the decimal its lease keeps (_reservation.lua), so what is left is the
# rounding of Redis's float sums, many orders of magnitude below the ledger's own check (1e-9).
_COUNTER_TOLERANCE = 1e-9


async def audit(ledger: Ledger) -> list[str]:
    """Every violated invariant, as a sentence; an empty list means the ledger is consistent.

    Checked: no device is over-allocated (free memory and compute never below zero); a whole
    device has exactly one holder; the counters equal the sum of the live leases' slices; no
    node's host CPU or memory is over-allocated, and what its counters hold equals the sum of
    the live leases' host charges there (host-only leases, without slices, included); each
    tenant's set of live leases holds exactly its live leases; every job and lease record of
    what is over expires, and none of what is live does (``retention_problems``); every device
    record belongs to a registered device: nothing else reads or deletes one (a device leaves
    the ledger with its record; a write to one it does not hold would leave one for ever);
    every quota counter equals the sum of the live leases' claims on it (``counter_problems``);
    each device's and each node's lease index lists exactly the live leases on it
    (``index_problems``: a device's removal and a node's loss end the leases listed there).
    """
    # Reads are not one atomic snapshot; retry until no script ran while we read.
    for _ in range(50):
        version = await ledger.version()
        leases, nodes = await ledger.leases(), await ledger.nodes()
        tenant_sets = await _sets_of(ledger, "tenant-leases")
        device_sets = await _sets_of(ledger, "dev-leases")
        node_sets = await _sets_of(ledger, "node-leases")
        counters = await _usage_counters(ledger)
        device_records = await _device_records(ledger)
        if await ledger.version() == version:
            break
    registered = {d.spec.device_id for node in nodes for d in node.devices}
    problems = [
        f"device record {d} belongs to no registered device"
        for d in sorted(device_records - registered)
    ]
    by_tenant: dict[str, set[str]] = defaultdict(set)
    for lease in leases:
        by_tenant[lease.tenant].add(lease.lease_id)
    for tenant in sorted(set(by_tenant) | set(tenant_sets)):
        missing = sorted(by_tenant[tenant] - tenant_sets.get(tenant, set()))
        extra = sorted(tenant_sets.get(tenant, set()) - by_tenant[tenant])
        if missing or extra:
            problems.append(
                f"tenant {tenant}'s lease set lacks live leases {missing} and holds others {extra}"
            )
    memory: dict[str, int] = defaultdict(int)
    compute: dict[str, int] = defaultdict(int)
    holders: dict[str, int] = defaultdict(int)
    whole: dict[str, int] = defaultdict(int)
    host_cpu: dict[str, int] = defaultdict(int)
    host_mem: dict[str, int] = defaultdict(int)
    for lease in leases:
        for node_id, h in lease.host.items():
            host_cpu[node_id] += h.cpu_milli
            host_mem[node_id] += h.memory_mib
        for s in lease.slices:
            memory[s.device_id] += s.memory_mib
            compute[s.device_id] += s.compute_pct
            holders[s.device_id] += 1
            whole[s.device_id] += int(s.whole)
    for node in nodes:
        n = node.node_id
        if node.cpu_free_milli < 0 or node.memory_free_mib < 0:
            problems.append(
                f"node {n} over-allocated: free CPU {node.cpu_free_milli}, "
                f"free memory {node.memory_free_mib}"
            )
        if node.cpu_total_milli - node.cpu_free_milli != host_cpu[n]:
            problems.append(
                f"node {n} CPU counter {node.cpu_total_milli - node.cpu_free_milli} "
                f"!= leased {host_cpu[n]}"
            )
        if node.memory_total_mib - node.memory_free_mib != host_mem[n]:
            problems.append(
                f"node {n} memory counter {node.memory_total_mib - node.memory_free_mib} "
                f"!= leased {host_mem[n]}"
            )
        for d in node.devices:
            i = d.spec.device_id
            if d.memory_free_mib < 0 or d.compute_free_pct < 0:
                problems.append(
                    f"{i} over-allocated: free memory {d.memory_free_mib}, "
                    f"free compute {d.compute_free_pct}"
                )
            if memory[i] > d.memory_total_mib or compute[i] > 100:
                problems.append(
                    f"{i} leases take {memory[i]} MiB / {compute[i]}% of "
                    f"{d.memory_total_mib} MiB / 100%"
                )
            if whole[i] and holders[i] != 1:
                problems.append(f"{i} is held whole and shared ({holders[i]} holders)")
            if d.memory_total_mib - d.memory_free_mib != memory[i]:
                problems.append(
                    f"{i} memory counter {d.memory_total_mib - d.memory_free_mib} "
                    f"!= leased {memory[i]}"
                )
            if 100 - d.compute_free_pct != compute[i] or d.holders != holders[i]:
                problems.append(f"{i} compute/holder counters disagree with its leases")
    problems += counter_problems(leases, counters)
    problems += index_problems(leases, device_sets, node_sets)
    return problems + await retention_problems(ledger)


def counter_problems(leases: list[LeaseRecord], counters: dict[str, dict[str, float]]) -> list[str]:
    """The quota counters (scope -> field -> value) that differ from the sum of the live
    leases' claims: a counter short of its leases lets a queue past its limit, and one that
    holds more (an end that gave nothing back) refuses the queue that much for ever."""
    held: dict[tuple[str, str], float] = defaultdict(float)
    for lease in leases:
        for claim in lease.usage:
            held[claim.scope, claim.field] += claim.inc
    kept = {(scope, f): v for scope, fields in counters.items() for f, v in fields.items()}
    return [
        f"quota counter {scope}/{f} is {kept.get((scope, f), 0.0)!r}, "
        f"its live leases hold {held.get((scope, f), 0.0)!r}"
        for scope, f in sorted(held.keys() | kept.keys())
        if not math.isclose(
            kept.get((scope, f), 0.0), held.get((scope, f), 0.0), abs_tol=_COUNTER_TOLERANCE
        )
    ]


def index_problems(
    leases: list[LeaseRecord], device_sets: dict[str, set[str]], node_sets: dict[str, set[str]]
) -> list[str]:
    """Devices and nodes whose lease index (``dev-leases:<device>``, ``node-leases:<node>``)
    is not exactly the live leases on them: by their slices, and on a node by its slices' and
    host charges' nodes, as _reservation.lua indexes them."""
    on_device: dict[str, set[str]] = defaultdict(set)
    on_node: dict[str, set[str]] = defaultdict(set)
    for lease in leases:
        for s in lease.slices:
            on_device[s.device_id].add(lease.lease_id)
            on_node[s.node_id].add(lease.lease_id)
        for node_id in lease.host:
            on_node[node_id].add(lease.lease_id)
    problems = []
    for kind, live, listed in (("device", on_device, device_sets), ("node", on_node, node_sets)):
        for name in sorted(live.keys() | listed.keys()):
            missing = sorted(live.get(name, set()) - listed.get(name, set()))
            extra = sorted(listed.get(name, set()) - live.get(name, set()))
            if missing or extra:
                problems.append(
                    f"{kind} {name}'s lease index lacks live leases {missing} "
                    f"and holds others {extra}"
                )
    return problems


async def retention_problems(ledger: Ledger) -> list[str]:
    """Job and lease records that would stay for ever (over, without an expiry) or could vanish
    while in use (live, with one), and records in a state no script writes. Each chunk's states
    and expiries are read in one transaction, so a script between the two reads cannot fool it."""
    problems: list[str] = []
    redis = ledger.redis
    for kind in ("job", "lease"):
        live, over = _LIVE_STATES[kind], _OVER_STATES[kind]
        keys = [_text(k) async for k in redis.scan_iter(match=ledger.keys_of(kind), count=1000)]
        for start in range(0, len(keys), _CHUNK):
            chunk = keys[start : start + _CHUNK]
            async with redis.pipeline(transaction=True) as pipe:
                for key in chunk:
                    pipe.hget(key, "state")
                    pipe.ttl(key)
                replies = await pipe.execute()
            for key, raw, ttl in zip(chunk, replies[::2], replies[1::2], strict=True):
                state, name = _text(raw) if raw else raw, key.removeprefix(ledger.prefix)
                if ttl == -2:
                    continue  # expired between the scan and the read
                if state in live and ttl != -1:
                    problems.append(f"{name} is {state} and expires in {ttl} s")
                elif state in over and ttl == -1:
                    problems.append(f"{name} is {state} and never expires")
                elif state not in live and state not in over:
                    problems.append(f"{name} has no known state ({state!r})")
    return problems


async def _sets_of(ledger: Ledger, family: str) -> dict[str, set[str]]:
    """Each set of one key family as the scripts keep it (``tenant-leases:<tenant>``,
    ``dev-leases:<device>``, ``node-leases:<node>``), by the name after the family, read in
    one round trip."""
    redis, prefix = ledger.redis, ledger.key(family, "")
    keys = [_text(k) async for k in redis.scan_iter(match=ledger.keys_of(family), count=1000)]
    async with redis.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.smembers(key)
        members = await pipe.execute()
    return {
        key.removeprefix(prefix): {_text(m) for m in found}
        for key, found in zip(keys, members, strict=True)
    }


async def _usage_counters(ledger: Ledger) -> dict[str, dict[str, float]]:
    """Every quota counter (``usage:<scope>``: field -> value), read in one round trip."""
    redis, prefix = ledger.redis, ledger.key("usage", "")
    keys = [_text(k) async for k in redis.scan_iter(match=ledger.keys_of("usage"), count=1000)]
    async with redis.pipeline(transaction=False) as pipe:
        for key in keys:
            pipe.hgetall(key)
        rows = await pipe.execute()
    return {
        key.removeprefix(prefix): {_text(f): float(_text(v)) for f, v in row.items()}
        for key, row in zip(keys, rows, strict=True)
    }


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def _device_records(ledger: Ledger) -> set[str]:
    """The device ids of every device record the ledger holds."""
    prefix = ledger.key("dev", "")
    return {
        _text(k).removeprefix(prefix)
        async for k in ledger.redis.scan_iter(match=ledger.keys_of("dev"), count=1000)
    }
