"""Which devices may serve a request, and whether it can ever be served at all.

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

from xpupool.contracts.payloads import DeviceDemand, DeviceSelector, Isolation, JobRequested
from xpupool.scheduler.domain.config import SchedulerConfig, default_config
from xpupool.scheduler.domain.model import PoolSnapshot
from xpupool.scheduler.domain.pool import DeviceClass, WorkingPool
from xpupool.scheduler.domain.reasons import Reason

__all__ = [
    "Demand",
    "Rejection",
    "Scope",
    "class_matches",
    "make_demand",
    "never_fits",
    "share_on",
    "validate_request",
]

Scope = Literal["node", "domain", "any"]
_NO_SELECTOR = DeviceSelector()


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a request can never be placed; ``field`` is the dotted path of the input to blame."""

    reason: Reason
    field: str | None
    detail: str


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
    return not (
        sel.isolation is Isolation.HARD and not request.device.is_whole and not cls.hard_isolation
    )


def validate_request(request: JobRequested, config: SchedulerConfig) -> Rejection | None:
    """Inputs that are malformed or name unknown priorities/queues, independent of the pool.

    A host-only request (``count: 0``) must ask for host CPU or memory and carry no device
    share, gang or selector.
    """
    dev: DeviceDemand = request.device
    if dev.memory_mib is not None and dev.memory_pct is not None:
        return Rejection(
            Reason.INVALID_REQUEST, "device.memory_pct", "give memory_mib or memory_pct, not both"
        )
    if request.count == 0:
        bad = _host_only_problem(request)
        if bad is not None:
            return bad
    if config.priority_value(request.priority) is None:
        return Rejection(
            Reason.UNKNOWN_PRIORITY,
            "priority",
            f"{request.priority!r} is not one of {', '.join(config.priority_classes)}",
        )
    if config.resolve_queue(request.tenant or "", request.queue) is None:
        return Rejection(
            Reason.UNKNOWN_QUEUE,
            "queue",
            f"no leaf queue {request.queue or request.tenant!r} for tenant {request.tenant!r}",
        )
    return None


def _host_only_problem(request: JobRequested) -> Rejection | None:
    """What is wrong with a host-only request (``count: 0``), if anything."""
    dev = request.device
    for name in ("memory_mib", "memory_pct", "compute_pct"):
        if getattr(dev, name) is not None:
            return Rejection(
                Reason.INVALID_REQUEST,
                f"device.{name}",
                "a host-only request (count 0) takes no device, so no device share",
            )
    if request.gang is not None:
        return Rejection(
            Reason.INVALID_REQUEST, "gang", "a host-only request (count 0) has no gang"
        )
    for name in DeviceSelector.__struct_fields__:
        if getattr(request.selector, name) != getattr(_NO_SELECTOR, name):
            return Rejection(
                Reason.INVALID_REQUEST,
                f"selector.{name}",
                "a host-only request (count 0) takes no device, so selects none",
            )
    if request.host.cpu_milli == 0 and request.host.memory_mib == 0:
        return Rejection(
            Reason.INVALID_REQUEST,
            "host",
            "a host-only request (count 0) must ask for host.cpu_milli or host.memory_mib",
        )
    return None


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
    return Demand(
        count=request.count,
        whole=d.is_whole,
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


def _usable(pool: WorkingPool, demand: Demand, i: int) -> bool:
    if pool.devices[i].health == "lost":
        return False
    if demand.allowed is not None and i not in demand.allowed:
        return False
    return i not in demand.avoided


def never_fits(
    request: JobRequested,
    pool: WorkingPool | PoolSnapshot,
    config: SchedulerConfig | None = None,
    demand: Demand | None = None,
) -> Rejection | None:
    """Why ``request`` can never be placed on this pool, even empty; ``None`` if it might.

    Checked against every registered device whatever its health or load (a device that is down
    now may come back): selectors matching nothing, unknown models or device ids, a share larger
    than any matching device, more devices than any node/domain/the pool has, host demand beyond
    any node, and (with ``config``) a demand above the queue's hard limits. A host-only request
    never fits when no node has that much CPU and memory in all.
    """
    if isinstance(pool, PoolSnapshot):
        pool = WorkingPool(pool, config or default_config())
    cfg = config or pool.config
    bad = validate_request(request, cfg)
    if bad is not None:
        return bad
    if request.count == 0:
        return _host_never_fits(request, pool)
    sel = request.selector
    if sel.models and not (_lower(sel.models) & pool.model_names):
        return Rejection(
            Reason.UNKNOWN_MODEL,
            "selector.models",
            f"no device of model {', '.join(sel.models)} is registered",
        )
    if sel.device_ids and not any(x in pool.dev_index for x in sel.device_ids):
        return Rejection(
            Reason.UNKNOWN_DEVICE, "selector.device_ids", "none of the named devices is registered"
        )
    dm = demand if demand is not None else make_demand(request, pool)
    if not dm.classes:
        return Rejection(
            Reason.NO_MATCHING_DEVICE, "selector", "no registered device matches the selectors"
        )

    # Each class fails at some stage; report the class that got closest to fitting.
    best: tuple[int, float, Rejection] | None = None

    def keep(stage: int, rej: Rejection, closeness: float = 0.0) -> None:
        nonlocal best
        if best is None or (stage, closeness) > best[:2]:
            best = (stage, closeness, rej)

    for ci in dm.classes:
        cls = pool.classes[ci]
        mem, _ = dm.share(cls)
        if mem > cls.memory_total_mib:
            keep(
                0,
                Rejection(
                    Reason.SHARE_TOO_LARGE,
                    "device.memory_mib",
                    f"asks {mem} MiB; a {cls.model} has {cls.memory_total_mib} MiB",
                ),
            )
            continue
        if dm.scope == "domain":
            largest = max(
                (
                    sum(1 for devs in nodes.values() for i in devs if _usable(pool, dm, i))
                    for nodes in pool.class_domains[ci].values()
                ),
                default=0,
            )
            if largest < dm.count:
                keep(
                    1,
                    Rejection(
                        Reason.EXCEEDS_DOMAIN_CAPACITY,
                        "count",
                        f"{dm.count} devices asked; the largest {cls.model} domain has {largest}",
                    ),
                    largest,
                )
                continue
        elif dm.scope == "any":
            total = sum(1 for i in pool.class_devs[ci] if _usable(pool, dm, i))
            if total < dm.count:
                keep(
                    1,
                    Rejection(
                        Reason.EXCEEDS_POOL_CAPACITY,
                        "count",
                        f"{dm.count} devices asked; the pool has {total} {cls.model}",
                    ),
                    total,
                )
                continue
        per_node = dm.count if dm.scope == "node" else 1
        largest_node = 0
        fits = False
        for ni, devs in pool.class_nodes[ci].items():
            n_usable = sum(1 for i in devs if _usable(pool, dm, i))
            largest_node = max(largest_node, n_usable)
            node = pool.nodes[ni]
            if (
                n_usable >= per_node
                and node.cpu_milli_total >= dm.cpu_milli
                and node.memory_mib_total >= dm.host_memory_mib
            ):
                fits = True
                break
        if not fits:
            if largest_node < per_node:
                keep(
                    1,
                    Rejection(
                        Reason.EXCEEDS_NODE_CAPACITY,
                        "count",
                        f"{dm.count} devices on one node asked; the largest {cls.model} "
                        f"node has {largest_node}",
                    ),
                    largest_node,
                )
            else:
                cpu_short = all(
                    pool.nodes[n].cpu_milli_total < dm.cpu_milli for n in pool.class_nodes[ci]
                )
                fld = "host.cpu_milli" if cpu_short else "host.memory_mib"
                keep(
                    2,
                    Rejection(
                        Reason.EXCEEDS_NODE_CAPACITY,
                        fld,
                        f"no {cls.model} node has the devices and that much host "
                        f"{'CPU' if cpu_short else 'memory'}",
                    ),
                )
            continue
        over = _over_limit(cfg, request, cls, dm)
        if over is not None:
            keep(3, over)
            continue
        return None
    assert best is not None
    rejection = best[2]
    if rejection.reason is Reason.EXCEEDS_POOL_CAPACITY and dm.scope == "any":
        return _one_model_rule(rejection, pool, dm)
    return rejection


def _one_model_rule(rejection: Rejection, pool: WorkingPool, dm: Demand) -> Rejection:
    """The rejection of a request that the pool could hold only by mixing models: it says so.

    Each request's devices are of one device class (one model), so that a job never sees two
    kinds of device in one visible-device list; the plain "the pool has 2 A100" hid that the
    pool holds more matching devices of other models."""
    counts: dict[str, int] = {}
    for ci in dm.classes:
        model = pool.classes[ci].model
        usable = sum(1 for i in pool.class_devs[ci] if _usable(pool, dm, i))
        counts[model] = counts.get(model, 0) + usable
    if sum(counts.values()) < dm.count or len(counts) < 2:
        return rejection
    have = ", ".join(f"{n} {m}" for m, n in sorted(counts.items(), key=lambda kv: -kv[1]))
    return Rejection(
        Reason.EXCEEDS_POOL_CAPACITY,
        "count",
        f"{dm.count} devices asked; a request takes all its devices of one model and no "
        f"matching model has {dm.count} (the pool has {have}): ask for fewer per request",
    )


def _host_never_fits(request: JobRequested, pool: WorkingPool) -> Rejection | None:
    """A host-only request fits some day when one node has that much CPU and memory in all."""
    cpu, mem = request.host.cpu_milli, request.host.memory_mib
    nodes = pool.nodes
    if any(n.cpu_milli_total >= cpu and n.memory_mib_total >= mem for n in nodes):
        return None
    cpu_short = all(n.cpu_milli_total < cpu for n in nodes)
    return Rejection(
        Reason.EXCEEDS_NODE_CAPACITY,
        "host.cpu_milli" if cpu_short else "host.memory_mib",
        f"no node has {cpu} mCPU and {mem} MiB of host memory"
        if nodes
        else "no node is registered",
    )


def _over_limit(
    cfg: SchedulerConfig, request: JobRequested, cls: DeviceClass, dm: Demand
) -> Rejection | None:
    queue = cfg.resolve_queue(request.tenant or "", request.queue)
    if queue is None:
        return None
    mem, compute = dm.share(cls)
    frac = 1.0 if dm.whole else max(compute / 100.0, mem / (cls.memory_total_mib or 1))
    devices = frac * dm.count
    units = devices * cls.capacity_units
    for qname in cfg.path(queue):
        q = cfg.queue(qname)
        if q is None:
            continue
        if q.limit_units is not None and units > q.limit_units + 1e-9:
            return Rejection(
                Reason.EXCEEDS_QUOTA_LIMIT,
                "count",
                f"{units:g} units asked; queue {qname!r} is limited to {q.limit_units:g}",
            )
        lim = q.limit_devices.get(cls.model)
        if lim is not None and devices > lim + 1e-9:
            return Rejection(
                Reason.EXCEEDS_QUOTA_LIMIT,
                "count",
                f"{devices:g} {cls.model} asked; queue {qname!r} is limited to {lim:g}",
            )
    return None
