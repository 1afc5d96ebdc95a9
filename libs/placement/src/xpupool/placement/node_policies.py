"""The node-view policies (FGD, the baselines, the fragmentation policy) placing on a working pool.

The pool model has two faces: the per-device counters of :class:`~.pool.WorkingPool` (memory in
MiB, compute in percent, host CPU and memory), and the vectorised per-node view
(:class:`NodeView`, a :class:`~xpupool.placement.ClusterState` in milli-GPU) that the node-view
policies score every node with at once. ``xpupool replay`` measures these policies on the view
alone; this module lets the scheduler place with exactly the same code, so a queue with
``placement: fgd-trace`` decides as the in-process replay does. Names: ``<policy>-trace`` for
every policy of :data:`xpupool.placement.POLICIES` (``xpupool-static-trace``, ``fgd-trace``, ...).

How the pool maps onto the view (one row per pool node and device class, in pool order):

* a row's GPUs are the node's devices of one class, ordered by device index, so "lowest GPU
  slot" tie-breaks pick the lowest device index as the replay does; a mixed node has one row
  per class, each with the node's host counters, so no device is invisible;
* a device's free milli-GPU is ``10 x compute_free_pct`` (0 when it is unhealthy or held whole;
  capped by its free memory fraction): the trace's ``gpu_milli`` of a sharing pod is a compute
  share, and a share with only ``compute_pct`` takes memory in proportion, so with such shares
  memory never binds before compute;
* a row's model is the device model renamed by ``aliases`` (ledger name -> the name the workload
  file uses, e.g. ``V100-SXM2-16GB`` -> ``V100M16``), so ``gpu_spec`` constraints and the FGD
  shape distribution see the names they were built with;
* host CPU and memory are the node's free host counters; the node id is the first row's name
  (``<node>#<model>`` for the others), which is the tie-break (first name wins);
* feasibility is the pool's: the view's whole milli of memory can only refuse a share that fits
  (never admit one that does not), and when it refuses all, the share is decided again on a
  copy of the view that admits exactly the devices it fits on in MiB and percent.

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

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

import numpy as np
import numpy.ma  # noqa: F401  (np.unique imports it on first use: here, not in a first decision)

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
from xpupool.placement.pool import PoolArrays, WorkingPool
from xpupool.placement.state import MILLI, BoolArray, IntArray, pod_class_column

# At most this many changed rows are synced one by one in Python (``NodeView._sync_few_rows``);
# more go through numpy at once.
FEW_ROWS: Final = 4

__all__ = [
    "TRACE_SUFFIX",
    "NodeView",
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


class NodeView:
    """The pool's vectorised per-node view (a ``ClusterState``), kept in step with the pool.

    One row per node and device class, in pool order: a node with one class is one row named by
    its node id; each further class of a mixed node (another model, or MIG instances of another
    size) is one more row (``<node>#<model>``) with the node's host counters, so every device of
    the pool is in exactly one row and a policy choosing a row chooses devices of one class on
    one node.
    """

    def __init__(self, pool: WorkingPool, aliases: Mapping[str, str]) -> None:
        self.signature = _signature(pool)
        rows: list[NodeSpec] = []
        row_devs: list[tuple[int, ...]] = []
        row_class: list[int] = []
        row_node: list[int] = []
        first_row: list[int] = []
        n_dev = len(pool.devices)
        self.dev_row: IntArray = np.full(n_dev, -1, dtype=np.int64)
        self.dev_slot: IntArray = np.full(n_dev, -1, dtype=np.int64)
        for ni, node in enumerate(pool.nodes):
            first_row.append(len(rows))
            by_class: dict[int, list[int]] = {}
            for i in pool.node_devs[ni]:
                by_class.setdefault(pool.dev_class[i], []).append(i)
            groups = [(pool.classes[ci].model, devs) for ci, devs in by_class.items()]
            names: set[str] = set()
            for k, (model, devs) in enumerate(groups or [("", [])]):
                name = node.node_id if k == 0 else f"{node.node_id}#{model}"
                if name in names:
                    name = f"{name}#{k}"
                names.add(name)
                mine = sorted(
                    devs, key=lambda i: (pool.devices[i].index, pool.devices[i].device_id)
                )
                row = len(rows)
                for slot, i in enumerate(mine):
                    self.dev_row[i] = row
                    self.dev_slot[i] = slot
                row_devs.append(tuple(mine))
                row_class.append(pool.dev_class[mine[0]] if mine else -1)
                row_node.append(ni)
                rows.append(
                    NodeSpec(
                        name=name,
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
        # Plain lists of the same, for syncing a few rows without numpy's per-call cost.
        self._row_devs_slots = [[(i, int(self.dev_slot[i])) for i in devs] for devs in row_devs]
        self._row_node_list = row_node
        self._dev_mem_total_list = [d.memory_total_mib for d in pool.devices]
        self.row_devs = row_devs
        self.row_class: IntArray = np.array(row_class, dtype=np.int64)
        self.row_node: IntArray = np.array(row_node, dtype=np.int64)
        """The pool node index of each row."""
        self.first_row: IntArray = np.array(first_row, dtype=np.int64)
        """The first row of each pool node (where its host-only leases are counted)."""
        self._mapped = self.dev_row >= 0
        self._ok: np.ndarray = np.zeros(0, dtype=np.bool_)
        self._ok_of: WorkingPool | None = None
        # Where this view is in its pool's log of counter changes
        # (``WorkingPool.counter_changes``): None when the next sync compares every row.
        self._counters_at: tuple[WorkingPool, int, int, int] | None = None
        # Per set of device classes: its rows, allowed models and exactness (``class_rows``);
        # rows, models and classes are fixed for the view's life.
        self._class_rows: dict[frozenset[int], tuple[BoolArray, frozenset[str] | None, bool]] = {}
        self._row_end: IntArray = np.append(self.first_row[1:], len(rows)).astype(np.int64)
        """One past the last row of each pool node (a node's rows are consecutive)."""
        self._leases: dict[str, tuple[int, int]] = {}
        # Where this view is in its pool's log of lease changes (``WorkingPool.lease_changes``).
        self._log_of: WorkingPool | None = None
        self._log_epoch = -1
        self._log_pos = 0

    def class_rows(self, classes: Iterable[int]) -> tuple[BoolArray, frozenset[str] | None, bool]:
        """The rows of device classes ``classes``, the models they hold as ``allowed_models``
        (None: every model of the view), and whether those models' rows are exactly these
        (or also hold other classes of the same model). The array is shared: copy to change it.
        """
        key = frozenset(classes)
        found = self._class_rows.get(key)
        if found is None:
            st = self.state
            rows_ok = np.isin(self.row_class, np.fromiter(key, dtype=np.int64))
            gpu_rows = st.num_gpu > 0
            models = frozenset(
                st.models[int(m)] for m in np.unique(st.model_id[rows_ok & gpu_rows])
            )
            every = frozenset(st.models[int(m)] for m in np.unique(st.model_id[gpu_rows]))
            allowed = None if models == every else models
            exact = bool(np.array_equal(st.model_mask(allowed) & gpu_rows, rows_ok & gpu_rows))
            rows_ok.flags.writeable = False
            found = self._class_rows[key] = (rows_ok, allowed, exact)
        return found

    def matches(self, pool: WorkingPool) -> bool:
        """Whether ``pool`` has the nodes and devices this view was built from."""
        return _signature(pool) == self.signature

    def rows_of(self, nodes: Iterable[int]) -> IntArray:
        """Every row of the pool nodes ``nodes``."""
        wanted = np.fromiter(nodes, dtype=np.int64)
        return np.flatnonzero(np.isin(self.row_node, wanted))

    def sync(self, pool: WorkingPool) -> None:
        """Copy the pool's free counters and lease classes in; bump changed rows' versions.

        Only the rows of devices and nodes the pool logged since the last sync of the same pool
        are compared; every row is, for another pool or after the pool's log started over.
        """
        # The pool keeps numpy copies of its counters up to date incrementally; health is fixed
        # for a pool's life, so it is converted once per pool.
        arr = pool.arrays()
        if self._ok_of is not pool:
            self._ok = pool.devices_ok
            self._ok_of = pool
        devices, nodes = pool.counter_changes
        at = self._counters_at
        if at is not None and at[0] is pool and at[1] == pool.counter_changes_epoch:
            rows = self._changed_rows(devices[at[2] :], nodes[at[3] :])
            if len(rows) <= FEW_ROWS:
                self._sync_few_rows(pool, rows.tolist())
            else:
                self._sync_rows(arr, rows)
        else:
            self._sync_rows(arr, None)
        self._counters_at = (pool, pool.counter_changes_epoch, len(devices), len(nodes))
        self._sync_classes(pool)

    def _changed_rows(self, devices: Sequence[int], nodes: Sequence[int]) -> IntArray:
        rows = {int(r) for r in self.dev_row[list(devices)] if r >= 0} if devices else set()
        for ni in set(nodes):
            rows.update(range(int(self.first_row[ni]), int(self._row_end[ni])))
        return np.array(sorted(rows), dtype=np.int64)

    def _sync_rows(self, arr: PoolArrays, rows: IntArray | None) -> None:
        """Bring ``rows`` (None: every row) in step with the pool's counters."""
        st = self.state
        if rows is None:
            gpu = np.zeros_like(st.gpu_free)
            m = self._mapped
            gpu[self.dev_row[m], self.dev_slot[m]] = self.free_milli(arr)[m]
            row_node = self.row_node
            gpu_now, cpu_now, mem_now = st.gpu_free, st.cpu_free, st.mem_free
        else:
            if not len(rows):
                return
            devs = np.concatenate([self.row_devs[r] for r in rows.tolist()]).astype(np.int64)
            gpu = np.zeros((len(rows), st.gpu_free.shape[1]), dtype=st.gpu_free.dtype)
            if len(devs):
                local = np.searchsorted(rows, self.dev_row[devs])
                gpu[local, self.dev_slot[devs]] = self.free_milli(arr, devs)
            row_node = self.row_node[rows]
            gpu_now, cpu_now, mem_now = st.gpu_free[rows], st.cpu_free[rows], st.mem_free[rows]
        cpu, mem = arr.node_cpu_free[row_node], arr.node_mem_free[row_node]
        changed = (gpu != gpu_now).any(axis=1) | (cpu != cpu_now) | (mem != mem_now)
        if changed.any():
            at = changed if rows is None else rows[changed]
            st.gpu_free[at] = gpu[changed]
            st.cpu_free[at] = cpu[changed]
            st.mem_free[at] = mem[changed]
            st.node_version[at] += 1

    def _sync_few_rows(self, pool: WorkingPool, rows: list[int]) -> None:
        """``_sync_rows`` for a few rows (what one decision or one release changed), from the
        pool's own lists: the same values ``free_milli`` gives, one device at a time."""
        st = self.state
        ok, exclusive = pool.dev_ok, pool.dev_exclusive
        mem_free, compute_free = pool.dev_mem_free, pool.dev_compute_free
        mem_total = self._dev_mem_total_list
        width = st.gpu_free.shape[1]
        for row in rows:
            gpu = [0] * width
            for i, slot in self._row_devs_slots[row]:
                if not ok[i] or exclusive[i]:
                    continue
                by_compute = min(max(compute_free[i], 0), 100) * (MILLI // 100)
                # Memory unknown (recorded as 0): bound by compute alone, as in ``free_milli``.
                total = mem_total[i]
                by_mem = MILLI if total <= 0 else max(mem_free[i], 0) * MILLI // total
                gpu[slot] = min(by_compute, by_mem)
            ni = self._row_node_list[row]
            cpu, mem = pool.node_cpu_free[ni], pool.node_mem_free[ni]
            if (
                gpu != st.gpu_free[row].tolist()
                or cpu != st.cpu_free[row]
                or mem != st.mem_free[row]
            ):
                st.gpu_free[row] = gpu
                st.cpu_free[row] = cpu
                st.mem_free[row] = mem
                st.node_version[row] += 1

    def free_milli(self, arr: PoolArrays, devices: IntArray | None = None) -> IntArray:
        """Each device's free milli-GPU (of ``devices``, by index, when given): the smaller of
        its compute and memory fractions left.

        With compute-only shares the memory fraction is never the smaller one, so this is
        exactly 10 x compute_free_pct; a memory share (or a device held whole) still counts.
        Unhealthy and whole-held devices have none.
        """
        at = slice(None) if devices is None else devices
        usable = self._ok[at] & ~arr.exclusive[at]
        by_mem = np.clip(arr.mem_free[at], 0, None) * MILLI // self._dev_mem_total[at]
        # A device whose memory is unknown (0) is bound by compute alone here; shares never go
        # to its class (``place_pool`` drops classes a share's memory does not fit).
        by_mem = np.where(self._memory_unknown[at], MILLI, by_mem)
        milli = np.minimum(np.clip(arr.compute_free[at], 0, 100) * (MILLI // 100), by_mem)
        return np.where(usable, milli, 0)

    def _sync_classes(self, pool: WorkingPool) -> None:
        # Only the clustering policy reads the per-node pod classes; a set difference over the
        # lease ids keeps them exact at a small cost per decision.
        st = self.state
        known = self._leases
        current = pool.leases
        # The ids whose membership may differ: those the pool logged since the last sync, or
        # (another pool, or its log restarted) every id on either side.
        if self._log_of is pool and self._log_epoch == pool.lease_changes_epoch:
            logged = pool.lease_changes[self._log_pos :]
            gone = [i for i in dict.fromkeys(logged) if i in known and i not in current]
            new = [i for i in dict.fromkeys(logged) if i in current and i not in known]
        elif len(known) == len(current) and known.keys() == current.keys():
            gone, new = [], []
        else:
            gone, new = list(known.keys() - current.keys()), list(current.keys() - known.keys())
        self._log_of, self._log_epoch = pool, pool.lease_changes_epoch
        self._log_pos = len(pool.lease_changes)
        for lease_id in gone:
            row, col = known.pop(lease_id)
            if col >= 0:
                st.class_counts[row, col] -= 1
            st.pod_count[row] -= 1
            st.node_version[row] += 1
        for lease_id in new:
            pl = current[lease_id]
            slices = pl.state.slices
            if slices:
                rows = [int(self.dev_row[i]) for i in pl.devices if self.dev_row[i] >= 0]
            else:
                # host-only: a CPU-only pod on its node's first row
                rows = [int(self.first_row[ni]) for ni in sorted(pl.nodes)]
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

    def restricted(
        self, rows_ok: np.ndarray, devs_ok: np.ndarray | None, exact: tuple[BoolArray, int] | None
    ) -> ClusterState:
        """A copy where rows outside ``rows_ok`` (and devices outside ``devs_ok``) cannot host.

        ``exact`` = (devices a share fits on, counted in MiB and percent, its milli-GPU): the
        copy's free milli-GPU then says "fits" on exactly those devices, so the view's rounding
        (whole milli of memory) neither refuses nor admits a share the pool would not.
        """
        st = self.state.copy()
        st.cpu_free[~rows_ok] = -1
        m = self._mapped
        if exact is not None:
            fits, milli = exact
            r, c = self.dev_row[m], self.dev_slot[m]
            now = st.gpu_free[r, c]
            st.gpu_free[r, c] = np.where(
                fits[m], np.maximum(now, milli), np.minimum(now, milli - 1)
            )
        if devs_ok is not None:
            off = m & ~devs_ok
            st.gpu_free[self.dev_row[off], self.dev_slot[off]] = 0
        return st


def _signature(pool: WorkingPool) -> tuple[object, ...]:
    return (
        tuple(n.node_id for n in pool.nodes),
        tuple(d.device_id for d in pool.devices),
        tuple(n.cpu_milli_total for n in pool.nodes),
        tuple(n.memory_mib_total for n in pool.nodes),
        tuple(pool.dev_class),
    )


def pod_demand(
    pool: WorkingPool,
    demand: Demand,
    allowed_models: frozenset[str] | None,
    classes: Sequence[int] | None = None,
) -> PodDemand:
    """The trace's view of ``demand``: GPUs, milli-GPU per GPU, host CPU and memory.

    ``classes``: the device classes it is placed on (``demand.classes`` when None).
    """
    if demand.host_only:
        return PodDemand(cpu_milli=demand.cpu_milli, memory_mib=demand.host_memory_mib)
    if demand.whole:
        milli = MILLI
    else:
        # Memory as a fraction of the smallest device it may go to: never less than the share
        # really takes on any of them, so the milli-GPU view cannot over-commit memory. Only
        # classes the share fits on count: measured against a smaller device (a 24 GiB share
        # beside 16 GiB cards, a device of unknown memory) it came out as a whole GPU, which
        # sent it to an idle device instead of one already shared.
        cls = min(
            (
                c
                for c in (
                    pool.classes[ci] for ci in (demand.classes if classes is None else classes)
                )
                if demand.share(c)[0] <= c.memory_total_mib
            ),
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
    """A node-view policy answering for the scheduler (see the module docstring).

    ``base`` serves the engine's per-class judgements (preemption planning, explanations).
    """

    name: str
    inner: Policy
    aliases: Mapping[str, str] = field(default_factory=dict)
    base: PlacementPolicy = field(default_factory=HeuristicPolicy)
    _view: NodeView | None = field(default=None, repr=False)
    _pool: WorkingPool | None = field(default=None, repr=False)

    def view(self, pool: WorkingPool) -> NodeView:
        """The per-node view of ``pool``, in step with it now."""
        view = self._view
        if self._pool is not pool:
            # A new cycle's pool: keep the view (and the policies' caches) if the inventory
            # is the same, which it almost always is.
            if view is None or not view.matches(pool):
                view = self._view = NodeView(pool, self.aliases)
            self._pool = pool
        assert view is not None
        view.sync(pool)
        return view

    def place_pool(
        self,
        pool: WorkingPool,
        demand: Demand,
        classes: Sequence[int],
        *,
        respect_holds: bool = True,
    ) -> Placement | None:
        """The inner policy's choice over every row whose devices are of ``classes``.

        A host-only demand (``count: 0``, ``classes`` empty) is a CPU-only pod: every node row
        (but held ones) is a candidate, and the placement has no devices. Feasibility is the
        pool's own: a share the view's whole-milli rounding would turn away is decided again on
        a copy that admits exactly the devices it fits on in MiB and percent.
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
        view = self.view(pool)
        st = view.state
        rows_ok, allowed, exact = view.class_rows(classes)
        held = respect_holds and bool(pool.held_nodes)
        if held:
            rows_ok = rows_ok.copy()
            rows_ok[view.rows_of(pool.held_nodes)] = False
        devs_ok = None
        if demand.id_filtered:
            devs_ok = np.array(
                [
                    (demand.allowed is None or i in demand.allowed) and i not in demand.avoided
                    for i in range(len(pool.devices))
                ],
                dtype=np.bool_,
            )
        pod = pod_demand(pool, demand, allowed, classes)
        state = st
        if not exact or held or devs_ok is not None:
            state = view.restricted(rows_ok, devs_ok, None)
        choice = self.inner.choose(state, pod)
        if choice is None and not demand.whole:
            fits = _share_fits(pool, demand, classes)
            if devs_ok is not None:
                fits &= devs_ok
            rows_with = np.zeros(len(rows_ok), dtype=np.bool_)
            rows_with[view.dev_row[fits & (view.dev_row >= 0)]] = True
            if (rows_with & rows_ok).any():
                state = view.restricted(rows_ok, devs_ok, (fits, pod.gpu_milli))
                choice = self.inner.choose(state, pod)
        if choice is None:
            return None
        row = choice.node
        devices = tuple(view.row_devs[row][g] for g in choice.gpus)
        ci = pool.dev_class[devices[0]] if devices else classes[0]
        mem, comp = demand.share(pool.classes[ci])
        ni = int(view.row_node[row])
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
        view = self.view(pool)
        state = view.state
        rows_ok = np.array(pool.node_up, dtype=np.bool_)[view.row_node]
        if respect_holds and pool.held_nodes:
            rows_ok[view.rows_of(pool.held_nodes)] = False
        if not rows_ok.all():
            state = view.restricted(rows_ok, None, None)
        choice = self.inner.choose(state, pod_demand(pool, demand, None))
        if choice is None:
            return None
        ni = int(view.row_node[choice.node])
        return Placement(
            HOST_ONLY,
            (),
            0,
            0,
            False,
            ((ni, demand.cpu_milli, demand.host_memory_mib),),
            0.0,
            self.name,
        )


def _share_fits(pool: WorkingPool, demand: Demand, classes: Sequence[int]) -> BoolArray:
    """Devices of ``classes`` that one slice of the share ``demand`` fits on now (MiB, %)."""
    need_mem = np.full(len(pool.classes), np.iinfo(np.int64).max, dtype=np.int64)
    need_comp = np.full(len(pool.classes), 101, dtype=np.int64)
    for ci in classes:
        need_mem[ci], need_comp[ci] = demand.share(pool.classes[ci])
    dev_class = pool.device_classes
    arr = pool.arrays()
    return (
        pool.devices_ok
        & ~arr.exclusive
        & (arr.mem_free >= need_mem[dev_class])
        & (arr.compute_free >= need_comp[dev_class])
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
