"""The working pool's incremental indexes (ending leases, priorities per queue, leases added since
the last quota marking) agree with a full pass over the leases after any sequence of changes, and
the shortcuts ``decide`` takes from them change no decision."""

from __future__ import annotations

import random

from domain_builders import job, lease, node, snapshot

from xpupool.placement.inventory import LeaseState
from xpupool.scheduler.domain import (
    Preempt,
    QueueConfig,
    Wait,
    WorkingPool,
    decide,
    default_config,
)
from xpupool.scheduler.domain.config import SchedulerConfig, with_queues
from xpupool.scheduler.domain.decide import _no_victims
from xpupool.scheduler.domain.preemption import can_preempt
from xpupool.scheduler.domain.quota import mark_over_quota, refresh_over_quota

QUEUES = ("A", "B", "C")  # A guaranteed, B unguaranteed, C not configured at all


def _config() -> SchedulerConfig:
    return with_queues(
        default_config(),
        QueueConfig(name="A", guaranteed_units=3.0),
        QueueConfig(name="B"),
    )


def _random_lease(rng: random.Random, i: int, devices: list[str]) -> LeaseState:
    return lease(
        f"l{i}",
        devices,
        tenant="t",
        queue=rng.choice(QUEUES),
        priority=rng.choice((100, 500, 900)),
        started=float(rng.randrange(100)),
        terminating=rng.random() < 0.2,
    )


def test_indexes_and_incremental_quota_flags_match_a_full_pass_after_random_changes() -> None:
    cfg = _config()
    for seed in range(20):
        rng = random.Random(seed)
        pool = WorkingPool(snapshot(node("n", "A100", 16)), cfg)
        free = [f"n/{k}" for k in range(16)]
        released = []
        for step in range(60):
            roll = rng.random()
            if roll < 0.5 and free:
                dev = free.pop(rng.randrange(len(free)))
                pool.add_lease(_random_lease(rng, step, [dev]))
            elif roll < 0.8 and pool.leases:
                lid = rng.choice(sorted(pool.leases))
                pl = pool.release(lid)
                assert pl is not None
                released.append(pl)
                free.extend(s.device_id for s in pl.state.slices)
            elif released:
                pl = released.pop()
                if all(s.device_id in free for s in pl.state.slices):
                    for s in pl.state.slices:
                        free.remove(s.device_id)
                    pool.restore(pl)
            if rng.random() < 0.5:
                refresh_over_quota(pool, cfg)
                incremental = {lid: pl.over_quota for lid, pl in pool.leases.items()}
                mark_over_quota(pool, cfg)
                assert incremental == {lid: pl.over_quota for lid, pl in pool.leases.items()}
            assert pool.terminating == {
                lid for lid, pl in pool.leases.items() if pl.state.terminating
            }
            for q in QUEUES:
                counts: dict[int, int] = {}
                for lid in pool.queue_leases.get(q, set()):
                    p = pool.leases[lid].state.priority
                    counts[p] = counts.get(p, 0) + 1
                assert pool.queue_priorities.get(q, {}) == counts


def test_no_victims_only_when_no_lease_may_be_preempted() -> None:
    """Whenever the shortcut skips the preemption plan, no lease passes ``can_preempt``; it
    skips it too for a request out of quota while other queues hold leases of no lower
    priority (a busy pool's usual case: the plan used to pass over every lease for nothing)."""
    cfg = _config()
    skipped = beside_other_queues = 0
    for seed in range(80):
        rng = random.Random(seed)
        queues = rng.sample(QUEUES, rng.randint(1, 2))
        leases = tuple(
            lease(
                f"l{k}",
                [f"n/{k}"],
                tenant="t",
                queue=rng.choice(queues),
                priority=rng.choice((100, 500, 900)),
            )
            for k in range(rng.randint(0, 6))
        )
        pool = WorkingPool(snapshot(node("n", "A100", 8), leases=leases), cfg)
        refresh_over_quota(pool, cfg)
        queue, priority = rng.choice(QUEUES), rng.choice((100, 500, 900))
        for in_quota in (False, True):
            if not _no_victims(pool, queue, priority, in_quota):
                continue
            skipped += 1
            others = any(lids for q, lids in pool.queue_leases.items() if q != queue)
            beside_other_queues += others and not in_quota
            assert not any(
                can_preempt(
                    pl,
                    queue=queue,
                    priority=priority,
                    in_quota=in_quota,
                    config=cfg,
                    now_s=pool.now_s,
                    ignore_min_runtime=True,
                )
                for pl in pool.leases.values()
            )
    assert skipped > 0 and beside_other_queues > 0


def test_a_full_pool_still_preempts_a_lower_priority_lease_of_its_queue() -> None:
    leases = tuple(lease(f"l{k}", [f"n/{k}"], priority=500, started=100) for k in range(4))
    snap = snapshot(node("n", "A100", 4), leases=leases)
    assert isinstance(decide(job("hi", priority="high"), snap), Preempt)
    assert isinstance(decide(job("same"), snap), Wait)
