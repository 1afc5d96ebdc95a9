"""Collector handlers: register the node, sample its devices, keep the ledger true."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import msgspec

from xpupool.contracts import (
    DeviceHealthChanged,
    DeviceSample,
    Health,
    InjectFault,
    NodeRegistered,
    TelemetrySampled,
)
from xpupool.devices import (
    BackendUnavailable,
    Catalog,
    DeviceBackend,
    Disappear,
    Overheat,
    SimulatedBackend,
    Xid,
    to_specs,
)
from xpupool.ledger import Ledger
from xpupool.obs import get_logger
from xpupool.telemetry_collector.health import HealthModel
from xpupool.telemetry_collector.settings import CollectorSettings


@dataclass
class CollectorDeps:
    """What the collector's handlers need."""

    ledger: Ledger
    backend: DeviceBackend
    catalog: Catalog
    settings: CollectorSettings
    health: HealthModel


def _now() -> datetime:
    return datetime.now(UTC)


async def register_node(deps: CollectorDeps) -> Sequence[msgspec.Struct]:
    """Put the node and its present devices into the ledger, reconciling with what was there:
    leases on devices that vanished end as ``lost`` (the lease-manager's outbox reports them)."""
    infos = await asyncio.to_thread(deps.backend.discover)
    specs = to_specs(infos, deps.settings.node_id, deps.catalog)
    result = await deps.ledger.register_node(
        deps.settings.node_id,
        specs,
        deps.settings.cpu_milli,
        deps.settings.memory_mib,
        {"backend": deps.settings.backend},
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
    """One tick: sample, write load and health to the ledger, heartbeat, return the events.

    A backend that fails entirely (driver gone, node dying) yields no heartbeat, so the node is
    declared lost after its grace period rather than reported healthy on stale data.
    """
    try:
        samples = await asyncio.to_thread(deps.backend.sample)
    except BackendUnavailable as error:
        get_logger().warning("backend_unavailable", error=str(error))
        return []
    node_id = deps.settings.node_id
    devices = await deps.ledger.node_devices(node_id)
    if isinstance(deps.backend, SimulatedBackend):
        present = {s.device_id for s in samples}
        for d in devices:
            if d.spec.device_id in present:
                deps.backend.set_load(
                    d.spec.device_id,
                    d.memory_total_mib - d.memory_free_mib,
                    100 - d.compute_free_pct,
                )
        samples = await asyncio.to_thread(deps.backend.sample)
    await deps.ledger.record_load(samples)

    events: list[msgspec.Struct] = []
    known = {d.spec.device_id for d in devices}
    reconcile = any(s.device_id not in known for s in samples)
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
        get_logger().warning(
            "device_health_changed",
            device_id=t.device_id,
            previous=t.previous.value,
            current=t.current.value,
            reason=t.reason,
        )
        reconcile = reconcile or t.current is Health.LOST or t.previous is Health.LOST

    beat = await deps.ledger.heartbeat(node_id)
    if reconcile or not beat.ok:
        events.extend(await register_node(deps))
        await _reapply_health(deps, samples)
    events.append(TelemetrySampled(node_id=node_id, at=_now(), samples=list(samples)))
    return events


async def _reapply_health(deps: CollectorDeps, samples: Sequence[DeviceSample]) -> None:
    """After a re-registration the ledger's health is reset; restore what the backend says."""
    for sample in samples:
        if sample.health is not Health.HEALTHY:
            await deps.ledger.set_health(sample.device_id, sample.health, "re-registered")


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
