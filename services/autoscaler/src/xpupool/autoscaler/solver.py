"""Scale-up: the question the placement engine answers, as a pure interface.

"Which cheapest set of nodes from the pools would let the pending demand be placed?" The
autoscaler builds a :class:`ScaleUpProblem` (the actionable pending jobs, the pools that may
grow and by how much, the nodes already being provisioned), hands it to a
:class:`ScaleUpSolver`, and turns the :class:`ScaleUpAnswer` into scale-up steps with
:func:`steps_from_answer`. The solver honours what the scheduler honours (fractional shares
packed onto whole devices, gangs that need one node or one interconnect domain, selectors,
``cheapest``/``fastest`` intent) and must count incoming nodes first: a job that an incoming
node will serve goes into ``served_by_incoming``, not into a new addition.

The placement-backed solver lives with the placement engine; this module defines only the
interface and the demand filter (:func:`split_actionable`): demand that more hardware would not
help (quota, priority, preemption already under way, a gang waiting on its members, ...) never
reaches the solver.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final, Protocol

from xpupool.autoscaler.decisions import DemandSummary, ScaleStep
from xpupool.autoscaler.pools import PoolConfig
from xpupool.contracts import JobReason, JobRequested, ScaleAction, ScaleReason

__all__ = [
    "ACTIONABLE_REASONS",
    "NodeState",
    "PendingJob",
    "PoolAddition",
    "PoolNode",
    "ScaleUpAnswer",
    "ScaleUpProblem",
    "ScaleUpSolver",
    "job_devices",
    "split_actionable",
    "steps_from_answer",
]

#: Pending reasons that more capacity would resolve. Not in it: ``quota_exhausted`` (a queue at
#: its limit), ``waiting_for_min_runtime`` and ``preemption_in_progress`` (the job gets capacity
#: by priority), ``waiting_for_gang`` (a gang waiting on its members), ``capacity_incoming``
#: (ending leases or incoming nodes will serve it), ``queued`` (no cycle has looked yet).
ACTIONABLE_REASONS: Final = frozenset(
    {JobReason.INSUFFICIENT_CAPACITY, JobReason.NO_MATCHING_DEVICE, JobReason.CAPACITY_RESERVED}
)


@dataclass(frozen=True, slots=True)
class PendingJob:
    """One pending request as the ledger holds it: the request, its tenant and queue, why it
    waits and since when (epoch seconds)."""

    request: JobRequested
    tenant: str
    reason: JobReason
    since: float
    queue: str | None = None

    @property
    def job_id(self) -> str:
        return self.request.job_id


def split_actionable(
    jobs: Iterable[PendingJob], reasons: frozenset[JobReason] = ACTIONABLE_REASONS
) -> tuple[list[PendingJob], dict[str, JobReason]]:
    """The jobs that capacity would help, and the others with the reason that excludes them."""
    actionable: list[PendingJob] = []
    ignored: dict[str, JobReason] = {}
    for job in jobs:
        if job.reason in reasons:
            actionable.append(job)
        else:
            ignored[job.job_id] = job.reason
    return actionable, ignored


def job_devices(request: JobRequested, device_memory_mib: int | None = None) -> float:
    """Devices a request takes, a share counting as its fraction of one device (the larger of
    its compute and memory fractions; ``memory_mib`` against ``device_memory_mib`` if known,
    else a whole device)."""
    if request.count == 0:
        return 0.0
    demand = request.device
    if demand.is_whole:
        return float(request.count)
    fractions = [pct / 100 for pct in (demand.compute_pct, demand.memory_pct) if pct is not None]
    if demand.memory_mib is not None:
        fractions.append(
            min(1.0, demand.memory_mib / device_memory_mib) if device_memory_mib else 1.0
        )
    return request.count * max(fractions)


class NodeState(StrEnum):
    """Where a pool node is in its life."""

    PROVISIONING = "provisioning"
    READY = "ready"
    DRAINING = "draining"


@dataclass(frozen=True, slots=True)
class PoolNode:
    """A node of a pool: ``node_id`` is ``None`` for a provisioning node its provider has not
    named yet; ``request_id`` is the provider request that added it."""

    pool: str
    state: NodeState
    node_id: str | None = None
    request_id: str | None = None


@dataclass(frozen=True, slots=True)
class ScaleUpProblem:
    """What the solver is asked. ``pending`` is actionable demand only
    (:func:`split_actionable`); ``pools`` are every configured pool; ``room`` is how many nodes
    each pool may still add (``max_size`` minus its ready and provisioning nodes); ``nodes`` are
    the pools' current nodes (the incoming ones are ``state=provisioning``: count them as empty
    nodes of their pool's shape)."""

    pending: Sequence[PendingJob]
    pools: Sequence[PoolConfig]
    room: Mapping[str, int]
    nodes: Sequence[PoolNode] = ()

    @property
    def incoming(self) -> tuple[PoolNode, ...]:
        """The nodes being provisioned."""
        return tuple(n for n in self.nodes if n.state is NodeState.PROVISIONING)


@dataclass(frozen=True, slots=True)
class PoolAddition:
    """Add ``count`` nodes to ``pool``; they let ``job_ids`` be placed."""

    pool: str
    count: int
    job_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ScaleUpAnswer:
    """The cheapest additions found, the jobs the incoming nodes already serve (job id ->
    pool), and the jobs nothing can serve with why (``no pool fits``, ``at max_size``)."""

    additions: tuple[PoolAddition, ...] = ()
    served_by_incoming: Mapping[str, str] = field(default_factory=dict)
    unserved: Mapping[str, str] = field(default_factory=dict)


class ScaleUpSolver(Protocol):
    """Implemented by the placement engine: pure, deterministic, no I/O.

    Contract: ``additions`` never exceed ``problem.room`` for a pool; every job id appears in
    at most one of ``additions``, ``served_by_incoming`` and ``unserved``, and only ids of
    ``problem.pending``; among the sets of nodes that let the same jobs be placed the answer is
    the cheapest by ``cost_per_hour`` (intent ``fastest`` may prefer a faster pool for its job).
    """

    def solve(self, problem: ScaleUpProblem) -> ScaleUpAnswer: ...


def steps_from_answer(problem: ScaleUpProblem, answer: ScaleUpAnswer) -> tuple[ScaleStep, ...]:
    """One ``scale_up`` step per addition (reason ``pending_demand``) with the demand it answers;
    additions beyond a pool's room are clipped (a solver bug must not break ``max_size``)."""
    pools = {p.name: p for p in problem.pools}
    jobs = {j.job_id: j for j in problem.pending}
    steps: list[ScaleStep] = []
    for addition in answer.additions:
        pool = pools.get(addition.pool)
        count = min(addition.count, problem.room.get(addition.pool, 0))
        if pool is None or count <= 0:
            continue
        served = tuple(j for j in addition.job_ids if j in jobs)
        devices = sum(job_devices(jobs[j].request) for j in served)
        per_device = pool.capacity_units / pool.node.count
        steps.append(
            ScaleStep(
                action=ScaleAction.SCALE_UP,
                pool=pool.name,
                reason=ScaleReason.PENDING_DEMAND,
                count=count,
                demand=DemandSummary(
                    job_ids=served, devices=devices, capacity_units=devices * per_device
                ),
                detail=f"{len(served)} pending jobs, {devices:g} devices of {pool.node.model}",
            )
        )
    return tuple(steps)
