"""Collector handlers: register the node, sample its devices, keep the ledger true."""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

import msgspec

from xpupool.contracts import (
    DeviceHealthChanged,
    DeviceSample,
    DeviceSpec,
    Health,
    InjectFault,
    LeaseOverused,
    NodeRegistered,
    TelemetrySampled,
)
from xpupool.devices import (
    BackendUnavailable,
    Catalog,
    DeviceBackend,
    DeviceInfo,
    Disappear,
    Overheat,
    ProcessInfo,
    SimulatedBackend,
    Xid,
    to_samples,
    to_specs,
)
from xpupool.devices.backend import device_id_for, partition_id_for
from xpupool.devices.enforcement import running_isolation, running_share_limits
from xpupool.ledger import DeviceRecord, LeaseRecord, Ledger
from xpupool.obs import get_logger
from xpupool.telemetry_collector.health import HealthModel, reason_of
from xpupool.telemetry_collector.metrics import CollectorMetrics
from xpupool.telemetry_collector.overuse import (
    DeviceUse,
    Holder,
    LeaseOfPid,
    OveruseEpisodes,
    assess,
    read_lease_env,
)
from xpupool.telemetry_collector.settings import CollectorSettings

# The ledger's state of a granted lease (grant.lua).
ACTIVE: Final = "active"


NODE_CLAIMED: Final = "node_claimed"
"""The ledger's answer to a heartbeat of a collector that no longer holds its node, and the
tick's outcome then (``xpupool_collector_samples_total{outcome="node_claimed"}``)."""


def new_instance() -> str:
    """A name for this collector process that tells an operator where it runs: host, PID and a
    random part (a PID comes back after a restart, a container's host name too)."""
    return f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:8]}"


@dataclass
class CollectorDeps:
    """What the collector's handlers need, and the state one collector keeps across ticks."""

    ledger: Ledger
    backend: DeviceBackend
    catalog: Catalog
    settings: CollectorSettings
    health: HealthModel
    metrics: CollectorMetrics = field(default_factory=CollectorMetrics)
    overuse: OveruseEpisodes = field(default_factory=OveruseEpisodes)
    # How a host PID maps to its lease (tests inject a dict lookup).
    lease_of_pid: LeaseOfPid = read_lease_env
    # Granted leases holding a device of this node, by id (their slices never change).
    lease_cache: dict[str, LeaseRecord] = field(default_factory=dict)
    # When the node's devices were last read whole (time.monotonic): see _tick's spec check.
    specs_read_at: float = 0.0
    # This collector process: the node is held by the one that registered it last, and the
    # ledger refuses another's heartbeat (``node_claimed``).
    instance: str = field(default_factory=new_instance)


def _now() -> datetime:
    return datetime.now(UTC)


def unique_specs(specs: Sequence[DeviceSpec]) -> list[DeviceSpec]:
    """Keep the first device of each id. A driver that reports one id twice must not stop the
    node from registering (the ledger refuses duplicates), so the repeats are left out, loudly."""
    seen: dict[str, DeviceSpec] = {}
    for spec in specs:
        if spec.device_id in seen:
            get_logger().error("duplicate_device_id", device_id=spec.device_id, uuid=spec.uuid)
            continue
        seen[spec.device_id] = spec
    return list(seen.values())


def node_specs(deps: CollectorDeps, infos: Sequence[DeviceInfo]) -> list[DeviceSpec]:
    """The leasable units of ``infos`` as this node registers them: one per id, with the share
    limit mechanisms that run here."""
    running = running_share_limits(
        deps.settings.share_limits, simulated=isinstance(deps.backend, SimulatedBackend)
    )
    return [
        msgspec.structs.replace(spec, isolation=running_isolation(spec.isolation, running))
        for spec in unique_specs(to_specs(infos, deps.settings.node_id, deps.catalog))
    ]


async def register_node(deps: CollectorDeps) -> Sequence[msgspec.Struct]:
    """Put the node and its present devices into the ledger, reconciling with what was there:
    leases on devices that vanished or were replaced end as ``lost`` (the lease-manager's
    outbox reports them). Each device's health is written as the backend reads it now, in the
    same script: the ledger never holds a device healthy that is not, even for a moment, and a
    device that recovered while no collector ran (an XID is only sticky in the process that
    saw it) is healthy again."""
    infos = await asyncio.to_thread(deps.backend.discover)
    deps.specs_read_at = time.monotonic()
    specs = node_specs(deps, infos)
    readings = {
        s.device_id: (s.health, reason_of(s)) for s in to_samples(infos, deps.settings.node_id)
    }
    result = await deps.ledger.register_node(
        deps.settings.node_id,
        specs,
        deps.settings.cpu_milli,
        deps.settings.memory_mib,
        {"backend": deps.settings.backend},
        health=readings,
        instance=deps.instance,
    )
    if not result.ok:
        raise RuntimeError(f"registration refused: {result.reason} {result.detail}")
    get_logger().info(
        "node_registered",
        node_id=deps.settings.node_id,
        devices=len(specs),
        added=len(result.added),
        removed=result.removed,
        leases_lost=result.lost,
    )
    return [
        NodeRegistered(
            node_id=deps.settings.node_id,
            devices=specs,
            cpu_milli=deps.settings.cpu_milli,
            memory_mib=deps.settings.memory_mib,
        )
    ]


async def collect(deps: CollectorDeps) -> Sequence[msgspec.Struct]:
    """One tick: sample, write load (with the heartbeat) and health to the ledger, check
    over-use; returns the events. Counted and timed in the collector's metrics whatever the outcome.

    A backend that fails entirely (driver gone, node dying) yields no heartbeat, so the node is
    declared lost after its grace period rather than reported healthy on stale data.
    """
    started = time.perf_counter()
    outcome = "error"
    try:
        events, outcome = await _tick(deps)
        return events
    finally:
        deps.metrics.observe_tick(outcome, time.perf_counter() - started)


async def _tick(deps: CollectorDeps) -> tuple[list[msgspec.Struct], str]:
    node_id = deps.settings.node_id
    log = get_logger().bind(node_id=node_id)
    devices = await deps.ledger.node_devices(node_id)
    if isinstance(deps.backend, SimulatedBackend):
        _follow_leases(
            deps.backend,
            devices,
            deps.settings.sim_overuse_factor,
            deps.settings.sim_busy_factor,
        )
    # Only a device shared by several leases needs its processes (the one-holder rule charges
    # all its memory); discover() reads them, at a higher cost than sample() on some backends.
    need_processes = any(d.holders > 1 and not d.exclusive for d in devices)
    # A unit can change under the same id while the collector runs (a MIG instance destroyed
    # and made again with the same instance ids: a new UUID, maybe another profile): its
    # samples still match the ledger's ids, so every spec_check_interval_s the devices are read
    # whole and registered again if what the ledger holds is no longer what is there.
    check_specs = time.monotonic() - deps.specs_read_at >= deps.settings.spec_check_interval_s
    infos: list[DeviceInfo] | None = None
    try:
        if need_processes or check_specs:
            infos = await asyncio.to_thread(deps.backend.discover)
            samples = to_samples(infos, node_id)
            processes = processes_by_unit(infos, node_id) if need_processes else {}
        else:
            samples, processes = await asyncio.to_thread(deps.backend.sample), {}
    except BackendUnavailable as error:
        log.warning("backend_unavailable", error=str(error))
        # No reading: scrapes show a gap rather than the last values as if current.
        deps.metrics.update_devices(node_id, (), (), {})
        return [], "backend_unavailable"
    # The load and the heartbeat in one script: a tick is one write (and fsync) on the ledger.
    beat = await deps.ledger.heartbeat(node_id, samples, deps.instance)
    if beat.reason == NODE_CLAIMED:
        # Registering again would take the node back, and the other collector would take it
        # back in turn: the last to register holds it, and this one writes nothing, loudly.
        log.error(
            "node_claimed_by_another_collector",
            instance=deps.instance,
            holder=beat.detail,
            hint="two collectors run under one XPUPOOL_NODE_ID; give each host its own",
        )
        deps.metrics.update_devices(node_id, (), (), {})
        return [], NODE_CLAIMED

    events: list[msgspec.Struct] = []
    known = {d.spec.device_id for d in devices}
    reconcile = any(s.device_id not in known for s in samples)
    if check_specs and infos is not None:
        deps.specs_read_at = time.monotonic()
        if {s.device_id: s for s in node_specs(deps, infos)} != {
            d.spec.device_id: d.spec for d in devices
        }:
            log.warning("device_specs_changed")
            reconcile = True
    for t in deps.health.observe(known, samples):
        if t.device_id in known:
            await deps.ledger.set_health(t.device_id, t.current, t.reason)
        events.append(
            DeviceHealthChanged(
                node_id=node_id,
                device_id=t.device_id,
                previous=t.previous,
                current=t.current,
                reason=t.reason,
                at=_now(),
            )
        )
        log.warning(
            "device_health_changed",
            device_id=t.device_id,
            previous=t.previous.value,
            current=t.current.value,
            reason=t.reason,
        )
        reconcile = reconcile or t.current is Health.LOST or t.previous is Health.LOST

    events.extend(await _check_overuse(deps, log, devices, samples, processes, need_processes))
    if reconcile or not beat.ok:
        events.extend(await register_node(deps))
    deps.metrics.update_devices(node_id, (d.spec for d in devices), samples, deps.health.states)
    events.append(TelemetrySampled(node_id=node_id, at=_now(), samples=list(samples)))
    return events, "ok"


def _follow_leases(
    backend: SimulatedBackend,
    devices: Sequence[DeviceRecord],
    overuse_factor: float,
    busy_factor: float = 1.0,
) -> None:
    """Make simulated devices as busy as the ledger has leased them (memory times the over-use
    factor, compute times the busy factor), so telemetry, metrics, over-use detection and idle
    reclaim see plausible load."""
    present = set(backend.unit_ids)
    for d in devices:
        if d.spec.device_id in present:
            leased = d.memory_total_mib - d.memory_free_mib
            backend.set_load(
                d.spec.device_id,
                int(leased * overuse_factor),
                round((100 - d.compute_free_pct) * busy_factor),
            )


def processes_by_unit(infos: Sequence[DeviceInfo], node_id: str) -> dict[str, list[ProcessInfo]]:
    """The processes of every leasable unit, keyed like :func:`to_samples`: a MIG/vNPU
    partition gets the processes of its GPU and compute instance."""
    units: dict[str, list[ProcessInfo]] = {}
    for info in infos:
        parent = device_id_for(node_id, info.vendor, info.index)
        if not (info.mig_mode and info.partitions):
            units[parent] = list(info.processes)
            continue
        for part in info.partitions:
            units[partition_id_for(parent, part)] = [
                p
                for p in info.processes
                if p.gpu_instance_id == part.gpu_instance_id
                and (
                    part.compute_instance_id is None
                    or p.compute_instance_id == part.compute_instance_id
                )
            ]
    return units


async def _check_overuse(
    deps: CollectorDeps,
    log: Any,
    devices: Sequence[DeviceRecord],
    samples: Sequence[DeviceSample],
    processes: Mapping[str, Sequence[ProcessInfo]],
    read_processes: bool,
) -> list[msgspec.Struct]:
    """Report leases newly over their memory grant (one event per lease per episode)."""
    shared = [d.spec.device_id for d in devices if d.holders > 0 and not d.exclusive]
    holders = await _holders(deps, shared)
    uses = [
        DeviceUse(s.device_id, s.memory_used_mib, processes.get(s.device_id, ()))
        for s in samples
        if s.device_id in holders
    ]
    tolerance = deps.settings.overuse_tolerance_mib
    if read_processes:
        # The reader opens /proc files: keep that off the event loop.
        verdict = await asyncio.to_thread(assess, uses, holders, deps.lease_of_pid, tolerance)
    else:
        verdict = assess(uses, holders, deps.lease_of_pid, tolerance)
    holding = {h.lease_id for hs in holders.values() for h in hs}
    events: list[msgspec.Struct] = []
    for o in deps.overuse.update(verdict, holding):
        log.bind(lease_id=o.lease_id, job_id=o.job_id, device_id=o.device_id).warning(
            "lease_overused",
            granted_memory_mib=o.granted_memory_mib,
            used_memory_mib=o.used_memory_mib,
        )
        events.append(
            LeaseOverused(
                node_id=deps.settings.node_id,
                device_id=o.device_id,
                lease_id=o.lease_id,
                job_id=o.job_id,
                granted_memory_mib=o.granted_memory_mib,
                used_memory_mib=o.used_memory_mib,
                at=_now(),
            )
        )
    return events


async def _holders(deps: CollectorDeps, device_ids: Sequence[str]) -> dict[str, list[Holder]]:
    """The leases holding each of ``device_ids``, with their grant there.

    One pipelined read of the ``dev-leases`` sets, plus one of the lease hashes not already
    cached: a granted lease's slices never change, so it is cached until it stops holding.
    """
    if not device_ids:
        deps.lease_cache.clear()
        return {}
    ledger = deps.ledger
    async with ledger.redis.pipeline(transaction=False) as pipe:
        for device_id in device_ids:
            pipe.smembers(ledger.key("dev-leases", device_id))
        rows: list[set[bytes | str]] = await pipe.execute()
    lease_ids = {
        device_id: sorted(_text(x) for x in row)
        for device_id, row in zip(device_ids, rows, strict=True)
    }
    wanted = {lease_id for ids in lease_ids.values() for lease_id in ids}
    for stale in set(deps.lease_cache) - wanted:
        del deps.lease_cache[stale]
    missing = sorted(wanted - set(deps.lease_cache))
    fetched = dict(zip(missing, await ledger.get_leases(missing), strict=True)) if missing else {}
    for lease_id, record in fetched.items():
        if record is not None and record.state == ACTIVE:
            deps.lease_cache[lease_id] = record
    holders: dict[str, list[Holder]] = {}
    for device_id, ids in lease_ids.items():
        for lease_id in ids:
            record = deps.lease_cache.get(lease_id) or fetched.get(lease_id)
            if record is None:
                continue
            for s in record.slices:
                if s.device_id == device_id:
                    holders.setdefault(device_id, []).append(
                        Holder(
                            lease_id=lease_id,
                            job_id=record.job_id,
                            granted_memory_mib=s.memory_mib,
                            whole=s.whole,
                            active=record.state == ACTIVE,
                        )
                    )
    return holders


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


async def inject_fault(command: InjectFault, deps: CollectorDeps) -> Sequence[msgspec.Struct]:
    """Apply a simulated fault (tests and the demo); real backends ignore it."""
    backend = deps.backend
    if not isinstance(backend, SimulatedBackend) or command.node_id != deps.settings.node_id:
        return []
    match command.fault:
        case "xid":
            backend.inject(command.device_id, Xid(code=command.xid_code))
        case "overheat":
            backend.inject(command.device_id, Overheat())
        case "disappear":
            backend.inject(command.device_id, Disappear())
        case "clear":
            backend.clear(command.device_id)
        case "kill_node":
            backend.kill_node()
    get_logger().info("fault_injected", fault=command.fault, device_id=command.device_id)
    return []
