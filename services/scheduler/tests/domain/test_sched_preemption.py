"""Preemption: who may be a victim, in which order, and only when it makes the request fit."""

from __future__ import annotations

from domain_builders import job, lease, node, snapshot

from xpupool.placement.inventory import HostCharge
from xpupool.scheduler.domain import (
    PendingRequest,
    Preempt,
    QueueConfig,
    Reason,
    Reserve,
    Wait,
    decide,
    decide_batch,
    default_config,
)
from xpupool.scheduler.domain.config import with_queues

NOW = 10_000.0


def full_node(*leases_):
    return snapshot(node("n", "A100", len(leases_)), leases=tuple(leases_), now=NOW)


def test_higher_priority_preempts_lowest_priority_first():
    """A high-priority request preempts the lowest-priority lease of its queue."""
    snap = full_node(
        lease("normal", ["n/0"], priority=500, started=100),
        lease("low", ["n/1"], priority=100, started=100),
    )
    d = decide(job("j", priority="high"), snap)
    assert isinstance(d, Preempt) and d.victims == ("low",)
    assert d.reserve.slices[0].device_id == "n/1"


def test_youngest_first_among_equal_priority():
    """Among equal-priority victims the youngest (least work lost) goes first."""
    snap = full_node(
        lease("old", ["n/0"], priority=100, started=100),
        lease("young", ["n/1"], priority=100, started=5000),
    )
    d = decide(job("j", priority="high"), snap)
    assert isinstance(d, Preempt) and d.victims == ("young",)


def test_over_quota_victims_before_in_quota():
    """Over-quota (borrowed) leases are taken before in-quota ones, even of higher priority."""
    cfg = with_queues(
        default_config(), QueueConfig(name="t1", guaranteed_units=1.0), QueueConfig(name="A")
    )
    snap = full_node(
        lease("own-low-in-quota", ["n/0"], priority=100, started=10),
        lease("a-normal-borrowed", ["n/1"], tenant="ta", queue="A", priority=500, started=10),
    )
    d = decide(job("j", priority="high"), snap, cfg)
    assert isinstance(d, Preempt) and d.victims == ("a-normal-borrowed",)


def test_fewest_victims():
    """A node where one lease must go beats a node where two must, even if those are cheaper."""
    snap = snapshot(
        node("a", "A100", 2),
        node("b", "A100", 2),
        leases=(
            lease("a-small-1", ["a/0"], share=(40000, 50), priority=100, started=9000),
            lease("a-small-2", ["a/0"], share=(40000, 50), priority=100, started=9000),
            lease("a-whole", ["a/1"], priority=500, started=100),
            lease("b-whole-1", ["b/0"], priority=500, started=100),
            lease("b-whole-2", ["b/1"], priority=500, started=100),
        ),
        now=NOW,
    )
    d = decide(job("j", priority="high"), snap)
    assert isinstance(d, Preempt) and len(d.victims) == 1


def test_minimum_runtime_respected():
    """A lease younger than the minimum runtime is not preempted, and the job says it waits for
    that (not for capacity); a request that could not preempt it anyway waits for capacity."""
    snap = full_node(lease("fresh", ["n/0"], priority=100, started=NOW - 10))
    d = decide(job("j", priority="critical"), snap)
    assert isinstance(d, Wait) and d.reason is Reason.WAITING_FOR_MIN_RUNTIME
    assert "min_runtime_s" in d.detail
    peer = decide(job("j", priority="low"), snap)  # equal priority: no preemption at all
    assert isinstance(peer, Wait) and peer.reason is Reason.INSUFFICIENT_CAPACITY


def test_non_preemptible_lease_and_queue():
    """Leases marked non-preemptible, or in a non-preemptible queue, are never victims."""
    snap = full_node(lease("keep", ["n/0"], priority=100, started=0, preemptible=False))
    assert isinstance(decide(job("j", priority="critical"), snap), Wait)
    cfg = with_queues(default_config(), QueueConfig(name="t1", preemptible=False))
    snap = full_node(lease("keep", ["n/0"], priority=100, started=0))
    assert isinstance(decide(job("j", priority="critical"), snap, cfg), Wait)


def test_preempts_only_if_it_makes_the_request_fit():
    """No victim is chosen when ending them would still not make room (here: host CPU)."""
    snap = snapshot(
        node("n", "A100", 2, cpu=8000),
        leases=(
            lease("low", ["n/0"], priority=100, started=0),
            lease("cpu-hog", ["n/1"], priority=900, started=0, host=(HostCharge("n", 8000, 0),)),
        ),
        now=NOW,
    )
    d = decide(job("j", priority="high", cpu_milli=4000), snap)
    assert isinstance(d, Wait)


def test_equal_priority_does_not_preempt():
    """Same-priority leases of the same queue are not preempted."""
    snap = full_node(lease("peer", ["n/0"], priority=500, started=0))
    assert isinstance(decide(job("j"), snap), Wait)


def test_other_queue_in_quota_not_preempted_by_priority():
    """Priority alone does not take capacity another queue holds within its guarantee."""
    cfg = with_queues(default_config(), QueueConfig(name="B", guaranteed_units=1.0))
    snap = full_node(lease("b", ["n/0"], tenant="tb", queue="B", priority=100, started=0))
    assert isinstance(decide(job("j", priority="critical"), snap, cfg), Wait)


def test_preemption_in_progress_then_reserve():
    """While its victims are ending the job waits (preemption_in_progress); then it is reserved."""
    ending = lease("low", ["n/0"], priority=100, started=0, terminating=True, preempted_for="j")
    snap = full_node(ending)
    item = PendingRequest(job("j", priority="high"), NOW - 5, nominated=True)
    d = decide_batch([item], snap)[0][1]
    assert isinstance(d, Wait) and d.reason is Reason.PREEMPTION_IN_PROGRESS
    freed = snapshot(node("n", "A100", 1), now=NOW)
    assert isinstance(decide_batch([item], freed)[0][1], Reserve)


def test_capacity_incoming():
    """A job that fits once already-ending leases are gone waits with capacity_incoming."""
    snap = full_node(lease("ending", ["n/0"], priority=900, started=0, terminating=True))
    d = decide(job("j"), snap)
    assert isinstance(d, Wait) and d.reason is Reason.CAPACITY_INCOMING


def test_batch_preemption_frees_capacity_for_the_preemptor_only():
    """In a batch, capacity freed by a preemption goes to the preemptor, not to later requests."""
    snap = full_node(lease("low", ["n/0"], priority=100, started=0))
    out = dict(decide_batch([job("hi", priority="high"), job("other", priority="normal")], snap))
    assert isinstance(out["hi"], Preempt)
    assert isinstance(out["other"], Wait)


def test_gang_preemption_simulated_across_nodes():
    """A multi-node gang preempts just enough leases across nodes to fit as a whole."""
    snap = snapshot(
        node("a", "A100", 2),
        node("b", "A100", 2),
        leases=(
            lease("l1", ["a/0"], priority=100, started=0),
            lease("l2", ["b/0"], priority=100, started=0),
            lease("h1", ["a/1"], priority=900, started=0),
        ),
        now=NOW,
    )
    d = decide(job("g", count=3, priority="high"), snap)
    assert isinstance(d, Preempt) and set(d.victims) == {"l1", "l2"}
    assert len(d.reserve.slices) == 3
