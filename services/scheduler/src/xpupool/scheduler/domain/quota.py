"""Queue quotas: guaranteed vs limit, borrowing of idle capacity, and what reclaim may take back.

Accounting is in normalized capacity units (A100 = 1.0) and, per device model, in devices (a
share counts as the fraction of the device it takes). A queue's usage includes its whole subtree.

* **Limit**: a hard ceiling at every level of the tree (units, and devices per model when set).
* **Guarantee**: what a queue may always get back. For a request on model *m*, the queue's
  per-model guarantee decides when one is configured for *m*; otherwise the units guarantee.
* **Borrowing**: with ``over_quota: true`` (the default) a queue may go past its guarantee, up to
  its limit, on capacity that is idle. With ``over_quota: false`` it stops at its guarantee.
* **Reclaim**: within each leaf queue, leases are ranked by priority (high first) then age (old
  first); those that fit in the guarantee are in-quota, the rest are *over-quota* (borrowed) and
  are the first victims when an in-quota request of another queue needs its capacity back.
* **Host-only** requests (``count: 0``) take no device and no capacity unit: every quota admits
  them, and their leases are never borrowed capacity (never reclaimed by other queues).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from xpupool.placement.demand import Demand
from xpupool.placement.pool import Usage, WorkingPool
from xpupool.scheduler.domain.config import QueueConfig, SchedulerConfig

__all__ = [
    "QueueStatus",
    "QuotaVerdict",
    "below_guarantee",
    "check_quota",
    "check_quotas",
    "demand_footprint",
    "mark_over_quota",
    "refresh_over_quota",
    "queue_status",
]

_EPS = 1e-9


@dataclass(frozen=True, slots=True)
class QuotaVerdict:
    """Whether a demand on one device class may be admitted by the queue tree now."""

    allowed: bool
    in_quota: bool
    """True when it stays within the leaf queue's guarantee (so it may reclaim borrowed units)."""
    blocking_queue: str = ""
    detail: str = ""


@dataclass(frozen=True, slots=True)
class QueueStatus:
    """A queue's usage against its quota, for ``xpupool explain`` and metrics."""

    name: str
    units: float
    guaranteed_units: float
    limit_units: float | None
    devices_by_model: dict[str, float]
    borrowing: bool


def demand_footprint(pool: WorkingPool, demand: Demand, ci: int) -> tuple[float, float]:
    """(units, devices) ``demand`` would take on class ``ci``; nothing for a host-only one."""
    if demand.host_only or ci < 0:
        return 0.0, 0.0
    cls = pool.classes[ci]
    if demand.whole:
        frac = 1.0
    else:
        mem, compute = demand.share(cls)
        frac = max(compute / 100.0, mem / max(cls.memory_total_mib, 1))
    devices = frac * demand.count
    return devices * cls.capacity_units, devices


def _within_guarantee(q: QueueConfig, units: float, model: str, model_devices: float) -> bool:
    g = q.guaranteed_devices.get(model)
    if g is not None:
        return model_devices <= g + _EPS
    return q.guaranteed_units > 0 and units <= q.guaranteed_units + _EPS


def check_quota(
    pool: WorkingPool, config: SchedulerConfig, queue: str, demand: Demand, ci: int
) -> QuotaVerdict:
    """May ``queue`` take ``demand`` on class ``ci`` given what it and its ancestors hold now?

    A host-only demand uses no quota: always allowed, and in quota.
    """
    return check_quotas(pool, config, queue, demand, (ci,))[ci]


def check_quotas(
    pool: WorkingPool,
    config: SchedulerConfig,
    queue: str,
    demand: Demand,
    classes: Iterable[int],
) -> dict[int, QuotaVerdict]:
    """``check_quota`` for each of ``classes``: the queue's path up the tree, its queues and
    their usage are looked up once for all of them."""
    if demand.host_only:
        return {ci: QuotaVerdict(True, True) for ci in classes}
    path = [
        (i, qname, q, pool.usage.get(qname))
        for i, qname in enumerate(config.path(queue))
        if (q := config.queue(qname)) is not None
    ]
    return {ci: _verdict(pool, demand, ci, path) for ci in classes}


def _verdict(
    pool: WorkingPool,
    demand: Demand,
    ci: int,
    path: Sequence[tuple[int, str, QueueConfig, Usage | None]],
) -> QuotaVerdict:
    units, devices = demand_footprint(pool, demand, ci)
    model = pool.classes[ci].model
    in_quota = False
    for i, qname, q, u in path:
        new_units = (u.units if u else 0.0) + units
        new_model = (u.by_model.get(model, 0.0) if u else 0.0) + devices
        if q.limit_units is not None and new_units > q.limit_units + _EPS:
            return QuotaVerdict(
                False,
                False,
                qname,
                f"queue {qname!r} would hold {new_units:g} of its {q.limit_units:g}-unit limit",
            )
        lim = q.limit_devices.get(model)
        if lim is not None and new_model > lim + _EPS:
            return QuotaVerdict(
                False,
                False,
                qname,
                f"queue {qname!r} would hold {new_model:g} {model} of its limit {lim:g}",
            )
        within = _within_guarantee(q, new_units, model, new_model)
        if i == 0:
            in_quota = within
        if not q.over_quota and not within:
            return QuotaVerdict(
                False, False, qname, f"queue {qname!r} is at its guarantee and may not borrow"
            )
    return QuotaVerdict(True, in_quota)


def below_guarantee(pool: WorkingPool, config: SchedulerConfig, queue: str) -> bool:
    """True while the leaf ``queue`` holds less than some guarantee of its own (ordering hint)."""
    q = config.queue(queue)
    if q is None:
        return False
    u = pool.usage.get(queue)
    if u is None:
        return q.guaranteed_units > 0 or bool(q.guaranteed_devices)
    if q.guaranteed_units > 0 and u.units < q.guaranteed_units - _EPS:
        return True
    return any(u.by_model.get(m, 0.0) < g - _EPS for m, g in q.guaranteed_devices.items())


def mark_over_quota(pool: WorkingPool, config: SchedulerConfig) -> set[str]:
    """Flag every lease in-quota or over-quota (see the module doc); return the over-quota ids."""
    pool.quota_marked_for = None
    refresh_over_quota(pool, config)
    return {lid for lid, pl in pool.leases.items() if pl.over_quota}


def refresh_over_quota(pool: WorkingPool, config: SchedulerConfig) -> None:
    """Flag leases in-quota or over-quota, re-marking only queues whose leases changed since the
    last marking with this ``config`` (a queue's flags depend on its own leases only)."""
    fresh = pool.quota_marked_for is config
    queues = pool.quota_stale if fresh else set(pool.queue_leases)
    for qname in queues:
        q = config.queue(qname)
        held = pool.queue_leases.get(qname, set())
        if fresh and not _guaranteed(q):
            # Flags here depend on each lease alone: re-marking every lease the queue holds
            # after each grant made a decision O(leases), the scheduler path's tail.
            held = held & pool.quota_added.get(qname, set())
        _mark_queue(pool, q, held)
    pool.quota_stale = set()
    pool.quota_added = {}
    pool.quota_marked_for = config


def _guaranteed(q: QueueConfig | None) -> bool:
    return q is not None and (q.guaranteed_units > 0 or bool(q.guaranteed_devices))


def _mark_queue(pool: WorkingPool, q: QueueConfig | None, lease_ids: set[str]) -> None:
    leases = pool.leases
    if q is None or not _guaranteed(q):
        # No guarantee: every device lease is borrowed capacity, whatever the order.
        for lid in lease_ids:
            pl = leases[lid]
            pl.over_quota = bool(pl.state.slices)
        return
    lids = sorted(
        lease_ids, key=lambda x: (-leases[x].state.priority, leases[x].state.started_at_s, x)
    )
    units = 0.0
    models: dict[str, float] = {}
    for lid in lids:
        pl = leases[lid]
        if not pl.state.slices:
            pl.over_quota = False  # host-only: it borrowed nothing to reclaim
            continue
        ok = bool(pl.by_model) and all(
            _within_guarantee(q, units + pl.units, m, models.get(m, 0.0) + n)
            for m, n in pl.by_model.items()
        )
        pl.over_quota = not ok
        if ok:
            units += pl.units
            for m, n in pl.by_model.items():
                models[m] = models.get(m, 0.0) + n


def queue_status(pool: WorkingPool, config: SchedulerConfig) -> list[QueueStatus]:
    """Usage against quota of every configured or used queue."""
    names = sorted(set(config.queues) | set(pool.usage))
    out = []
    for n in names:
        q = config.queue(n)
        u = pool.usage.get(n)
        units = u.units if u else 0.0
        g = q.guaranteed_units if q else 0.0
        out.append(
            QueueStatus(
                name=n,
                units=units,
                guaranteed_units=g,
                limit_units=q.limit_units if q else None,
                devices_by_model=dict(u.by_model) if u else {},
                borrowing=units > g + _EPS,
            )
        )
    return out
