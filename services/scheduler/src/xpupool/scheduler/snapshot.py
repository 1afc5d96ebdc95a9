"""Turn ledger records into the domain's pool snapshot (pure)."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec.structs

from xpupool.contracts import PoolShape
from xpupool.ledger import DeviceRecord, LeaseRecord, NodeRecord
from xpupool.placement.inventory import empty_device
from xpupool.scheduler.domain import (
    DeviceState,
    HostCharge,
    LeaseSlice,
    LeaseState,
    NodeState,
    PoolSnapshot,
)

UNITS_FIELD = "units"


def devices_field(model: str) -> str:
    """The quota counter of whole-device equivalents of one model."""
    return f"devices:{model}"


def _device(node: NodeRecord, record: DeviceRecord) -> DeviceState:
    spec = record.spec
    return DeviceState(
        device_id=spec.device_id,
        node_id=node.node_id,
        vendor=spec.vendor.value,
        model=spec.model,
        memory_total_mib=record.memory_total_mib,
        memory_free_mib=record.memory_free_mib,
        index=spec.index,
        uuid=spec.uuid,
        compute_free_pct=record.compute_free_pct,
        exclusive=record.exclusive,
        holders=record.holders,
        # A node that stopped heartbeating takes no grants, whatever its devices last said.
        health=record.health.value if node.status == "up" else "lost",
        util_pct=record.util_pct,
        capacity_units=spec.capacity_units,
        capabilities=frozenset(spec.capabilities),
        isolation=frozenset(spec.isolation),
        interconnect=spec.interconnect,
        domain=spec.domain,
        cost_per_hour=spec.cost_per_hour,
        partition=spec.partition.kind if spec.partition is not None else "",
    )


def node_state(record: NodeRecord, before: tuple[NodeRecord, NodeState] | None = None) -> NodeState:
    """One node as the domain sees it; a node that is not up keeps its devices (marked lost) so
    running leases are still accounted for.

    ``before``: the node's previous record and state. The states of the devices whose records
    it shares (the same objects: a change read kept them) are kept too, so whoever compares
    states can skip them by identity."""
    kept: dict[int, DeviceState] = {}
    if before is not None and before[0].status == record.status:
        kept = {id(d): state for d, state in zip(before[0].devices, before[1].devices, strict=True)}
    return NodeState(
        node_id=record.node_id,
        devices=tuple(kept.get(id(d)) or _device(record, d) for d in record.devices),
        cpu_milli_total=record.cpu_total_milli,
        cpu_milli_free=record.cpu_free_milli,
        memory_mib_total=record.memory_total_mib,
        memory_mib_free=record.memory_free_mib,
        draining=record.draining,
    )


#: The most nodes of one pool shape the domain considers when asking "could it ever fit".
MAX_GROWABLE_PER_POOL = 64


def growable_nodes(shapes: Sequence[PoolShape]) -> tuple[NodeState, ...]:
    """Empty nodes the autoscaler's pools could add, each pool up to its maximum size (capped):
    the nodes a request that fits nothing registered might still get."""
    out: list[NodeState] = []
    for shape in shapes:
        for k in range(min(shape.max_size, MAX_GROWABLE_PER_POOL)):
            node_id = f"{shape.pool}#growable-{k}"
            out.append(
                NodeState(
                    node_id=node_id,
                    devices=tuple(
                        empty_device(
                            msgspec.structs.replace(
                                d,
                                device_id=f"{node_id}/{d.index}",
                                domain=f"{node_id}/{d.domain}" if d.domain else "",
                            ),
                            node_id,
                        )
                        for d in shape.devices
                    ),
                    cpu_milli_total=shape.cpu_milli,
                    cpu_milli_free=shape.cpu_milli,
                    memory_mib_total=shape.memory_mib,
                    memory_mib_free=shape.memory_mib,
                )
            )
    return tuple(out)


def lease_state(record: LeaseRecord) -> LeaseState:
    """One live lease or reservation as the domain sees it."""
    units = next(
        (u.inc for u in record.usage if u.scope == record.queue and u.field == UNITS_FIELD), 0.0
    )
    return LeaseState(
        lease_id=record.lease_id,
        job_id=record.job_id,
        tenant=record.tenant,
        queue=record.queue,
        priority=record.priority,
        started_at_s=(record.granted_ms or record.created_ms) / 1000,
        slices=tuple(
            LeaseSlice(s.device_id, s.memory_mib, s.compute_pct, s.whole) for s in record.slices
        ),
        capacity_units=units,
        # A reservation not yet granted is counted but never chosen as a victim.
        preemptible=record.state == "active",
        host=tuple(HostCharge(n, h.cpu_milli, h.memory_mib) for n, h in record.host.items()),
        terminating=bool(record.preempted_for),
        preempted_for=record.preempted_for,
    )


def build_snapshot(
    nodes: Sequence[NodeRecord], leases: Sequence[LeaseRecord], now_ms: int, version: int
) -> PoolSnapshot:
    """The pool as the domain sees it (``node_state`` and ``lease_state`` of every record)."""
    return PoolSnapshot(
        nodes=tuple(node_state(n) for n in nodes),
        leases=tuple(lease_state(lease) for lease in leases),
        now_s=now_ms / 1000,
        version=version,
    )
