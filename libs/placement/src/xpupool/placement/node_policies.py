"""The trace's placement policies (``xpupool.placement``) as live scheduler policies.

``xpupool replay`` measures policies on a :class:`~xpupool.placement.ClusterState`; this module
lets the scheduler place with exactly the same code, so a queue with ``placement: fgd-trace``
decides as the in-process replay does. Names: ``<policy>-trace`` for every policy of
:data:`xpupool.placement.POLICIES` (``xpupool-static-trace``, ``fgd-trace``, ...).

How the pool maps onto a ``ClusterState`` (one row per pool node, in pool order):

* a row's GPUs are the node's devices of one model (its first device's), ordered by device index,
  so "lowest GPU slot" tie-breaks pick the lowest device index as the replay does; devices of
  other models on a mixed node are invisible to these policies;
* a device's free milli-GPU is ``10 x compute_free_pct`` (0 when it is unhealthy or held whole;
  capped by its free memory fraction): the trace's ``gpu_milli`` of a sharing pod is a compute
  share, and a share with only ``compute_pct`` takes memory in proportion, so with such shares
  memory never binds before compute;
* a row's model is the device model renamed by ``aliases`` (ledger name -> the name the workload
  file uses, e.g. ``V100-SXM2-16GB`` -> ``V100M16``), so ``gpu_spec`` constraints and the FGD
  shape distribution see the names they were built with;
* host CPU and memory are the node's free host counters; the node id is the row name, which is
  the tie-break (first name wins).

A request becomes a ``PodDemand``: ``count`` GPUs, ``1000`` milli each when whole, else
``10 x compute_pct`` (or the memory fraction, rounded up, for a memory share), its host demand,
and as ``allowed_models`` the models of the quota-allowed classes (``None`` when that is every
class). The policy's choice comes back as devices of one node, charged the request's host demand.
A host-only request (``count: 0``) is the trace's CPU-only pod (``num_gpu = 0``): every node row
is a candidate, and the choice comes back as a node without devices.

Decision time: the ``ClusterState`` is kept across cycles and brought in step with the working
pool before every decision with a few vectorised comparisons (nodes whose free counters changed
get a new ``node_version``, so the FGD caches refresh only those), not rebuilt.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from xpupool.placement import POLICIES, ClusterState, NodeSpec, PodDemand, Policy, PolicyContext
from xpupool.placement.demand import Demand
from xpupool.placement.engine import (
    HOST_ONLY,
    DelegatedJudgements,
    HeuristicPolicy,
    Placement,
    PlacementPolicy,
)
from xpupool.placement.frag import ShapeDistribution
from xpupool.placement.inventory import DeviceState, NodeState, PoolSnapshot
from xpupool.placement.pool import WorkingPool
from xpupool.placement.state import MILLI, IntArray, pod_class_column

__all__ = [
    "TRACE_SUFFIX",
    "ClusterMirror",
    "TracePolicy",
    "make_trace_policies",
    "parse_aliases",
    "pod_demand",
    "trace_policy_name",
]

#: A trace policy ``fgd`` is registered in the scheduler as ``fgd-trace``.
TRACE_SUFFIX = "-trace"


def trace_policy_name(name: str) -> str:
    """The scheduler name of trace policy ``name`` (``fgd`` -> ``fgd-trace``)."""
    return f"{name}{TRACE_SUFFIX}"


def parse_aliases(text: str) -> dict[str, str]:
    """``"V100-SXM2-16GB=V100M16,P100-PCIE-16GB=P100"`` -> ledger model to workload model."""
    out: dict[str, str] = {}
    for part in text.split(","):
        if not part.strip():
            continue
        ledger_name, sep, trace_name = part.partition("=")
        if not sep or not ledger_name.strip() or not trace_name.strip():
            raise ValueError(f"bad model alias {part!r}; expected LEDGER_MODEL=TRACE_MODEL")
        out[ledger_name.strip()] = trace_name.strip()
    return out


class ClusterMirror:
    """A ``ClusterState`` with one row per node of a working pool, kept in step with it."""

    def __init__(self, pool: WorkingPool, aliases: Mapping[str, str]) -> None:
        self.signature = _signature(pool)
        rows: list[NodeSpec] = []
        row_devs: list[tuple[int, ...]] = []
        row_class: list[int] = []
        n_dev = len(pool.devices)
        self.dev_row: IntArray = np.full(n_dev, -1, dtype=np.int64)
        self.dev_slot: IntArray = np.full(n_dev, -1, dtype=np.int64)
        for ni, node in enumerate(pool.nodes):
            devs = pool.node_devs[ni]
            model = pool.devices[devs[0]].model if devs else ""
            mine = sorted(
                (i for i in devs if pool.devices[i].model == model),
                key=lambda i: (pool.devices[i].index, pool.devices[i].device_id),
            )
            for slot, i in enumerate(mine):
                self.dev_row[i] = ni
                self.dev_slot[i] = slot
            row_devs.append(tuple(mine))
            row_class.append(pool.dev_class[mine[0]] if mine else -1)
            rows.append(
                NodeSpec(
                    name=node.node_id,
                    cpu_milli=max(0, node.cpu_milli_total),
                    memory_mib=max(0, node.memory_mib_total),
                    num_gpu=len(mine),
                    model=aliases.get(model, model) if mine else "",
                )
            )
        self.state = ClusterState.from_nodes(rows)
        self._dev_mem_total: IntArray = np.array(
            [max(1, d.memory_total_mib) for d in pool.devices], dtype=np.int64
        )
        self._memory_unknown = np.array(
            [d.memory_total_mib <= 0 for d in pool.devices], dtype=np.bool_
        )
        self.row_devs = row_devs
        self.row_class: IntArray = np.array(row_class, dtype=np.int64)
        self._mapped = self.dev_row >= 0
        self._ok: np.ndarray = np.zeros(0, dtype=np.bool_)
        self._ok_of: WorkingPool | None = None
        self._leases: dict[str, tuple[int, int]] = {}

    @property
    def complete(self) -> bool:
        """Whether every device of the pool is in a row (no second model on a mixed node)."""
        return bool(self._mapped.all())

    def matches(self, pool: WorkingPool) -> bool:
        """Whether ``pool`` has the nodes and devices this mirror was built from."""
        return _signature(pool) == self.signature

    def sync(self, pool: WorkingPool) -> None:
        """Copy the pool's free counters and lease classes in; bump changed rows' versions."""
        st = self.state
        # The pool keeps numpy copies of its counters up to date incrementally; health is fixed
        # for a pool's life, so it is converted once per pool.
        arr = pool.arrays()
        if self._ok_of is not pool:
            self._ok = np.fromiter(pool.dev_ok, dtype=np.bool_, count=len(pool.devices))
            self._ok_of = pool
        comp, mem_free = arr.compute_free, arr.mem_free
        usable = self._ok & ~arr.exclusive
        # The smaller of the compute and memory fractions left: with compute-only shares the
        # memory fraction is never the smaller one, so this is exactly 10 x compute_free_pct;
        # a memory share (or the ledger's whole-device flag) still counts.
        by_mem = np.clip(mem_free, 0, None) * MILLI // self._dev_mem_total
        # A device whose memory is unknown (0) is bound by compute alone here; shares never go
        # to its class (``place_pool`` drops classes a share's memory does not fit).
        by_mem = np.where(self._memory_unknown, MILLI, by_mem)
        milli = np.where(usable, np.minimum(np.clip(comp, 0, 100) * (MILLI // 100), by_mem), 0)
        gpu = np.zeros_like(st.gpu_free)
        m = self._mapped
        gpu[self.dev_row[m], self.dev_slot[m]] = milli[m]
        cpu, mem = arr.node_cpu_free, arr.node_mem_free
        changed = (gpu != st.gpu_free).any(axis=1) | (cpu != st.cpu_free) | (mem != st.mem_free)
        if changed.any():
            st.gpu_free[changed] = gpu[changed]
            st.cpu_free[changed] = cpu[changed]
            st.mem_free[changed] = mem[changed]
            st.node_version[changed] += 1
        self._sync_classes(pool)

    def _sync_classes(self, pool: WorkingPool) -> None:
        # Only the clustering policy reads the per-node pod classes; a set difference over the
        # lease ids keeps them exact at a small cost per decision.
        st = self.state
        known = self._leases
        current = pool.leases
        if len(known) == len(current) and known.keys() == current.keys():
            return
        for lease_id in known.keys() - current.keys():
            row, col = known.pop(lease_id)
            if col >= 0:
                st.class_counts[row, col] -= 1
            st.pod_count[row] -= 1
            st.node_version[row] += 1
        for lease_id in current.keys() - known.keys():
            pl = current[lease_id]
            slices = pl.state.slices
            if slices:
                rows = [int(self.dev_row[i]) for i in pl.devices if self.dev_row[i] >= 0]
            else:
                rows = sorted(pl.nodes)  # host-only: a CPU-only pod on its node's row
            if not rows:
                continue
            if not slices:
                milli = 0
            elif all(s.whole for s in slices):
                milli = MILLI
            else:
                milli = max(s.compute_pct for s in slices) * (MILLI // 100)
            col = pod_class_column(len(slices), milli)
            known[lease_id] = (rows[0], col)
            if col >= 0:
                st.class_counts[rows[0], col] += 1
            st.pod_count[rows[0]] += 1
            st.node_version[rows[0]] += 1

    def restricted(self, rows_ok: np.ndarray, devs_ok: np.ndarray | None) -> ClusterState:
        """A copy where rows outside ``rows_ok`` (and devices outside ``devs_ok``) cannot host."""
        st = self.state.copy()
        st.cpu_free[~rows_ok] = -1
        if devs_ok is not None:
            m = self._mapped & ~devs_ok
            st.gpu_free[self.dev_row[m], self.dev_slot[m]] = 0
        return st


def _signature(pool: WorkingPool) -> tuple[object, ...]:
    return (
        tuple(n.node_id for n in pool.nodes),
        tuple(d.device_id for d in pool.devices),
        tuple(n.cpu_milli_total for n in pool.nodes),
        tuple(n.memory_mib_total for n in pool.nodes),
        tuple(pool.dev_class),
    )


def trace_snapshot(
    nodes: Sequence[NodeSpec],
    model_names: Mapping[str, str] | None = None,
    memory_mib: int = 16_000,
) -> PoolSnapshot:
    """A fresh pool of the trace's nodes as the domain sees it: one NVIDIA device per GPU, the
    model renamed through ``model_names``. The trace gives no device memory, so every device has
    ``memory_mib`` (shares in the trace are compute shares)."""
    names = model_names or {}
    return PoolSnapshot(
        nodes=tuple(
            NodeState(
                n.name,
                tuple(
                    DeviceState(
                        f"{n.name}/nvidia{k}",
                        n.name,
                        "nvidia",
                        names.get(n.model, n.model),
                        memory_mib,
                        memory_mib,
                        index=k,
                    )
                    for k in range(n.num_gpu)
                ),
                n.cpu_milli,
                n.cpu_milli,
                n.memory_mib,
                n.memory_mib,
            )
            for n in nodes
        )
    )


def pod_demand(
    pool: WorkingPool, demand: Demand, allowed_models: frozenset[str] | None
) -> PodDemand:
    """The trace's view of ``demand``: GPUs, milli-GPU per GPU, host CPU and memory."""
    if demand.host_only:
        return PodDemand(cpu_milli=demand.cpu_milli, memory_mib=demand.host_memory_mib)
    if demand.whole:
        milli = MILLI
    else:
        # Memory as a fraction of the smallest matching device: never less than the share
        # really takes on any of them, so the milli-GPU view cannot over-commit memory.
        cls = min(
            (pool.classes[ci] for ci in demand.classes),
            key=lambda c: c.memory_total_mib,
            default=None,
        )
        compute = demand.compute_pct or 0
        milli = compute * (MILLI // 100)
        if cls is not None and (demand.memory_mib is not None or demand.memory_pct is not None):
            mem, _ = demand.share(cls)
            total = max(cls.memory_total_mib, 1)
            milli = max(milli, -(-mem * MILLI // total))
        milli = min(MILLI, max(1, milli))
    return PodDemand(
        cpu_milli=demand.cpu_milli,
        memory_mib=demand.host_memory_mib,
        num_gpu=demand.count,
        gpu_milli=milli,
        allowed_models=allowed_models,
    )


@dataclass
class TracePolicy(DelegatedJudgements):
    """A trace policy answering for the scheduler (see the module docstring).

    ``base`` serves the engine's per-class judgements (preemption planning, explanations).
    """

    name: str
    inner: Policy
    aliases: Mapping[str, str] = field(default_factory=dict)
    base: PlacementPolicy = field(default_factory=HeuristicPolicy)
    _mirror: ClusterMirror | None = field(default=None, repr=False)
    _pool: WorkingPool | None = field(default=None, repr=False)

    def mirror(self, pool: WorkingPool) -> ClusterMirror:
        """The ``ClusterState`` mirror of ``pool``, in step with it now."""
        mirror = self._mirror
        if self._pool is not pool:
            # A new cycle's pool: keep the mirror (and the policies' caches) if the inventory
            # is the same, which it almost always is.
            if mirror is None or not mirror.matches(pool):
                mirror = self._mirror = ClusterMirror(pool, self.aliases)
            self._pool = pool
        assert mirror is not None
        mirror.sync(pool)
        return mirror

    def place_pool(
        self,
        pool: WorkingPool,
        demand: Demand,
        classes: Sequence[int],
        *,
        respect_holds: bool = True,
    ) -> Placement | None:
        """The inner policy's choice over every node whose devices are of ``classes``.

        A host-only demand (``count: 0``, ``classes`` empty) is a CPU-only pod: every node row
        (but held ones) is a candidate, and the placement has no devices.
        """
        if demand.host_only:
            return self._place_host_only(pool, demand, respect_holds)
        # A share larger than a class's device memory never fits there; the milli-GPU view
        # caps a share at one whole device and would not notice.
        classes = [
            ci
            for ci in classes
            if demand.share(pool.classes[ci])[0] <= pool.classes[ci].memory_total_mib
        ]
        if not classes:
            return None
        mirror = self.mirror(pool)
        st = mirror.state
        wanted = set(classes)
        rows_ok = np.isin(mirror.row_class, np.fromiter(wanted, dtype=np.int64))
        gpu_rows = st.num_gpu > 0
        models = frozenset(st.models[int(m)] for m in np.unique(st.model_id[rows_ok & gpu_rows]))
        every = frozenset(st.models[int(m)] for m in np.unique(st.model_id[gpu_rows]))
        allowed = None if models == every else models
        exact = bool(np.array_equal(st.model_mask(allowed) & gpu_rows, rows_ok & gpu_rows))
        held = respect_holds and bool(pool.held_nodes)
        state = st
        if not exact or held or demand.id_filtered:
            if held:
                rows_ok = rows_ok.copy()
                rows_ok[list(pool.held_nodes)] = False
            devs_ok = None
            if demand.id_filtered:
                devs_ok = np.array(
                    [
                        (demand.allowed is None or i in demand.allowed) and i not in demand.avoided
                        for i in range(len(pool.devices))
                    ],
                    dtype=np.bool_,
                )
            state = mirror.restricted(rows_ok, devs_ok)
        pod = pod_demand(pool, demand, allowed)
        choice = self.inner.choose(state, pod)
        if choice is None:
            return None
        ni = choice.node
        devices = tuple(mirror.row_devs[ni][g] for g in choice.gpus)
        ci = pool.dev_class[devices[0]] if devices else classes[0]
        mem, comp = demand.share(pool.classes[ci])
        return Placement(
            ci,
            devices,
            mem,
            comp,
            demand.whole,
            ((ni, demand.cpu_milli, demand.host_memory_mib),),
            0.0,
            self.name,
        )

    def _place_host_only(
        self, pool: WorkingPool, demand: Demand, respect_holds: bool
    ) -> Placement | None:
        mirror = self.mirror(pool)
        state = mirror.state
        rows_ok = np.array(pool.node_up, dtype=np.bool_)
        if respect_holds and pool.held_nodes:
            rows_ok[list(pool.held_nodes)] = False
        if not rows_ok.all():
            state = mirror.restricted(rows_ok, None)
        choice = self.inner.choose(state, pod_demand(pool, demand, None))
        if choice is None:
            return None
        return Placement(
            HOST_ONLY,
            (),
            0,
            0,
            False,
            ((choice.node, demand.cpu_milli, demand.host_memory_mib),),
            0.0,
            self.name,
        )


def make_trace_policies(
    workload: Sequence[PodDemand] | None = None,
    aliases: Mapping[str, str] | None = None,
    seed: int = 0,
    names: Sequence[str] | None = None,
) -> list[TracePolicy]:
    """One :class:`TracePolicy` per trace policy, built as ``xpupool replay`` builds them.

    ``workload`` is the pod list the policies are told to expect (the replay's original list;
    FGD takes its typical shapes, ours the full distribution); policies that need one are left
    out without it. ``seed`` seeds the random policy's generator (as the replay's seed does).
    """
    typical = ShapeDistribution.typical(workload) if workload else None
    out: list[TracePolicy] = []
    # ``xpupool-online`` learns from the requests it places; in the scheduler that is the default
    # policy itself (``learned_policy``), which learns once per request, not once per retry.
    default_names = tuple(k for k in POLICIES if k != "xpupool-online")
    for key in names if names is not None else default_names:
        ctx = PolicyContext(
            rng=np.random.default_rng(seed),
            workload=list(workload) if workload else None,
            typical=typical,
        )
        try:
            inner = POLICIES[key](ctx)
        except ValueError:
            continue  # needs a workload description that was not given
        out.append(TracePolicy(trace_policy_name(key), inner, dict(aliases or {})))
    return out
