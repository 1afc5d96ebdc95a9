"""Quotas: limits, guarantees, borrowing, reclaim, hierarchy."""

from __future__ import annotations

from domain_builders import job, lease, node, snapshot

from xpupool.contracts.payloads import Intent
from xpupool.scheduler.domain import (
    Preempt,
    QueueConfig,
    Reason,
    Reserve,
    Wait,
    WorkingPool,
    decide,
    default_config,
    queue_status,
)
from xpupool.scheduler.domain.config import with_queues
from xpupool.scheduler.domain.quota import mark_over_quota, refresh_over_quota

OLD = 0.0  # leases started long before now (10,000 s), past the minimum runtime


def two_queues(**a_kw):
    return with_queues(
        default_config(),
        QueueConfig(name="A", guaranteed_units=2.0, **a_kw),
        QueueConfig(name="B", guaranteed_units=2.0),
    )


def a_leases(n: int, start: int = 0):
    return tuple(
        lease(f"a{i}", [f"n/{i}"], tenant="ta", queue="A", started=OLD + i)
        for i in range(start, start + n)
    )


def test_limit_units_blocks_with_quota_exhausted():
    """A queue at its unit limit waits with quota_exhausted even though devices are free."""
    cfg = with_queues(default_config(), QueueConfig(name="A", limit_units=3.0))
    snap = snapshot(node("n", "A100", 8), leases=a_leases(3))
    d = decide(job("j", tenant="ta", queue="A"), snap, cfg)
    assert isinstance(d, Wait) and d.reason is Reason.QUOTA_EXHAUSTED and "'A'" in d.detail


def test_per_model_device_limit_falls_back_to_other_class():
    """A per-model device limit stops that model but the request may take another class."""
    cfg = with_queues(default_config(), QueueConfig(name="A", limit_devices={"A100": 1}))
    snap = snapshot(
        node("n", "A100", 4),
        node("m", "910B", 4),
        leases=(lease("a0", ["n/0"], tenant="ta", queue="A"),),
    )
    d = decide(job("j", tenant="ta", queue="A", intent=Intent.FASTEST), snap, cfg)
    assert isinstance(d, Reserve) and d.slices[0].model == "910B"
    d = decide(job("j", tenant="ta", queue="A", models=["A100"]), snap, cfg)
    assert isinstance(d, Wait) and d.reason is Reason.QUOTA_EXHAUSTED


def test_borrowing_idle_capacity_beyond_guarantee():
    """With over_quota on, a queue borrows idle devices beyond its guarantee (not in-quota)."""
    snap = snapshot(node("n", "A100", 4), leases=a_leases(2))
    d = decide(job("j", tenant="ta", queue="A"), snap, two_queues())
    assert isinstance(d, Reserve) and not d.in_quota
    d = decide(job("j", tenant="tb", queue="B"), snap, two_queues())
    assert isinstance(d, Reserve) and d.in_quota


def test_no_borrowing_when_over_quota_disabled():
    """With over_quota off, a queue stops at its guarantee."""
    snap = snapshot(node("n", "A100", 4), leases=a_leases(2))
    d = decide(job("j", tenant="ta", queue="A"), snap, two_queues(over_quota=False))
    assert isinstance(d, Wait) and d.reason is Reason.QUOTA_EXHAUSTED


def test_over_quota_leases_are_the_youngest_lowest_priority():
    """Leases beyond the guarantee are the low-priority, young ones of the queue."""
    leases = (
        lease("old-normal", ["n/0"], tenant="ta", queue="A", started=1),
        lease("young-normal", ["n/1"], tenant="ta", queue="A", started=50),
        lease("young-high", ["n/2"], tenant="ta", queue="A", priority=900, started=60),
    )
    pool = WorkingPool(snapshot(node("n", "A100", 4), leases=leases), two_queues())
    assert mark_over_quota(pool, pool.config) == {"young-normal"}


def test_reclaim_takes_back_borrowed_capacity():
    """An in-quota request of B preempts A's youngest over-quota lease, not A's in-quota ones."""
    snap = snapshot(node("n", "A100", 4), leases=a_leases(4))
    d = decide(job("j", tenant="tb", queue="B"), snap, two_queues())
    assert isinstance(d, Preempt) and d.victims == ("a3",)
    assert d.reserve.in_quota


def test_no_reclaim_of_in_quota_leases():
    """A request cannot take another queue's in-quota capacity, whatever its priority."""
    b = tuple(lease(f"b{i}", [f"n/{i + 2}"], tenant="tb", queue="B", started=OLD) for i in range(2))
    snap = snapshot(node("n", "A100", 4), leases=a_leases(2) + b)
    cfg = with_queues(two_queues(), QueueConfig(name="C"))
    d = decide(job("j", tenant="tc", queue="C", priority="critical"), snap, cfg)
    assert isinstance(d, Wait) and d.reason is Reason.INSUFFICIENT_CAPACITY


def test_hierarchical_parent_limit():
    """A parent's limit caps the sum of its children."""
    cfg = with_queues(
        default_config(),
        QueueConfig(name="org", limit_units=2.0),
        QueueConfig(name="c1", parent="org"),
        QueueConfig(name="c2", parent="org"),
    )
    snap = snapshot(
        node("n", "A100", 4),
        leases=tuple(lease(f"l{i}", [f"n/{i}"], tenant="x", queue="c1") for i in range(2)),
    )
    d = decide(job("j", tenant="y", queue="c2"), snap, cfg)
    assert isinstance(d, Wait) and d.reason is Reason.QUOTA_EXHAUSTED and "'org'" in d.detail


def test_quota_in_normalized_units_across_vendors():
    """Units make quotas comparable: a 2-unit limit admits two A100s or eight T4s, not nine."""
    cfg = with_queues(default_config(), QueueConfig(name="A", limit_units=2.0))
    snap = snapshot(
        node("t", "T4", 9),
        leases=tuple(lease(f"l{i}", [f"t/{i}"], tenant="ta", queue="A") for i in range(8)),
    )
    d = decide(job("j", tenant="ta", queue="A"), snap, cfg)
    assert isinstance(d, Wait) and d.reason is Reason.QUOTA_EXHAUSTED
    status = {s.name: s for s in queue_status(WorkingPool(snap, cfg), cfg)}
    assert abs(status["A"].units - 2.0) < 1e-9 and status["A"].devices_by_model == {"T4": 8.0}


def test_share_counts_as_fraction_in_quota():
    """A share counts as the fraction of the device it takes (max of memory and compute)."""
    cfg = with_queues(default_config(), QueueConfig(name="A", limit_units=1.0))
    snap = snapshot(
        node("n", "A100", 2),
        leases=(lease("l", ["n/0"], tenant="ta", queue="A", share=(40960, 30)),),
    )
    assert isinstance(decide(job("j", tenant="ta", queue="A", memory_pct=50), snap, cfg), Reserve)
    d = decide(job("j", tenant="ta", queue="A", memory_pct=60), snap, cfg)
    assert isinstance(d, Wait) and d.reason is Reason.QUOTA_EXHAUSTED


def test_refreshing_over_quota_flags_re_marks_only_what_changed_and_matches_a_full_mark():
    """After leases come and go, the incremental refresh leaves every flag as a full marking of
    the same pool would (a queue's flags depend on its own leases only)."""
    leases = (
        lease("old-normal", ["n/0"], tenant="ta", queue="A", started=1),
        lease("young-normal", ["n/1"], tenant="ta", queue="A", started=50),
        lease("b0", ["n/4"], tenant="tb", queue="B", started=5),
    )
    cfg = two_queues()
    pool = WorkingPool(snapshot(node("n", "A100", 8), leases=leases), cfg)
    refresh_over_quota(pool, cfg)
    assert not pool.quota_stale
    high = lease("young-high", ["n/2"], tenant="ta", queue="A", priority=900, started=60)
    pool.add_lease(high)
    pool.release("old-normal")
    assert pool.quota_stale == {"A"}
    refresh_over_quota(pool, cfg)
    flags = {lid: pl.over_quota for lid, pl in pool.leases.items()}
    # young-high now takes the guarantee before young-normal; both fit in 2 units.
    assert flags == {"young-normal": False, "young-high": False, "b0": False}
    pool.add_lease(lease("a9", ["n/3"], tenant="ta", queue="A", started=70))
    refresh_over_quota(pool, cfg)
    flags = {lid: pl.over_quota for lid, pl in pool.leases.items()}
    assert flags == {"young-normal": False, "young-high": False, "b0": False, "a9": True}
    assert mark_over_quota(pool, cfg) == {"a9"}
    assert {lid: pl.over_quota for lid, pl in pool.leases.items()} == flags
