"""Whether a request can ever be served at all, and what is wrong with one that cannot.

The demand itself (a request normalized against the pool) is ``xpupool.placement.demand``; this
module adds what is scheduling rather than placement: validation against the operator's
priorities and queues, hard quota limits, and the precise rejection of a request the pool could
never hold.
"""

from __future__ import annotations

from dataclasses import dataclass

from xpupool.contracts.payloads import DeviceDemand, DeviceSelector, JobRequested
from xpupool.placement.demand import Demand, make_demand
from xpupool.placement.inventory import PoolSnapshot
from xpupool.placement.pool import DeviceClass, WorkingPool
from xpupool.scheduler.domain.config import SchedulerConfig, config_of, default_config
from xpupool.scheduler.domain.reasons import Reason

__all__ = ["Rejection", "never_fits", "validate_request"]

_NO_SELECTOR = DeviceSelector()


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a request can never be placed; ``field`` is the dotted path of the input to blame."""

    reason: Reason
    field: str | None
    detail: str


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
    cfg = config or config_of(pool)
    bad = validate_request(request, cfg)
    if bad is not None:
        return bad
    if request.count == 0:
        return _host_never_fits(request, pool)
    sel = request.selector
    if sel.models and not ({m.lower() for m in sel.models} & pool.model_names):
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
        if not q.over_quota:
            # A queue that may not borrow stops at its guarantee (``quota._within_guarantee``:
            # its guarantee for the model where it has one, else its units guarantee), so a
            # demand beyond it would wait quota_exhausted for ever.
            guaranteed = q.guaranteed_devices.get(cls.model)
            if guaranteed is not None and devices > guaranteed + 1e-9:
                return Rejection(
                    Reason.EXCEEDS_QUOTA_LIMIT,
                    "count",
                    f"{devices:g} {cls.model} asked; queue {qname!r} may not borrow beyond "
                    f"its guarantee of {guaranteed:g}",
                )
            if guaranteed is None and units > q.guaranteed_units + 1e-9:
                return Rejection(
                    Reason.EXCEEDS_QUOTA_LIMIT,
                    "count",
                    f"{units:g} units asked; queue {qname!r} may not borrow beyond its "
                    f"guarantee of {q.guaranteed_units:g}",
                )
    return None
