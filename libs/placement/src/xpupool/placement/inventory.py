"""The scheduler's view of the ledger: a read-only snapshot the I/O shell builds from Redis.

Everything here is a frozen, slotted dataclass so a snapshot is cheap to build (no validation, no
copying) and safe to share. The mutable working copy that a batch of decisions updates lives in
:mod:`.pool`; the snapshot itself is never mutated.

Units are in field names (``_mib``, ``_pct``, ``_milli``, ``_s``). Percentages are 0-100.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from xpupool.contracts import DeviceSpec

__all__ = [
    "HARD_ISOLATION",
    "HEALTHY",
    "DeviceState",
    "HostCharge",
    "LeaseSlice",
    "LeaseState",
    "NodeState",
    "PoolSnapshot",
    "empty_device",
]

HEALTHY: Final = "healthy"
HARD_ISOLATION: Final = frozenset({"mig", "vnpu"})
"""Isolation mechanisms where the catalog says device memory is enforced per slice."""


@dataclass(frozen=True, slots=True)
class DeviceState:
    """One leasable unit (a whole device or a hardware partition) and its ledger counters.

    ``memory_free_mib`` and ``compute_free_pct`` are what the ledger has not handed out, not live
    telemetry; ``util_pct`` is the live load (``None`` when unknown). ``exclusive`` means a job
    holds the device whole; ``holders`` counts the slices on it.
    """

    device_id: str
    node_id: str
    vendor: str
    model: str
    memory_total_mib: int
    memory_free_mib: int
    index: int = 0
    uuid: str = ""
    compute_free_pct: int = 100
    exclusive: bool = False
    holders: int = 0
    health: str = HEALTHY
    util_pct: float | None = None
    capacity_units: float = 1.0
    capabilities: frozenset[str] = frozenset()
    isolation: frozenset[str] = frozenset()
    interconnect: str = "pcie"
    domain: str = ""
    cost_per_hour: float = 0.0
    partition: str = ""
    """The kind of hardware partition this unit is (``mig``, ``vnpu``), empty for a device."""

    @property
    def hard_isolation(self) -> bool:
        """True when a shared slice of this device has its memory enforced (MIG, vNPU)."""
        return not self.isolation.isdisjoint(HARD_ISOLATION)


@dataclass(frozen=True, slots=True)
class NodeState:
    """A node, its host resources (total and not yet handed out) and its devices."""

    node_id: str
    devices: tuple[DeviceState, ...]
    cpu_milli_total: int = 0
    cpu_milli_free: int = 0
    memory_mib_total: int = 0
    memory_mib_free: int = 0
    draining: bool = False
    """Being emptied (by the autoscaler): no new placement goes there."""


@dataclass(frozen=True, slots=True)
class LeaseSlice:
    """One device, or a share of it, held by a lease."""

    device_id: str
    memory_mib: int
    compute_pct: int
    whole: bool


@dataclass(frozen=True, slots=True)
class HostCharge:
    """Host resources a lease or reservation holds on one node."""

    node_id: str
    cpu_milli: int = 0
    memory_mib: int = 0


@dataclass(frozen=True, slots=True)
class LeaseState:
    """A live lease (or a reservation not yet turned into a lease) as the ledger records it.

    ``terminating`` marks a lease whose end was already requested (for instance by a preemption)
    but whose slices are still held; ``preempted_for`` names the job it was preempted for.
    Reservations in flight should be passed as non-preemptible leases so quotas count them.
    """

    lease_id: str
    job_id: str
    tenant: str
    queue: str
    priority: int
    started_at_s: float
    slices: tuple[LeaseSlice, ...]
    capacity_units: float = 0.0
    preemptible: bool = True
    host: tuple[HostCharge, ...] = ()
    terminating: bool = False
    preempted_for: str = ""


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    """The whole ledger at one instant, as read by the shell."""

    nodes: tuple[NodeState, ...]
    leases: tuple[LeaseState, ...] = ()
    now_s: float = 0.0
    version: int = field(default=0)
    """The ledger's version counter, echoed back so the commit can detect staleness."""


def empty_device(spec: DeviceSpec, node_id: str) -> DeviceState:
    """A registered device as the domain sees it before anyone holds or loads it (a node the
    autoscaler could add; the domain's view of a spec without ledger counters)."""
    return DeviceState(
        device_id=spec.device_id,
        node_id=node_id,
        vendor=spec.vendor.value,
        model=spec.model,
        memory_total_mib=spec.memory_mib,
        memory_free_mib=spec.memory_mib,
        index=spec.index,
        uuid=spec.uuid,
        capacity_units=spec.capacity_units,
        capabilities=frozenset(spec.capabilities),
        isolation=frozenset(spec.isolation),
        interconnect=spec.interconnect,
        domain=spec.domain,
        cost_per_hour=spec.cost_per_hour,
        partition=spec.partition.kind if spec.partition is not None else "",
    )
