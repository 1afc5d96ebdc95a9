"""Placing a new request past waiting jobs (``domain.passing``): only where none could go."""

from __future__ import annotations

from domain_builders import job, node, snapshot

from xpupool.contracts.payloads import GangSpec
from xpupool.scheduler.domain import (
    QueueConfig,
    Reserve,
    SchedulerConfig,
    WorkingPool,
    decide,
    default_config,
)
from xpupool.scheduler.domain.config import with_queues
from xpupool.scheduler.domain.passing import WaitingJudgement, contested_by


def _pool(config: SchedulerConfig) -> WorkingPool:
    """Eight A100s on ``big``, two A100s on ``small``, four T4s on ``t4``."""
    return WorkingPool(
        snapshot(node("big", "A100", 8), node("small", "A100", 2), node("t4", "T4", 4)), config
    )


def _nodes(pool: WorkingPool, indices: frozenset[int]) -> set[str]:
    return {pool.nodes[i].node_id for i in indices}


def _reserve_on(pool: WorkingPool, config: SchedulerConfig, node_id: str, **kw: object) -> Reserve:
    """What a request pinned to ``node_id``'s first device is decided (to test a placement
    there), as a cycle or an arrival would decide it."""
    decision = decide(job("arrival", device_ids=[f"{node_id}/0"], **kw), pool, config)
    assert isinstance(decision, Reserve), decision
    return decision


def test_a_waiting_job_contests_the_nodes_its_selectors_accept() -> None:
    config = default_config()
    pool = _pool(config)
    t4_only = contested_by([job("w", models=["T4"])], pool, config)
    assert _nodes(pool, t4_only.nodes) == {"t4"} and not t4_only.host_anywhere
    anything = contested_by([job("w")], pool, config)
    assert _nodes(pool, anything.nodes) == {"big", "small", "t4"}
    pinned = contested_by([job("w", device_ids=["small/1"])], pool, config)
    assert _nodes(pool, pinned.nodes) == {"small"}


def test_a_gang_on_one_node_contests_only_nodes_that_could_hold_it() -> None:
    """Eight devices on one node: only ``big`` could ever hold the gang; four on one node:
    ``big`` and ``t4``; a gang across nodes could use any node with one device."""
    config = default_config()
    pool = _pool(config)
    eight = contested_by([job("w", count=8, gang=GangSpec(same_node=True))], pool, config)
    assert _nodes(pool, eight.nodes) == {"big"}
    four = contested_by([job("w", count=4, gang=GangSpec(same_node=True))], pool, config)
    assert _nodes(pool, four.nodes) == {"big", "t4"}
    spread = contested_by([job("w", count=4, gang=GangSpec(same_node=False))], pool, config)
    assert _nodes(pool, spread.nodes) == {"big", "small", "t4"}


def test_a_waiting_request_without_devices_contests_every_nodes_host_resources() -> None:
    config = default_config()
    pool = _pool(config)
    judged = WaitingJudgement(7, config, [job("cpu-only", count=0, cpu_milli=4000)])
    assert judged.contested(pool).host_anywhere and not judged.contested(pool).nodes
    assert judged.may_pass(_reserve_on(pool, config, "t4"), pool, config)
    with_host = _reserve_on(pool, config, "t4", cpu_milli=1000)
    assert not judged.may_pass(with_host, pool, config)


def test_an_arrival_passes_only_where_no_waiting_job_could_go() -> None:
    """A whole-node gang of A100s waits: a T4 placement and one on the two-A100 node pass it
    (the gang can never go there), one on the eight-A100 node does not, nor does one whose
    host charge lands there."""
    config = default_config()
    pool = _pool(config)
    judged = WaitingJudgement(3, config, [job("gang", count=8, gang=GangSpec(same_node=True))])
    assert judged.may_pass(_reserve_on(pool, config, "t4"), pool, config)
    assert judged.may_pass(_reserve_on(pool, config, "small", cpu_milli=500), pool, config)
    assert not judged.may_pass(_reserve_on(pool, config, "big"), pool, config)
    # Decided with another config (a reload since the cycle): nothing is judged for it.
    other = default_config()
    assert not judged.may_pass(_reserve_on(pool, other, "t4"), pool, other)


def test_an_arrival_charging_a_limited_queue_a_waiting_job_charges_does_not_pass() -> None:
    """Quota a waiting job could need: a queue with a limit on both jobs' paths. A queue
    without a limit, or one the waiting job does not charge, is no obstacle."""
    config = with_queues(
        default_config(),
        QueueConfig(name="limited", limit_units=4.0),
        QueueConfig(name="free"),
    )
    pool = _pool(config)
    judged = WaitingJudgement(
        1, config, [job("w", tenant="a", queue="limited", models=["T4"], count=1)]
    )
    assert judged.contested(pool).queues == frozenset({"limited"})
    same = _reserve_on(pool, config, "small", tenant="b", queue="limited")
    assert not judged.may_pass(same, pool, config)
    elsewhere = _reserve_on(pool, config, "small", tenant="b", queue="free")
    assert judged.may_pass(elsewhere, pool, config)


def test_a_judgement_takes_in_a_wait_that_came_right_after_and_no_other() -> None:
    config = default_config()
    pool = _pool(config)
    judged = WaitingJudgement(5, config, [job("t4-only", models=["T4"])])
    assert _nodes(pool, judged.contested(pool).nodes) == {"t4"}
    grown = judged.extended(job("gang", count=8, gang=GangSpec(same_node=True)), 6)
    assert grown is not None and grown.seq == 6
    assert _nodes(pool, grown.contested(pool).nodes) == {"t4", "big"}
    assert contested_by(grown.requests, pool, config) == grown.contested(pool)
    # Someone else's wait (sequence 6) came between: no judgement until a cycle reads again.
    assert judged.extended(job("late"), 7) is None


def test_with_nothing_waiting_every_placement_passes() -> None:
    """A cycle that left nothing waiting judges an empty queue: arrivals pass (the ledger
    still refuses them once a job starts waiting)."""
    config = default_config()
    pool = _pool(config)
    judged = WaitingJudgement(9, config, [])
    assert judged.may_pass(_reserve_on(pool, config, "big", cpu_milli=500), pool, config)
