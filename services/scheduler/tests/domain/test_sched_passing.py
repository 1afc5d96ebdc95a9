"""Placing new requests on arrival while jobs wait (``domain.passing``): as a cycle would."""

from __future__ import annotations

from domain_builders import job, lease, node, snapshot

from xpupool.contracts.payloads import GangSpec
from xpupool.scheduler.domain import (
    PendingRequest,
    Reserve,
    TimedOut,
    Wait,
    WorkingPool,
    decide_batch,
    default_config,
)
from xpupool.scheduler.domain.passing import (
    MAX_JUDGED,
    WaitingJudgement,
    arrivals_past,
    judged_after_cycle,
    nominated,
)

NOW = 10_000.0


def _pool() -> WorkingPool:
    """Eight A100s on ``big`` (one held), four T4s on ``t4``."""
    return WorkingPool(
        snapshot(node("big", "A100", 8), node("t4", "T4", 4), leases=(lease("l", ["big/0"]),)),
        default_config(),
    )


def _gang(waited_s: float) -> PendingRequest:
    """A gang of eight A100s on one node, waiting for ``waited_s``."""
    request = job("gang", count=8, gang=GangSpec(same_node=True), models=["A100"])
    return PendingRequest(request, NOW - waited_s)


def test_arrivals_are_placed_as_a_cycle_would_while_every_waiting_job_still_waits() -> None:
    """The gang cannot fit (a device of its only node is held): decided first, it waits, and
    the arrival behind it is placed where a cycle would place it, on the gang's node too."""
    pool = _pool()
    gang = _gang(waited_s=5)
    arrival = PendingRequest(job("a", models=["A100"]), NOW)
    decided = decide_batch([gang, arrival], pool, default_config(), now_s=NOW)
    past = arrivals_past(decided, [gang])
    assert past is not None and [job_id for job_id, _ in past] == ["a"]
    [(_, placed)] = past
    assert isinstance(placed, Reserve) and placed.slices[0].device_id.startswith("big/")


def test_a_starved_waiting_job_keeps_its_node_from_arrivals() -> None:
    """Waiting past the starvation threshold, the gang holds its node (``decide_batch``'s
    anti-starvation hold): the arrival behind it goes elsewhere, or waits, as in a cycle."""
    pool = _pool()
    gang = _gang(waited_s=default_config().starvation.after_s + 1)
    anywhere = PendingRequest(job("a"), NOW)
    a100_only = PendingRequest(job("b", models=["A100"]), NOW)
    decided = decide_batch([gang, anywhere, a100_only], pool, default_config(), now_s=NOW)
    past = dict(arrivals_past(decided, [gang]) or [])
    placed = past["a"]
    assert isinstance(placed, Reserve) and placed.slices[0].device_id.startswith("t4/")
    assert isinstance(past["b"], Wait)


def test_nothing_passes_when_a_waiting_job_would_now_be_placed_or_end() -> None:
    """Capacity freed since the cycle: the gang now fits, so the batch is the cycle's to do
    (it places the gang first); a waiting job past its maximum wait ends in a cycle too."""
    free = WorkingPool(snapshot(node("big", "A100", 8), node("t4", "T4", 4)), default_config())
    gang = _gang(waited_s=5)
    arrival = PendingRequest(job("a"), NOW)
    decided = decide_batch([gang, arrival], free, default_config(), now_s=NOW)
    assert isinstance(dict(decided)["gang"], Reserve)
    assert arrivals_past(decided, [gang]) is None
    expired = PendingRequest(job("old", models=["A100"], count=8, max_wait_s=1), NOW - 5)
    decided = decide_batch([expired, arrival], _pool(), default_config(), now_s=NOW)
    assert isinstance(dict(decided)["old"], TimedOut)
    assert arrivals_past(decided, [expired]) is None


def test_a_judgement_follows_each_wait_that_came_right_after_and_no_other() -> None:
    config = default_config()
    judged = WaitingJudgement(5, config, (_gang(1),))
    later = PendingRequest(job("later"), NOW)
    grown = judged.extended(later, 6)
    assert grown is not None and (grown.seq, grown.added) == (6, 1)
    assert [p.request.job_id for p in grown.waiting] == ["gang", "later"]
    # Someone else's wait (sequence 6) came between: nothing judged until a cycle reads again.
    assert judged.extended(later, 7) is None
    assert grown.since(5) == (later,) and grown.since(6) == ()
    assert grown.since(4) is None and grown.since(7) is None


def test_a_cycle_keeps_the_waits_that_came_after_its_read() -> None:
    """A cycle read the queue at sequence 6; meanwhile this replica saw a job start waiting
    (sequence 7): the cycle's judgement is the jobs it left plus that one, at 7."""
    config = default_config()
    left = [_gang(1)]
    before = WaitingJudgement(5, config, (_gang(1),))
    first = before.extended(PendingRequest(job("x"), NOW), 6)
    assert first is not None
    newer = first.extended(PendingRequest(job("y"), NOW), 7)
    assert newer is not None
    after = judged_after_cycle(6, config, left, newer)
    assert after.seq == 7 and [p.request.job_id for p in after.waiting] == ["gang", "y"]
    # Nothing followed, or it fell behind the read: the cycle's own judgement.
    assert judged_after_cycle(6, config, left, None).seq == 6
    assert judged_after_cycle(9, config, left, newer).seq == 9


def test_a_judgement_is_used_only_with_its_config_few_jobs_and_no_preemption() -> None:
    config = default_config()
    assert WaitingJudgement(1, config, (_gang(1),)).usable(config)
    assert not WaitingJudgement(1, config, (_gang(1),)).usable(default_config())
    assert not WaitingJudgement(1, config, (nominated(_gang(1)),)).usable(config)
    many = tuple(PendingRequest(job(f"j{i}"), NOW) for i in range(MAX_JUDGED + 1))
    assert not WaitingJudgement(1, config, many).usable(config)
    assert WaitingJudgement(1, config, ()).usable(config)  # nothing left waiting
