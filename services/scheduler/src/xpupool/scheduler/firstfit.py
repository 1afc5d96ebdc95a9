"""First-fit placement over a ledger snapshot: the walking skeleton's pure decision logic.

State in, decision out; no I/O. Nodes and devices are taken in id order, and the first healthy
devices with enough free capacity on one node win.
"""

from __future__ import annotations

from dataclasses import dataclass

from xpupool.contracts import DeviceDemand, Health, JobRequested
from xpupool.ledger import DeviceRecord, NodeRecord


@dataclass(frozen=True)
class SliceChoice:
    """One device and how much of it to take."""

    device: DeviceRecord
    memory_mib: int
    compute_pct: int
    whole: bool


@dataclass(frozen=True)
class Place:
    """Reserve these slices (all on ``node_id``)."""

    node_id: str
    slices: list[SliceChoice]


@dataclass(frozen=True)
class Wait:
    """Not now; ``reason`` says why."""

    reason: str
    detail: str = ""


@dataclass(frozen=True)
class Reject:
    """Never: ``field_name`` names the input to blame, when one is."""

    reason: str
    field_name: str | None = None
    detail: str = ""


Decision = Place | Wait | Reject


def share_size(demand: DeviceDemand, device_memory_mib: int) -> tuple[int, int]:
    """(memory MiB, compute %) a share takes on a device of this size.

    Memory given in percent is of the device's visible memory; a share with only ``compute_pct``
    gets memory in the same proportion; a share with only memory gets no compute guarantee.
    """
    compute = demand.compute_pct or 0
    if demand.memory_mib is not None:
        memory = demand.memory_mib
    elif demand.memory_pct is not None:
        memory = device_memory_mib * demand.memory_pct // 100
    else:
        memory = device_memory_mib * compute // 100
    return memory, compute


def validate(request: JobRequested) -> Reject | None:
    """Checks the schema cannot express."""
    if request.device.memory_mib is not None and request.device.memory_pct is not None:
        return Reject(
            "invalid_request", "device.memory_pct", "give memory_mib or memory_pct, not both"
        )
    return None


def matches(request: JobRequested, device: DeviceRecord) -> bool:
    """Whether a device satisfies the request's selectors (ignoring free capacity)."""
    spec, sel = device.spec, request.selector
    if sel.vendor is not None and spec.vendor != sel.vendor:
        return False
    if sel.models and spec.model not in sel.models:
        return False
    if spec.model in sel.avoid_models:
        return False
    if sel.device_ids and spec.device_id not in sel.device_ids:
        return False
    if spec.device_id in sel.avoid_device_ids:
        return False
    if spec.memory_mib < sel.min_memory_mib or spec.capacity_units < sel.min_capacity:
        return False
    return all(c in spec.capabilities for c in sel.capabilities)


def _fits(request: JobRequested, device: DeviceRecord) -> SliceChoice | None:
    if device.health is not Health.HEALTHY:
        return None
    if request.device.is_whole:
        if device.holders > 0:
            return None
        return SliceChoice(device, device.memory_total_mib, 100, whole=True)
    memory, compute = share_size(request.device, device.memory_total_mib)
    if device.exclusive or device.memory_free_mib < memory or device.compute_free_pct < compute:
        return None
    return SliceChoice(device, memory, compute, whole=False)


def first_fit(request: JobRequested, nodes: list[NodeRecord]) -> Decision:
    """Place all ``count`` devices on the first node that can take them, or explain why not."""
    invalid = validate(request)
    if invalid is not None:
        return invalid
    if not nodes:
        return Wait("capacity_incoming", "no node has registered yet")
    could_ever_fit = False
    for node in nodes:
        candidates = [d for d in node.devices if matches(request, d)]
        if len(candidates) >= request.count:
            could_ever_fit = True
        if node.status != "up":
            continue
        if node.cpu_free_milli < request.host.cpu_milli:
            continue
        if node.memory_free_mib < request.host.memory_mib:
            continue
        chosen = [c for c in (_fits(request, d) for d in candidates) if c is not None]
        if len(chosen) >= request.count:
            return Place(node.node_id, chosen[: request.count])
    if not could_ever_fit:
        return Reject(
            "no_matching_device",
            "count" if request.count > 1 else "selector",
            f"no node has {request.count} device(s) matching the selectors",
        )
    return Wait("insufficient_capacity", "matching devices exist but are busy")
