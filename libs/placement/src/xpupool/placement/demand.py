"""A request normalized against a pool: the one demand type every placement policy takes.

Matching works on device *classes* first (vendor, model, memory, capacity, capabilities,
isolation: a handful per pool), so the per-request cost does not grow with the device count; only
``device_ids`` / ``avoid_device_ids`` are checked per device.

Shares: a share gives ``memory_mib`` or ``memory_pct`` (of the device's visible memory) and/or
``compute_pct``. A share with only ``compute_pct`` gets memory in the same proportion; a share
with only memory gets compute 0 (best effort). A whole device takes everything and needs a device
nobody holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from xpupool.contracts.payloads import Isolation, JobRequested
from xpupool.placement.pool import DeviceClass, WorkingPool

__all__ = ["Demand", "Scope", "class_matches", "is_hard_share", "make_demand", "share_on"]

Scope = Literal["node", "domain", "any"]


@dataclass(frozen=True, slots=True)
class Demand:
    """A request normalized against one pool: matching classes resolved, ids turned to indices."""

    count: int
    whole: bool
    memory_mib: int | None
    memory_pct: int | None
    compute_pct: int | None
    cpu_milli: int
    host_memory_mib: int
    scope: Scope
    gang: bool
    intent: str
    classes: tuple[int, ...]
    allowed: frozenset[int] | None
    avoided: frozenset[int]

    def share(self, cls: DeviceClass) -> tuple[int, int]:
        """(memory_mib, compute_pct) one slice takes on a device of ``cls``."""
        if self.whole:
            return cls.memory_total_mib, 100
        return share_on(self.memory_mib, self.memory_pct, self.compute_pct, cls.memory_total_mib)

    @property
    def host_only(self) -> bool:
        """True for a host-only request (``count: 0``): host CPU and memory on one node."""
        return self.count == 0

    @property
    def id_filtered(self) -> bool:
        """True when device ids must be checked one by one."""
        return self.allowed is not None or bool(self.avoided)


def share_on(
    memory_mib: int | None, memory_pct: int | None, compute_pct: int | None, total_mib: int
) -> tuple[int, int]:
    """Concrete (memory_mib, compute_pct) of a share on a device with ``total_mib`` of memory."""
    if memory_mib is not None:
        mem = memory_mib
    elif memory_pct is not None:
        mem = total_mib * memory_pct // 100
    else:
        # Compute-only shares get memory in proportion: a 25 % compute slice holds 25 % of memory.
        mem = total_mib * (compute_pct or 0) // 100
    return max(mem, 1), compute_pct or 0


def _lower(xs: list[str]) -> frozenset[str]:
    return frozenset(x.lower() for x in xs)


def class_matches(cls: DeviceClass, request: JobRequested) -> bool:
    """True when devices of ``cls`` satisfy every class-level selector of ``request``."""
    sel = request.selector
    if sel.vendor is not None and cls.vendor != sel.vendor.value:
        return False
    model = cls.model.lower()
    if sel.models and model not in _lower(sel.models):
        return False
    if sel.avoid_models and model in _lower(sel.avoid_models):
        return False
    if cls.memory_total_mib < sel.min_memory_mib or cls.capacity_units < sel.min_capacity:
        return False
    if sel.capabilities:
        caps = {c.lower() for c in cls.capabilities}
        if not all(c.lower() in caps for c in sel.capabilities):
            return False
    # A whole device is isolated by construction; only a shared slice needs enforced memory.
    if not is_hard_share(request):
        return True
    # MPS and HAMi-core limits (NVIDIA, Ascend) are cooperative and the other vendors' shares
    # have none: a hard share is a hardware partition (a MIG instance, a vNPU), taken whole,
    # with the memory asked for. A MIG-capable GPU not in MIG mode offers none.
    wanted = request.device.memory_mib or 0
    return cls.partition != "" and cls.memory_total_mib >= wanted


def is_hard_share(request: JobRequested) -> bool:
    """A share that must have its memory enforced by the hardware (``isolation: hard``)."""
    return request.selector.isolation is Isolation.HARD and not request.device.is_whole


def _scope(request: JobRequested) -> Scope:
    g = request.gang
    if g is None or request.count == 1:
        return "any" if request.count > 1 else "node"
    if g.same_node:
        return "node"
    return "domain" if g.same_domain else "any"


def make_demand(request: JobRequested, pool: WorkingPool) -> Demand:
    """Normalize ``request`` against ``pool`` (classes that match its selectors, device-id sets)."""
    sel = request.selector
    allowed: frozenset[int] | None = None
    if sel.device_ids:
        allowed = frozenset(
            i for i in (pool.dev_index.get(x) for x in sel.device_ids) if i is not None
        )
    avoided = frozenset(
        i for i in (pool.dev_index.get(x) for x in sel.avoid_device_ids) if i is not None
    )
    classes = (
        tuple(c.index for c in pool.classes if class_matches(c, request)) if request.count else ()
    )
    if allowed is not None:
        keep = {pool.dev_class[i] for i in allowed}
        classes = tuple(c for c in classes if c in keep)
    d = request.device
    whole = d.is_whole
    if is_hard_share(request):
        # The share becomes the smallest whole partition that holds it (the intent orders the
        # partition classes; class_matches admitted only those).
        whole = True
    return Demand(
        count=request.count,
        whole=whole,
        memory_mib=d.memory_mib,
        memory_pct=d.memory_pct,
        compute_pct=d.compute_pct,
        cpu_milli=request.host.cpu_milli,
        host_memory_mib=request.host.memory_mib,
        scope=_scope(request),
        gang=request.gang is not None and request.count > 1,
        intent=request.intent.value,
        classes=classes,
        allowed=allowed,
        avoided=avoided,
    )
