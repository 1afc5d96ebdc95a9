"""Policy edges where preemption, quotas, priorities and device classes interact."""

from __future__ import annotations

from dataclasses import replace

from domain_builders import job, lease, node, snapshot
from hypothesis import given, settings
from hypothesis import strategies as st

from xpupool.contracts.payloads import GangSpec, JobRequested
from xpupool.placement.inventory import LeaseSlice, LeaseState, NodeState
from xpupool.scheduler.domain import (
    PendingRequest,
    Preempt,
    QueueConfig,
    Reason,
    Reserve,
    Wait,
    WorkingPool,
    decide,
    decide_batch,
    default_config,
)
from xpupool.scheduler.domain.config import SchedulerConfig, StarvationConfig, with_queues
from xpupool.scheduler.domain.quota import refresh_over_quota

NOW = 10_000.0


def _guaranteed_on_a100_only() -> SchedulerConfig:
    """Queue ``q`` is guaranteed two A100 and nothing else; ``b`` borrows; ``c`` is guaranteed a
    unit."""
    return with_queues(
        default_config(),
        QueueConfig(name="q", guaranteed_devices={"A100": 2.0}),
        QueueConfig(name="b"),
        QueueConfig(name="c", guaranteed_units=1.0),
    )


def test_a_request_in_quota_on_one_model_reclaims_nothing_on_another() -> None:
    """A request that its queue's guarantee covers on A100 only does not reclaim a borrowed
    high-priority T4 lease of another queue to run on that T4, where it would itself borrow:
    it waits (the A100 is held within another queue's guarantee)."""
    cfg = _guaranteed_on_a100_only()
    snap = snapshot(
        node("t", "T4", 1),
        node("a", "A100", 1),
        leases=(
            lease("b-t4", ["t/0"], tenant="b", queue="b", priority=900, started=100),
            lease("c-a100", ["a/0"], tenant="c", queue="c", priority=500, started=100),
        ),
        now=NOW,
    )
    d = decide(job("j", tenant="q"), snap, cfg)  # normal priority, no model asked: T4 first
    assert isinstance(d, Wait), d
    # Where its guarantee covers it (an A100 borrowed by b), it does reclaim.
    snap = snapshot(
        node("t", "T4", 1),
        node("a", "A100", 1),
        leases=(
            lease("b-t4", ["t/0"], tenant="b", queue="b", priority=900, started=100),
            lease("b-a100", ["a/0"], tenant="b", queue="b", priority=900, started=100),
        ),
        now=NOW,
    )
    d = decide(job("j", tenant="q"), snap, cfg)
    assert isinstance(d, Preempt) and d.victims == ("b-a100",), d
    assert d.reserve.in_quota and d.reserve.slices[0].model == "A100"


def test_a_units_guarantee_met_only_by_a_class_too_small_reclaims_nothing_elsewhere() -> None:
    """A two-device request of a queue guaranteed one unit is in quota on T4 (half a unit) but
    the pool has one T4: on A100 (two units) it would borrow, so it does not reclaim a borrowed
    lease of another queue that its priority would not take."""
    cfg = with_queues(
        default_config(), QueueConfig(name="qa", guaranteed_units=1.0), QueueConfig(name="qb")
    )
    snap = snapshot(
        node("t", "T4", 1),
        node("a", "A100", 2),
        leases=(lease("qb-low", ["a/1"], tenant="qb", queue="qb", priority=100, started=0),),
        now=NOW,
    )
    d = decide(job("j", tenant="qa", count=2, priority="low"), snap, cfg)
    assert isinstance(d, Wait) and d.reason is Reason.INSUFFICIENT_CAPACITY, d


def test_reclaim_does_not_start_a_preemption_ping_pong_between_two_queues() -> None:
    """Queue q reclaims on the class it is in quota on and nowhere else, so the lease it gets is
    in quota and the victim's queue, asking again at its higher priority once the minimum run
    time has passed, cannot take it back (and so on, for ever)."""
    cfg = _guaranteed_on_a100_only()
    nodes = (node("t", "T4", 1), node("a", "A100", 1))
    c_lease = lease("c-a100", ["a/0"], tenant="c", queue="c", priority=500, started=100)
    snap = snapshot(
        *nodes,
        leases=(lease("b-t4", ["t/0"], tenant="b", queue="b", priority=900, started=100), c_lease),
        now=NOW,
    )
    d = decide(job("j", tenant="q"), snap, cfg)
    if isinstance(d, Preempt):
        # Had q taken the T4, its lease would be borrowed capacity b's high-priority job ends.
        granted = LeaseState(
            lease_id="q-t4",
            job_id="j",
            tenant="q",
            queue="q",
            priority=500,
            started_at_s=NOW,
            slices=tuple(
                LeaseSlice(s.device_id, s.memory_mib, s.compute_pct, s.whole)
                for s in d.reserve.slices
            ),
        )
        later = snapshot(*nodes, leases=(granted, c_lease), now=NOW + 1_000)
        back = decide(job("b-again", tenant="b", priority="high", models=["T4"]), later, cfg)
        assert not (isinstance(back, Preempt) and "q-t4" in back.victims), (d, back)
        raise AssertionError(f"q reclaimed on a model its guarantee does not cover: {d}")
    assert isinstance(d, Wait | Reserve)


def test_a_preemption_earlier_in_the_batch_brings_a_borrowed_lease_back_within_its_guarantee() -> (
    None
):
    """Queue b (guaranteed two units) holds a two-A100 gang and, beyond its guarantee, a T4. Its
    high-priority request ends the gang for one A100: b then holds 1.25 units, the T4 within its
    guarantee. Queue q's request later in the same batch must not reclaim that T4, as it would
    not in the next cycle: the batch re-marks what is borrowed after a preemption."""
    cfg = with_queues(
        default_config(),
        QueueConfig(name="b", guaranteed_units=2.0),
        QueueConfig(name="q", guaranteed_units=1.0),
    )
    nodes = (node("x", "A100", 2), node("y", "T4", 1))
    t4 = lease("b-t4", ["y/0"], tenant="b", queue="b", priority=100, started=100)
    snap = snapshot(
        *nodes,
        leases=(
            lease("b-gang", ["x/0", "x/1"], tenant="b", queue="b", priority=500, started=100),
            t4,
        ),
        now=NOW,
    )
    mine = PendingRequest(job("b-high", tenant="b", priority="high", models=["A100"]), NOW)
    theirs = PendingRequest(job("q-t4", tenant="q", models=["T4"]), NOW)
    out = dict(decide_batch([mine, theirs], snap, cfg))
    first = out["b-high"]
    assert isinstance(first, Preempt) and first.victims == ("b-gang",), first
    assert isinstance(out["q-t4"], Wait), out["q-t4"]
    # The next cycle, once the gang has ended and b-high holds its A100, agrees.
    granted = lease("b-high", ["x/0"], tenant="b", queue="b", priority=900, started=NOW)
    later = snapshot(*nodes, leases=(granted, t4), now=NOW + 1_000)
    assert isinstance(decide(theirs, later, cfg), Wait)


def test_what_a_job_was_preempted_for_stays_its_own_while_its_victims_end() -> None:
    """A two-A100 gang preempted the low lease on x/1 to join the free x/0. While that lease
    ends (a cycle later, or its grace), the gang does not fit yet, and a request of another
    queue must not take x/0: once the victim is gone the gang would not fit and could not take
    x/0 back (a lease within its queue's guarantee), the victim ended for nothing."""
    cfg = with_queues(
        default_config(), QueueConfig(name="a"), QueueConfig(name="b", guaranteed_units=1.0)
    )
    nodes = (node("x", "A100", 2),)
    victim = lease("v", ["x/1"], tenant="a", queue="a", priority=100, started=0)
    gang = job("gang", tenant="a", priority="high", count=2, gang=GangSpec())
    other = PendingRequest(job("other", tenant="b"), NOW)
    first = dict(
        decide_batch(
            [PendingRequest(gang, NOW - 5), other], snapshot(*nodes, leases=(victim,), now=NOW), cfg
        )
    )
    assert isinstance(first["gang"], Preempt) and first["gang"].victims == ("v",)
    assert isinstance(first["other"], Wait)

    ending = replace(victim, terminating=True, preempted_for="gang")
    snap = snapshot(*nodes, leases=(ending,), now=NOW + 1)
    pool = WorkingPool(snap, cfg)
    second = dict(decide_batch([PendingRequest(gang, NOW - 5, nominated=True), other], pool))
    assert isinstance(second["gang"], Wait)
    assert second["gang"].reason is Reason.PREEMPTION_IN_PROGRESS
    assert isinstance(second["other"], Wait), second["other"]
    # What it kept for the batch is taken back out: the pool holds the ending victim again,
    # and nothing of the gang, as a caller settling the batch's decisions expects.
    fresh = WorkingPool(snap, cfg)
    assert set(pool.leases) == {"v"} and not pool.violations()
    assert (pool.dev_mem_free, pool.dev_holders, pool.dev_exclusive, pool.class_whole_free) == (
        fresh.dev_mem_free,
        fresh.dev_holders,
        fresh.dev_exclusive,
        fresh.class_whole_free,
    )
    assert pool.usage_of("a").units == fresh.usage_of("a").units == 1.0


def test_a_starved_request_waiting_for_min_runtime_holds_its_node() -> None:
    """A high-priority gang that has starved past ``starvation.after_s`` waits only for the
    low lease it would preempt to have run its minimum time. The free device beside it must
    not go to a later request: that new lease would be young again, and a stream of short jobs
    would postpone the gang for ever."""
    cfg = replace(
        with_queues(default_config(), QueueConfig(name="a"), QueueConfig(name="b")),
        starvation=StarvationConfig(after_s=600.0),
    )
    young = lease("young", ["x/1"], tenant="a", queue="a", priority=100, started=NOW - 100)
    snap = snapshot(node("x", "A100", 2), leases=(young,), now=NOW)
    gang = PendingRequest(
        job("gang", tenant="a", priority="high", count=2, gang=GangSpec()), NOW - 1_000
    )
    small = PendingRequest(job("small", tenant="b"), NOW)
    out = dict(decide_batch([gang, small], snap, cfg))
    assert isinstance(out["gang"], Wait)
    assert out["gang"].reason is Reason.WAITING_FOR_MIN_RUNTIME
    assert isinstance(out["small"], Wait), out["small"]
    assert out["small"].reason is Reason.CAPACITY_RESERVED
    # Before it starved, nothing is held: the small job runs.
    fresh = replace(gang, enqueued_at_s=NOW - 10)
    assert isinstance(dict(decide_batch([fresh, small], snap, cfg))["small"], Reserve)


_QUEUES = ("qa", "qb", "qc")
_PRIORITIES = {"low": 100, "normal": 500, "high": 900}


@st.composite
def _contended(
    draw: st.DrawFn,
) -> tuple[tuple[NodeState, ...], tuple[LeaseState, ...], SchedulerConfig, JobRequested]:
    """A small, busy pool of A100 and T4 nodes; queues guaranteed nothing, units or one model's
    devices; a request of any priority, size and model choice."""
    nodes = tuple(
        node(f"n{i}", draw(st.sampled_from(["A100", "T4"])), draw(st.integers(1, 3)))
        for i in range(draw(st.integers(1, 3)))
    )
    leases: list[LeaseState] = []
    for nd in nodes:
        for dev in nd.devices:
            shares = draw(st.sampled_from([0, 1, 1, 1, 2]))
            for _ in range(shares if shares != 1 else 1):
                q = draw(st.sampled_from(_QUEUES))
                leases.append(
                    lease(
                        f"l{len(leases)}",
                        [dev.device_id],
                        tenant=q,
                        queue=q,
                        priority=draw(st.sampled_from(sorted(_PRIORITIES.values()))),
                        started=0.0,
                        share=(4000, 40) if shares == 2 else None,
                    )
                )
    queues = []
    for q in _QUEUES:
        kind = draw(st.sampled_from(["none", "units", "model", "model"]))
        queues.append(
            QueueConfig(
                name=q,
                guaranteed_units=draw(st.sampled_from([1.0, 2.0])) if kind == "units" else 0.0,
                guaranteed_devices=(
                    {draw(st.sampled_from(["A100", "T4"])): draw(st.sampled_from([1.0, 2.0]))}
                    if kind == "model"
                    else {}
                ),
            )
        )
    tenant = draw(st.sampled_from(_QUEUES))
    request = job(
        "j",
        tenant=tenant,
        count=draw(st.integers(1, 2)),
        priority=draw(st.sampled_from(sorted(_PRIORITIES))),
        models=draw(st.sampled_from([[], [], [], ["A100"], ["T4"]])),
    )
    return nodes, tuple(leases), with_queues(default_config(), *queues), request


@settings(max_examples=200, deadline=None, derandomize=True)
@given(world=_contended())
def test_preemption_takes_only_what_it_may_and_the_request_then_fits(
    world: tuple[tuple[NodeState, ...], tuple[LeaseState, ...], SchedulerConfig, JobRequested],
) -> None:
    """Every victim is of the request's own queue and of lower priority, or borrowed by another
    queue and either of lower priority or reclaimed by a request in quota where it is placed;
    once the victims are gone the request fits; and the victims' queues, asking again at their
    own priority, cannot take the new lease back (no preemption ping-pong)."""
    nodes, leases, cfg, request = world
    snap = snapshot(*nodes, leases=leases, now=NOW)
    d = decide(request, snap, cfg)
    if not isinstance(d, Preempt):
        return
    pool = WorkingPool(snap, cfg)
    refresh_over_quota(pool, cfg)
    mine = _PRIORITIES[request.priority]
    for v in d.victims:
        victim = pool.leases[v]
        if victim.queue == request.tenant:
            assert victim.state.priority < mine, d
        else:
            assert victim.over_quota, d
            assert d.reserve.in_quota or victim.state.priority < mine, d
    rest = tuple(ls for ls in leases if ls.lease_id not in d.victims)
    placed = decide(
        PendingRequest(request, NOW, nominated=True), snapshot(*nodes, leases=rest, now=NOW), cfg
    )
    assert isinstance(placed, Reserve), (d, placed)
    granted = LeaseState(
        lease_id="granted",
        job_id="j",
        tenant=request.tenant or "",
        queue=request.tenant or "",
        priority=mine,
        started_at_s=NOW,
        slices=tuple(
            LeaseSlice(s.device_id, s.memory_mib, s.compute_pct, s.whole) for s in placed.slices
        ),
    )
    later = snapshot(*nodes, leases=(*rest, granted), now=NOW + 1_000)
    names = {v: k for k, v in _PRIORITIES.items()}
    for v in d.victims:
        victim = pool.leases[v]
        if victim.queue == request.tenant:
            continue
        model = next(
            x.model
            for n in nodes
            for x in n.devices
            if x.device_id == victim.state.slices[0].device_id
        )
        whole = victim.state.slices[0].whole
        back = job(
            "back",
            tenant=victim.queue,
            priority=names[victim.state.priority],
            models=[model],
            compute_pct=None if whole else 40,
        )
        again = decide(back, later, cfg)
        assert not (isinstance(again, Preempt) and "granted" in again.victims), (d, again)
