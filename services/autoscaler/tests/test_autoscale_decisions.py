"""The plan and its events, min size, predictive steps, the solver interface and demand filter."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from autoscale_builders import make_pool

from xpupool.autoscaler.decisions import (
    DemandSummary,
    ScalePlan,
    ScaleStep,
    forecast_nodes,
    plan_min_size,
    plan_predictive,
)
from xpupool.autoscaler.solver import (
    NodeState,
    PendingJob,
    PoolAddition,
    PoolNode,
    ScaleUpAnswer,
    ScaleUpProblem,
    ScaleUpSolver,
    job_devices,
    split_actionable,
    steps_from_answer,
)
from xpupool.contracts import (
    DeviceDemand,
    JobReason,
    JobRequested,
    ScaleAction,
    ScaleReason,
    encode,
)
from xpupool.contracts.subjects import dedup_id, subject_of

AT = datetime(2026, 12, 3, 9, 0, tzinfo=UTC)


def job(job_id: str, reason: JobReason, count: int = 1, **device: int) -> PendingJob:
    request = JobRequested(job_id=job_id, count=count, device=DeviceDemand(**device))
    return PendingJob(request=request, tenant="t", reason=reason, since=0.0)


def test_only_demand_that_capacity_would_serve_is_actionable() -> None:
    jobs = [
        job("cap", JobReason.INSUFFICIENT_CAPACITY),
        job("model", JobReason.NO_MATCHING_DEVICE),
        job("quota", JobReason.QUOTA_EXHAUSTED),
        job("gang", JobReason.WAITING_FOR_GANG),
        job("young", JobReason.WAITING_FOR_MIN_RUNTIME),
        job("preempting", JobReason.PREEMPTION_IN_PROGRESS),
        job("incoming", JobReason.CAPACITY_INCOMING),
    ]
    actionable, ignored = split_actionable(jobs)
    assert [j.job_id for j in actionable] == ["cap", "model"]
    assert ignored["quota"] is JobReason.QUOTA_EXHAUSTED and len(ignored) == 5


def test_job_devices_counts_shares_as_fractions() -> None:
    assert job_devices(job("a", JobReason.QUEUED, count=4).request) == 4
    assert job_devices(job("b", JobReason.QUEUED, compute_pct=25).request) == 0.25
    share = job("c", JobReason.QUEUED, count=2, memory_mib=20480, compute_pct=10).request
    assert job_devices(share, device_memory_mib=81920) == pytest.approx(0.5)
    assert job_devices(share) == 2  # memory of an unknown device: a whole one each


class CheapestFirst:
    """A stand-in solver (whole devices only) showing the Protocol is enough to plan with."""

    def solve(self, problem: ScaleUpProblem) -> ScaleUpAnswer:
        pool = min(problem.pools, key=lambda p: p.cost_per_hour / p.node.count)
        incoming = len(problem.incoming) * pool.node.count
        served: dict[str, str] = {}
        rest = []
        for j in problem.pending:
            need = job_devices(j.request)
            if incoming >= need:
                incoming -= int(need)
                served[j.job_id] = pool.name
            else:
                rest.append(j)
        devices = sum(job_devices(j.request) for j in rest)
        nodes = -(-int(devices) // pool.node.count)
        return ScaleUpAnswer(
            additions=(PoolAddition(pool.name, nodes, tuple(j.job_id for j in rest)),),
            served_by_incoming=served,
        )


def test_a_solver_answer_becomes_pending_demand_steps_within_the_room() -> None:
    t4 = make_pool("t4", node={"model": "T4", "count": 4}, cost_per_hour=2.0, max_size=8)
    a100 = make_pool("a100")
    jobs = [job(f"j{i}", JobReason.INSUFFICIENT_CAPACITY, count=3) for i in range(5)]
    problem = ScaleUpProblem(
        pending=jobs,
        pools=[a100, t4],
        room={"a100": 10, "t4": 2},
        nodes=[PoolNode(pool="t4", state=NodeState.PROVISIONING, request_id="r0")],
    )
    solver: ScaleUpSolver = CheapestFirst()
    answer = solver.solve(problem)
    assert answer.served_by_incoming == {"j0": "t4"}
    (step,) = steps_from_answer(problem, answer)
    assert step.pool == "t4" and step.reason is ScaleReason.PENDING_DEMAND
    assert step.count == 2  # the solver asked 3: clipped to the room
    assert step.demand.job_ids == ("j1", "j2", "j3", "j4") and step.demand.devices == 12


def test_plan_events_carry_reason_demand_sizes_cost_and_a_request_id() -> None:
    a100 = make_pool("a100", max_size=10)
    plan = ScalePlan(
        steps=(
            ScaleStep(
                action=ScaleAction.SCALE_UP,
                pool="a100",
                reason=ScaleReason.PENDING_DEMAND,
                count=2,
                demand=DemandSummary(job_ids=("j1", "j2"), devices=16, capacity_units=16),
            ),
            ScaleStep(
                action=ScaleAction.DRAIN,
                pool="a100",
                reason=ScaleReason.IDLE,
                node_ids=("n1",),
            ),
            ScaleStep(
                action=ScaleAction.REMOVE,
                pool="a100",
                reason=ScaleReason.DRAINED,
                node_ids=("n0",),
            ),
        )
    )
    up, drain, remove = plan.events({"a100": a100}, {"a100": 3}, cycle="7.12", at=AT)
    assert (up.size_before, up.size_after, drain.size_after, remove.size_after) == (3, 5, 4, 4)
    assert up.demand.job_ids == ["j1", "j2"] and up.demand.jobs == 2 and up.demand.devices == 16
    assert up.cost_per_hour_delta == 32.0 and remove.cost_per_hour_delta == -16.0
    assert drain.cost_per_hour_delta == 0.0 and drain.request_id is None
    assert up.decision_id == "7.12:0:a100:scale_up" == up.request_id
    assert remove.request_id == remove.decision_id
    assert subject_of(up) == "xpupool.scale.v1.decision"
    assert dedup_id(up) == "scale:7.12:0:a100:scale_up"
    assert b'"type":"xpupool.scale.decision.v1"' in encode(up)


def test_long_demand_lists_are_capped_but_counted() -> None:
    summary = DemandSummary(job_ids=tuple(f"j{i}" for i in range(3000)))
    demand = summary.to_contract()
    assert len(demand.job_ids) == 1024 and demand.jobs == 3000


def test_min_size_is_restored() -> None:
    pools = [make_pool("a", min_size=2), make_pool("b", min_size=1)]
    (step,) = plan_min_size(pools, {"a": 0, "b": 1})
    assert (step.pool, step.count, step.reason) == ("a", 2, ScaleReason.BELOW_MIN_SIZE)


def test_predictive_steps_only_for_predictive_pools_and_within_max() -> None:
    pool = make_pool(predictive={"enabled": True, "headroom": 1.25}, max_size=4)
    step = plan_predictive(pool, forecast_devices=13.0, size=1)  # 13 * 1.25 / 8 -> 3 nodes
    assert step is not None and step.count == 2 and step.reason is ScaleReason.FORECAST
    assert step.demand.forecast_devices == 13.0
    capped = plan_predictive(pool, forecast_devices=100.0, size=1)
    assert capped is not None and capped.count == 3
    assert plan_predictive(pool, forecast_devices=8.0, size=2) is None
    assert plan_predictive(make_pool(), forecast_devices=100.0, size=0) is None


def test_forecast_nodes_are_what_a_predictive_step_adds_up_to() -> None:
    pool = make_pool(predictive={"enabled": True, "headroom": 1.25}, max_size=4, min_size=1)
    assert forecast_nodes(pool, 13.0) == 3  # 13 * 1.25 / 8 devices a node
    assert forecast_nodes(pool, 100.0) == 4  # max_size
    assert forecast_nodes(pool, 0.5) == 1  # min_size
    assert forecast_nodes(pool, 0.0) == 0
    assert forecast_nodes(make_pool(), 100.0) == 0  # not predictive
    step = plan_predictive(pool, 13.0, size=1)
    assert step is not None and 1 + step.count == forecast_nodes(pool, 13.0)
