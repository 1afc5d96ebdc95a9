"""The placement-backed scale-up solver: the cheapest nodes that let actionable demand be placed."""

from __future__ import annotations

import random

from autoscale_builders import CATALOG, make_pool

from xpupool.autoscaler.pools import PoolConfig
from xpupool.autoscaler.solver import (
    NodeState,
    PendingJob,
    PlacementSolver,
    PoolNode,
    ScaleUpAnswer,
    ScaleUpProblem,
)
from xpupool.contracts import (
    DeviceDemand,
    DeviceSelector,
    GangSpec,
    HostDemand,
    Intent,
    JobReason,
    JobRequested,
)

SOLVER = PlacementSolver(CATALOG)


def t4(**kw: object) -> PoolConfig:
    base: dict[str, object] = {
        "node": {"model": "T4", "count": 4, "cpu_milli": 32000, "memory_mib": 131072},
        "cost_per_hour": 2.0,
    }
    base.update(kw)
    return make_pool("t4", **base)


def a100(**kw: object) -> PoolConfig:
    base: dict[str, object] = {
        "node": {"model": "A100-SXM4-80GB", "count": 8, "cpu_milli": 96000},
        "cost_per_hour": 16.0,
    }
    base.update(kw)
    return make_pool("a100", **base)


def job(job_id: str, count: int = 1, **kw: object) -> PendingJob:
    request = JobRequested(job_id=job_id, tenant="t", count=count, **kw)  # type: ignore[arg-type]
    return PendingJob(request, "t", JobReason.INSUFFICIENT_CAPACITY, 0.0)


def problem(jobs: list[PendingJob], pools: list[PoolConfig], **kw: object) -> ScaleUpProblem:
    room = {p.name: p.max_size for p in pools}
    return ScaleUpProblem(pending=jobs, pools=pools, room=kw.pop("room", room), **kw)  # type: ignore[arg-type]


def check_contract(prob: ScaleUpProblem, answer: ScaleUpAnswer) -> None:
    ids = [j for a in answer.additions for j in a.job_ids]
    ids += [*answer.served_by_incoming, *answer.unserved]
    assert len(ids) == len(set(ids)), "a job in two places"
    assert set(ids) <= {j.job_id for j in prob.pending}
    for a in answer.additions:
        assert 0 < a.count <= prob.room[a.pool]


def test_shares_are_packed_onto_one_cheap_node() -> None:
    """Ten quarter-GPU shares need 2.5 devices: one 4xT4 node, not one node each, nor A100s."""
    jobs = [job(f"s{i}", device=DeviceDemand(compute_pct=25)) for i in range(10)]
    prob = problem(jobs, [a100(), t4()])
    answer = SOLVER.solve(prob)
    check_contract(prob, answer)
    assert [(a.pool, a.count) for a in answer.additions] == [("t4", 1)]
    assert set(answer.additions[0].job_ids) == {j.job_id for j in jobs}


def test_incoming_capacity_counts_first() -> None:
    """Nodes already being provisioned serve what they can; only the rest buys new nodes."""
    jobs = [job(f"w{i}") for i in range(6)]
    incoming = (PoolNode("t4", NodeState.PROVISIONING, request_id="r1"),)
    prob = problem(jobs, [t4()], nodes=incoming)
    answer = SOLVER.solve(prob)
    check_contract(prob, answer)
    assert len(answer.served_by_incoming) == 4
    assert [(a.pool, a.count, len(a.job_ids)) for a in answer.additions] == [("t4", 1, 2)]


def test_gangs_need_a_whole_node_or_several() -> None:
    """An 8-device gang on one node cannot use 4-device T4 nodes; across nodes it takes two."""
    same_node = job(
        "g1", count=8, gang=GangSpec(same_node=True), selector=DeviceSelector(models=["T4"])
    )
    across = job(
        "g2", count=8, gang=GangSpec(same_node=False), selector=DeviceSelector(models=["T4"])
    )
    answer = SOLVER.solve(problem([same_node], [t4(), a100()]))
    assert answer.unserved == {"g1": "no pool fits it"}
    answer = SOLVER.solve(problem([across], [t4(), a100()]))
    assert [(a.pool, a.count) for a in answer.additions] == [("t4", 2)]


def test_intent_and_selectors_choose_the_pool() -> None:
    """cheapest takes the T4 pool, fastest the A100 pool, a bf16 selector the A100 (T4 has no
    bf16), and a host demand larger than a T4 node rules it out."""
    assert SOLVER.solve(problem([job("c")], [a100(), t4()])).additions[0].pool == "t4"
    fast = job("f", intent=Intent.FASTEST)
    assert SOLVER.solve(problem([fast], [a100(), t4()])).additions[0].pool == "a100"
    bf16 = job("b", selector=DeviceSelector(capabilities=["bf16"]))
    assert SOLVER.solve(problem([bf16], [a100(), t4()])).additions[0].pool == "a100"
    big_host = job("h", host=HostDemand(cpu_milli=64000))
    assert SOLVER.solve(problem([big_host], [a100(), t4()])).additions[0].pool == "a100"


def test_max_size_is_never_exceeded_and_says_so() -> None:
    """A pool at its maximum adds nothing; the jobs say why."""
    jobs = [job(f"x{i}", count=4) for i in range(3)]
    prob = problem(jobs, [t4()], room={"t4": 2})
    answer = SOLVER.solve(prob)
    check_contract(prob, answer)
    assert [(a.pool, a.count) for a in answer.additions] == [("t4", 2)]
    assert answer.unserved == {"x2": "every pool that fits it is at max_size"}


def test_random_demand_keeps_the_contract() -> None:
    """Random mixes of shares, whole devices, gangs and host-only jobs over random room: no job
    twice, never beyond room, and every addition serves at least one job."""
    rng = random.Random(7)
    for _ in range(30):
        jobs = []
        for i in range(rng.randint(1, 25)):
            kind = rng.randrange(4)
            if kind == 0:
                jobs.append(job(f"j{i}", device=DeviceDemand(compute_pct=rng.choice([10, 25, 50]))))
            elif kind == 1:
                jobs.append(job(f"j{i}", count=rng.choice([1, 2, 4])))
            elif kind == 2:
                jobs.append(
                    job(
                        f"j{i}",
                        count=rng.choice([4, 8]),
                        gang=GangSpec(same_node=rng.random() < 0.5),
                    )
                )
            else:
                jobs.append(job(f"j{i}", count=0, host=HostDemand(cpu_milli=4000)))
        room = {"t4": rng.randint(0, 4), "a100": rng.randint(0, 2)}
        prob = problem(jobs, [t4(), a100()], room=room)
        answer = SOLVER.solve(prob)
        check_contract(prob, answer)
        assert all(a.job_ids for a in answer.additions)
        placed = {j for a in answer.additions for j in a.job_ids} | set(answer.unserved)
        assert placed == {j.job_id for j in jobs}
