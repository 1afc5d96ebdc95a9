"""Scale-up: the question the placement engine answers, as a pure interface.

"Which cheapest set of nodes from the pools would let the pending demand be placed?" The
autoscaler builds a :class:`ScaleUpProblem` (the actionable pending jobs, the pools that may
grow and by how much, the nodes already being provisioned), hands it to a
:class:`ScaleUpSolver`, and turns the :class:`ScaleUpAnswer` into scale-up steps with
:func:`steps_from_answer`. The solver honours what the scheduler honours (fractional shares
packed onto whole devices, gangs that need one node or one interconnect domain, selectors,
``cheapest``/``fastest`` intent) and must count incoming nodes first: a job that an incoming
node will serve goes into ``served_by_incoming``, not into a new addition.

:class:`PlacementSolver` answers with the placement engine itself (``xpupool.placement``: the
scheduler's demand type, class matching and gang term) on hypothetical nodes of the pools'
shapes, so the autoscaler is not a third engine. The demand filter (:func:`split_actionable`)
keeps out demand that more hardware would not help (quota, priority, preemption already under
way, a gang waiting on its members, ...).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final, Protocol

import msgspec
import msgspec.structs

from xpupool.autoscaler.decisions import DemandSummary, ScaleStep
from xpupool.autoscaler.pools import PoolConfig
from xpupool.contracts import (
    DeviceSpec,
    Intent,
    JobReason,
    JobRequested,
    PoolShape,
    ScaleAction,
    ScaleReason,
    Vendor,
)
from xpupool.devices.catalog import Catalog, load_catalog
from xpupool.placement.demand import make_demand
from xpupool.placement.engine import HeuristicPolicy, Placement, place, place_host_only
from xpupool.placement.inventory import (
    HostCharge,
    LeaseSlice,
    LeaseState,
    PoolSnapshot,
    empty_device,
)
from xpupool.placement.inventory import NodeState as InventoryNode
from xpupool.placement.pool import WorkingPool

__all__ = [
    "ACTIONABLE_REASONS",
    "NodeState",
    "PendingJob",
    "PlacementSolver",
    "PoolAddition",
    "PoolNode",
    "ScaleUpAnswer",
    "ScaleUpProblem",
    "ScaleUpSolver",
    "job_devices",
    "device_specs",
    "node_state",
    "pool_shape",
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


# ----------------------------------------------------------------------------------------------
# The placement-backed solver.
# ----------------------------------------------------------------------------------------------


class _OneAccount:
    """Accounts for a hypothetical pool: the solver charges nothing (quota was the scheduler's
    question; demand blocked by it never reaches the solver)."""

    def charge_queue(self, tenant: str, queue: str, /) -> str:
        return "solver"

    def path(self, queue: str, /) -> Sequence[str]:
        return (queue,)


@dataclass(frozen=True, slots=True)
class _Node:
    """A node of the hypothetical fleet: its pool, whether it is incoming (already being
    provisioned) or one the solver adds, and its devices as the placement engine sees them."""

    pool: str
    incoming: bool
    state: InventoryNode


class _Fleet:
    """The hypothetical nodes and what the solver placed on them; the working pool is rebuilt
    only when a node is added (placements update it incrementally)."""

    def __init__(self, nodes: list[_Node]) -> None:
        self.nodes = nodes
        self._leases: list[LeaseState] = []
        self._pool: WorkingPool | None = None

    def pool(self) -> WorkingPool | None:
        if not self.nodes:
            return None
        if self._pool is None:
            snapshot = PoolSnapshot(nodes=tuple(n.state for n in self.nodes))
            self._pool = WorkingPool(snapshot, _OneAccount())
            for lease in self._leases:
                self._pool.add_lease(lease)
        return self._pool

    def hold(self, lease: LeaseState) -> None:
        self._leases.append(lease)
        if self._pool is not None:
            self._pool.add_lease(lease)

    def add(self, node: _Node) -> None:
        self.nodes.append(node)
        self._pool = None


class PlacementSolver:
    """:class:`ScaleUpSolver` on the placement engine: the same demand type, class matching and
    gang term the scheduler uses (``xpupool.placement``), placed on hypothetical empty nodes of
    the pools' shapes.

    The heaviest jobs go first (devices asked, gangs before shares: first-fit decreasing packs
    better than arrival order). Each job is placed on the incoming and already-added nodes if it
    fits there; otherwise the solver adds the nodes of the one pool that hosts it most cheaply
    (intent ``fastest``: the pool with the strongest devices, then the cheaper) within that
    pool's room: a gang across nodes may need several. Later jobs then pack onto the nodes added
    for earlier ones, so fractional shares fill whole devices before a new node is bought.
    """

    def __init__(self, catalog: Catalog | None = None) -> None:
        self._catalog = catalog or load_catalog()
        self._policy = HeuristicPolicy()

    def solve(self, problem: ScaleUpProblem) -> ScaleUpAnswer:
        """See the class docstring and :class:`ScaleUpSolver`."""
        pools = {p.name: p for p in problem.pools}
        fleet = _Fleet(
            [
                self._node(pools[n.pool], f"incoming-{k}", incoming=True)
                for k, n in enumerate(problem.incoming)
                if n.pool in pools
            ]
        )
        added = dict.fromkeys(pools, 0)
        where: dict[str, _Node] = {}
        unserved: dict[str, str] = {}
        needed: dict[tuple[str, bytes], int | None] = {}
        for job in sorted(problem.pending, key=_heaviest_first):
            node = self._place(fleet, job)
            if node is None:
                node = self._grow(job, pools, problem.room, added, fleet, unserved, needed)
            if node is not None:
                where[job.job_id] = node
        served = {j: n.pool for j, n in where.items() if n.incoming}
        additions = tuple(
            PoolAddition(
                pool=name,
                count=count,
                job_ids=tuple(j for j, n in where.items() if not n.incoming and n.pool == name),
            )
            for name, count in added.items()
            if count > 0
        )
        return ScaleUpAnswer(additions=additions, served_by_incoming=served, unserved=unserved)

    # -- one job ------------------------------------------------------------------------------

    def _place(self, fleet: _Fleet, job: PendingJob) -> _Node | None:
        """Place ``job`` on ``fleet`` beside what it already holds; record it and return the
        node it landed on (the first, for a gang across nodes), or None."""
        pool = fleet.pool()
        if pool is None:
            return None
        demand = make_demand(job.request, pool)
        if demand.host_only:
            found = place_host_only(pool, demand, self._policy)
        else:
            found = place(pool, demand, self._policy)
        if found is None:
            return None
        fleet.hold(_lease(job, pool, found))
        return fleet.nodes[found.host[0][0]]

    def _grow(
        self,
        job: PendingJob,
        pools: Mapping[str, PoolConfig],
        room: Mapping[str, int],
        added: dict[str, int],
        fleet: _Fleet,
        unserved: dict[str, str],
        needed: dict[tuple[str, bytes], int | None],
    ) -> _Node | None:
        """Add the cheapest nodes that host ``job`` on their own, or say why none can."""
        options: list[tuple[tuple[float, ...], PoolConfig, int]] = []
        fits_somewhere = False
        # Jobs of one shape need the same nodes: a burst of identical requests is tried once.
        shape = msgspec.json.encode(msgspec.structs.replace(job.request, job_id="", labels={}))
        for pool in pools.values():
            key = (pool.name, shape)
            if key not in needed:
                needed[key] = self._nodes_needed(pool, job)
            need = needed[key]
            if need is None:
                continue
            fits_somewhere = True
            if room.get(pool.name, 0) - added[pool.name] < need:
                continue
            options.append((_preference(pool, need, job, self._catalog), pool, need))
        if not options:
            unserved[job.job_id] = (
                "every pool that fits it is at max_size" if fits_somewhere else "no pool fits it"
            )
            return None
        _, pool, need = min(options, key=lambda o: (o[0], o[1].name))
        for _ in range(need):
            fleet.add(self._node(pool, f"{pool.name}-new-{added[pool.name]}", incoming=False))
            added[pool.name] += 1
        node = self._place(fleet, job)
        assert node is not None, "a job that fits fresh nodes fits them beside the others"
        return node

    def _nodes_needed(self, pool: PoolConfig, job: PendingJob) -> int | None:
        """How many empty nodes of ``pool`` host ``job`` alone (more than one only for a gang
        allowed across nodes), or None when no number of them does."""
        request = job.request
        per_node = max(pool.node.count, 1)
        most = 1
        if request.count > per_node and (request.gang is None or not request.gang.same_node):
            most = -(-request.count // per_node)
        for n in range(1, most + 1):
            trial = _Fleet([self._node(pool, f"trial-{k}", incoming=False) for k in range(n)])
            if self._place(trial, job) is not None:
                return n
        return None

    def _node(self, pool: PoolConfig, node_id: str, *, incoming: bool) -> _Node:
        return _Node(pool.name, incoming, node_state(pool, node_id, self._catalog))


def device_specs(pool: PoolConfig, node_id: str, catalog: Catalog) -> list[DeviceSpec]:
    """The devices of one node of ``pool``'s shape, described from the catalog as a collector
    would register them (memory, capacity, capabilities, isolation, one interconnect domain per
    node), each priced at its share of the node."""
    entry = catalog.lookup(pool.node.model)
    count = pool.node.count
    memory = (entry.memory_visible_mib or entry.memory_nominal_mib or 0) if entry else 0
    interconnect = pool.node.interconnect or (entry.interconnect if entry else "pcie")
    return [
        DeviceSpec(
            device_id=f"{node_id}/{i}",
            vendor=Vendor(pool.vendor),
            model=entry.name if entry else pool.node.model,
            index=i,
            uuid=f"{node_id}/{i}",
            memory_mib=memory,
            capacity_units=pool.capacity_units / count,
            capabilities=entry.capability_list() if entry else [],
            isolation=list(entry.isolation) if entry else [],
            interconnect=interconnect,
            domain="" if interconnect == "pcie" else f"{node_id}/{interconnect}",
            cost_per_hour=pool.cost_per_hour / count,
        )
        for i in range(count)
    ]


def pool_shape(pool: PoolConfig, catalog: Catalog) -> PoolShape:
    """What the scheduler is told a node of ``pool`` would be (see ``PoolShape``)."""
    return PoolShape(
        pool=pool.name,
        devices=device_specs(pool, f"{pool.name}#shape", catalog),
        cpu_milli=pool.node.cpu_milli,
        memory_mib=pool.node.memory_mib,
        max_size=pool.max_size,
    )


def node_state(pool: PoolConfig, node_id: str, catalog: Catalog) -> InventoryNode:
    """An empty node of ``pool``'s shape as the placement engine sees it (:func:`device_specs`)."""
    devices = tuple(empty_device(d, node_id) for d in device_specs(pool, node_id, catalog))
    return InventoryNode(
        node_id=node_id,
        devices=devices,
        cpu_milli_total=pool.node.cpu_milli,
        cpu_milli_free=pool.node.cpu_milli,
        memory_mib_total=pool.node.memory_mib,
        memory_mib_free=pool.node.memory_mib,
    )


def _heaviest_first(job: PendingJob) -> tuple[float, int, float]:
    request = job.request
    return (-job_devices(request), 0 if request.gang is not None else 1, job.since)


def _preference(
    pool: PoolConfig, need: int, job: PendingJob, catalog: Catalog
) -> tuple[float, ...]:
    """Sort key of a pool for ``job`` (smaller first): the cost of the nodes it needs, or for
    ``fastest`` the strongest device first."""
    cost = need * pool.cost_per_hour
    if job.request.intent is Intent.FASTEST:
        return (-pool.capacity_units / max(pool.node.count, 1), cost)
    return (cost,)


def _lease(job: PendingJob, pool: WorkingPool, found: Placement) -> LeaseState:
    """The hypothetical lease of a placed job, so later jobs see its devices taken."""
    slices = tuple(
        LeaseSlice(
            pool.devices[i].device_id,
            pool.devices[i].memory_total_mib if found.whole else found.memory_mib,
            100 if found.whole else found.compute_pct,
            found.whole,
        )
        for i in found.devices
    )
    host = tuple(
        HostCharge(pool.nodes[ni].node_id, cpu, mem) for ni, cpu, mem in found.host if cpu or mem
    )
    return LeaseState(
        lease_id=f"solver:{job.job_id}",
        job_id=job.job_id,
        tenant=job.tenant,
        queue=job.queue or job.tenant,
        priority=0,
        started_at_s=0.0,
        slices=slices,
        host=host,
    )
