"""Cluster state, pod demands and placements.

Everything a placement policy looks at lives in numpy arrays indexed by node (and GPU slot), so a
policy can score all nodes of a ~1,000-node cluster with a handful of vectorised operations. The
state is mutated only through :meth:`ClusterState.allocate` and :meth:`ClusterState.release`, which
validate the placement first: a policy bug can never drive a counter negative silently.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

import numpy as np
import numpy.typing as npt

#: One GPU expressed in milli-GPU, the unit every GPU quantity in this package uses.
MILLI: Final = 1000

#: Number of pod-class columns kept per node (share + 1..8 whole GPUs); pods asking for more
#: whole GPUs than this are counted in the last column.
MAX_CLASS_GPUS: Final = 8

IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]
FloatArray = npt.NDArray[np.float64]


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """Static description of one node: capacities and GPU model ("" when it has no GPU)."""

    name: str
    cpu_milli: int
    memory_mib: int
    num_gpu: int
    model: str = ""

    def __post_init__(self) -> None:
        if self.cpu_milli < 0 or self.memory_mib < 0 or self.num_gpu < 0:
            raise ValueError(f"node {self.name!r}: negative capacity")


@dataclass(frozen=True, slots=True)
class PodDemand:
    """What one pod asks for.

    ``gpu_milli`` is per GPU: a sharing pod has ``num_gpu == 1`` and ``gpu_milli < 1000``; a
    whole-GPU pod has ``gpu_milli == 1000``. ``allowed_models`` is ``None`` when any GPU model will
    do, otherwise the set of acceptable model strings.
    """

    cpu_milli: int
    memory_mib: int
    num_gpu: int = 0
    gpu_milli: int = 0
    allowed_models: frozenset[str] | None = None
    name: str = ""

    def __post_init__(self) -> None:
        if self.cpu_milli < 0 or self.memory_mib < 0 or self.num_gpu < 0:
            raise ValueError(f"pod {self.name!r}: negative request")
        if self.num_gpu == 0 and self.gpu_milli != 0:
            raise ValueError(f"pod {self.name!r}: gpu_milli without GPUs")
        if self.num_gpu > 0 and not 0 < self.gpu_milli <= MILLI:
            raise ValueError(f"pod {self.name!r}: gpu_milli must be in 1..{MILLI}")

    @property
    def gpu_request_milli(self) -> int:
        """Total GPU milli the pod consumes (num_gpu x gpu_milli)."""
        return self.num_gpu * self.gpu_milli

    @property
    def is_cpu_only(self) -> bool:
        """True when the pod asks for no GPU."""
        return self.num_gpu == 0

    @property
    def is_sharing(self) -> bool:
        """True for a fraction of one GPU."""
        return self.num_gpu == 1 and self.gpu_milli < MILLI

    @property
    def kind(self) -> str:
        """Rejection-report class: ``cpu``, ``share``, ``one`` or ``multi``."""
        if self.num_gpu == 0:
            return "cpu"
        if self.is_sharing:
            return "share"
        return "one" if self.num_gpu == 1 else "multi"


def pod_class_column(num_gpu: int, gpu_milli: int) -> int:
    """Column of the per-node class counter: 0 = sharing, k = k whole GPUs, -1 = CPU-only."""
    if num_gpu == 0:
        return -1
    if gpu_milli < MILLI:
        return 0
    return min(num_gpu, MAX_CLASS_GPUS)


@dataclass(frozen=True, slots=True)
class NodeChoice:
    """Where a pod goes: node index, GPU slot indices on that node and milli taken from each.

    CPU and memory are carried so that :meth:`ClusterState.release` can undo the placement
    without looking the pod up again.
    """

    node: int
    gpus: tuple[int, ...]
    gpu_milli: int
    cpu_milli: int
    memory_mib: int

    @classmethod
    def for_pod(cls, node: int, gpus: Sequence[int], pod: PodDemand) -> NodeChoice:
        """Build the placement of ``pod`` on ``node`` using GPU slots ``gpus``."""
        return cls(
            node=int(node),
            gpus=tuple(int(g) for g in gpus),
            gpu_milli=pod.gpu_milli if pod.num_gpu else 0,
            cpu_milli=pod.cpu_milli,
            memory_mib=pod.memory_mib,
        )

    @property
    def class_column(self) -> int:
        """Per-node class counter column this placement is counted in."""
        return pod_class_column(len(self.gpus), self.gpu_milli)


_FEASIBLE_SHAPES = 256
"""Pod shapes whose feasibility a state keeps (``ClusterState.feasible``); past that it starts
over (a workload has a few dozen shapes, a trace a few hundred)."""


@dataclass(eq=False)
class ClusterState:
    """Mutable resource ledger of a cluster, laid out for vectorised scoring.

    Node ``i`` has ``num_gpu[i]`` GPU slots ``gpu_free[i, :num_gpu[i]]``; the padding slots are
    kept at 0 free and ``gpu_exists`` False so that "free >= request" tests never select them.
    ``node_version[i]`` increases on every change to node ``i`` so policies can cache per-node
    derived values and refresh only what changed.
    """

    names: tuple[str, ...]
    models: tuple[str, ...]
    model_id: IntArray
    cpu_cap: IntArray
    mem_cap: IntArray
    cpu_free: IntArray
    mem_free: IntArray
    num_gpu: IntArray
    gpu_free: IntArray
    gpu_exists: BoolArray
    class_counts: IntArray
    pod_count: IntArray
    node_version: IntArray
    name_rank: IntArray
    _model_masks: dict[frozenset[str] | None, BoolArray] = field(default_factory=dict, repr=False)
    # ``feasible`` per pod shape, with the node versions it was computed at.
    _feasible: dict[tuple[object, ...], tuple[BoolArray, IntArray]] = field(
        default_factory=dict, repr=False
    )
    #: Identity of this state's history, for caches kept by policies (a copy gets a new one).
    token: object = field(default_factory=object, repr=False)
    _earlier_slots: BoolArray | None = field(default=None, repr=False)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_nodes(cls, nodes: Sequence[NodeSpec]) -> ClusterState:
        """Build an empty (nothing allocated) state from node specs, keeping their order."""
        if not nodes:
            raise ValueError("a cluster needs at least one node")
        names = tuple(n.name for n in nodes)
        if len(set(names)) != len(names):
            raise ValueError("node names must be unique")
        models = tuple(sorted({n.model for n in nodes}))
        model_index = {m: i for i, m in enumerate(models)}
        n = len(nodes)
        width = max(1, max(nd.num_gpu for nd in nodes))
        num_gpu = np.array([nd.num_gpu for nd in nodes], dtype=np.int64)
        exists = np.arange(width)[None, :] < num_gpu[:, None]
        # Ties between equal scores go to the node whose name sorts first (the published
        # simulator's behaviour), so every policy needs the name order, not the list order.
        order = sorted(range(n), key=lambda i: names[i])
        rank = np.empty(n, dtype=np.int64)
        rank[np.array(order, dtype=np.int64)] = np.arange(n, dtype=np.int64)
        cpu = np.array([nd.cpu_milli for nd in nodes], dtype=np.int64)
        mem = np.array([nd.memory_mib for nd in nodes], dtype=np.int64)
        return cls(
            names=names,
            models=models,
            model_id=np.array([model_index[nd.model] for nd in nodes], dtype=np.int64),
            cpu_cap=cpu,
            mem_cap=mem,
            cpu_free=cpu.copy(),
            mem_free=mem.copy(),
            num_gpu=num_gpu,
            gpu_free=np.where(exists, MILLI, 0).astype(np.int64),
            gpu_exists=exists,
            class_counts=np.zeros((n, MAX_CLASS_GPUS + 1), dtype=np.int64),
            pod_count=np.zeros(n, dtype=np.int64),
            node_version=np.zeros(n, dtype=np.int64),
            name_rank=rank,
        )

    @classmethod
    def from_records(cls, records: Iterable[Mapping[str, object]]) -> ClusterState:
        """Build from plain mappings (e.g. a ledger snapshot).

        Accepted keys: ``name`` (or ``sn``), ``cpu_milli``, ``memory_mib``, ``num_gpu`` (or
        ``gpu``), ``model`` (optional, missing/None/"nan" means no model).
        """
        specs: list[NodeSpec] = []
        for rec in records:
            name = rec.get("name", rec.get("sn"))
            model = rec.get("model") or ""
            specs.append(
                NodeSpec(
                    name=str(name),
                    cpu_milli=_as_int(rec.get("cpu_milli", 0)),
                    memory_mib=_as_int(rec.get("memory_mib", 0)),
                    num_gpu=_as_int(rec.get("num_gpu", rec.get("gpu", 0))),
                    model="" if str(model).lower() == "nan" else str(model),
                )
            )
        return cls.from_nodes(specs)

    def copy(self) -> ClusterState:
        """Deep copy of the mutable arrays (static ones are shared)."""
        return ClusterState(
            names=self.names,
            models=self.models,
            model_id=self.model_id,
            cpu_cap=self.cpu_cap,
            mem_cap=self.mem_cap,
            cpu_free=self.cpu_free.copy(),
            mem_free=self.mem_free.copy(),
            num_gpu=self.num_gpu,
            gpu_free=self.gpu_free.copy(),
            gpu_exists=self.gpu_exists,
            class_counts=self.class_counts.copy(),
            pod_count=self.pod_count.copy(),
            node_version=self.node_version.copy(),
            name_rank=self.name_rank,
            _earlier_slots=self._earlier_slots,
        )

    # ------------------------------------------------------------------ queries
    def earlier_slots(self) -> BoolArray:
        """``[i, j]``: whether GPU slot ``j`` comes before slot ``i`` (read-only; the same for
        every decision on this state's width, so built once: ``np.tril`` took a twentieth of a
        lone decision)."""
        if self._earlier_slots is None:
            width = self.gpu_free.shape[1]
            mask: BoolArray = np.tril(np.ones((width, width), dtype=np.bool_), k=-1)
            mask.flags.writeable = False
            self._earlier_slots = mask
        return self._earlier_slots

    @property
    def num_nodes(self) -> int:
        """Number of nodes."""
        return len(self.names)

    @property
    def gpu_capacity_milli(self) -> int:
        """Total GPU milli of the cluster."""
        return int(self.num_gpu.sum()) * MILLI

    @property
    def gpu_used_milli(self) -> int:
        """GPU milli currently allocated."""
        return self.gpu_capacity_milli - int(self.gpu_free.sum())

    @property
    def cpu_used_milli(self) -> int:
        """CPU milli currently allocated."""
        return int((self.cpu_cap - self.cpu_free).sum())

    def model_mask(self, allowed: frozenset[str] | None) -> BoolArray:
        """Nodes whose GPU model is acceptable (all nodes when ``allowed`` is None)."""
        cached = self._model_masks.get(allowed)
        if cached is None:
            if allowed is None:
                cached = np.ones(self.num_nodes, dtype=np.bool_)
            else:
                ok = np.array([m in allowed for m in self.models], dtype=np.bool_)
                cached = ok[self.model_id]
            self._model_masks[allowed] = cached
        return cached

    def feasible(self, pod: PodDemand) -> BoolArray:
        """Boolean mask of nodes that can host ``pod`` right now (CPU, memory, GPUs, model).

        Read-only: kept per pod shape and brought up to date on the nodes whose version moved
        since (a decision changes a node or two; the whole mask costs a pass over every GPU).
        """
        key = (pod.cpu_milli, pod.memory_mib, pod.num_gpu, pod.gpu_milli, pod.allowed_models)
        kept = self._feasible.get(key)
        if kept is None:
            if len(self._feasible) >= _FEASIBLE_SHAPES:
                self._feasible.clear()
            mask = self._feasible_rows(pod, slice(None))
            kept = self._feasible[key] = (mask, self.node_version.copy())
        else:
            mask, versions = kept
            stale = (versions != self.node_version).nonzero()[0]
            if len(stale):
                mask[stale] = self._feasible_rows(pod, stale)
                versions[stale] = self.node_version[stale]
        view = kept[0].view()
        view.flags.writeable = False
        return view

    def _feasible_rows(self, pod: PodDemand, rows: IntArray | slice) -> BoolArray:
        mask: BoolArray = (self.cpu_free[rows] >= pod.cpu_milli) & (
            self.mem_free[rows] >= pod.memory_mib
        )
        if pod.num_gpu > 0:
            mask &= self.model_mask(pod.allowed_models)[rows]
            mask &= np.add.reduce(self.gpu_free[rows] >= pod.gpu_milli, axis=1) >= pod.num_gpu
        return mask

    def check(self, placement: NodeChoice) -> str | None:
        """Why ``placement`` cannot be applied now, or None when it can."""
        i = placement.node
        if not 0 <= i < self.num_nodes:
            return f"node index {i} out of range"
        if self.cpu_free[i] < placement.cpu_milli:
            return "not enough CPU"
        if self.mem_free[i] < placement.memory_mib:
            return "not enough memory"
        if len(set(placement.gpus)) != len(placement.gpus):
            return "GPU listed twice"
        for g in placement.gpus:
            if not 0 <= g < int(self.num_gpu[i]):
                return f"GPU index {g} out of range"
            if self.gpu_free[i, g] < placement.gpu_milli:
                return f"GPU {g} has only {int(self.gpu_free[i, g])} milli free"
        return None

    def fits(self, placement: NodeChoice, pod: PodDemand) -> bool:
        """True when ``placement`` is a valid, applicable placement of ``pod``."""
        if len(placement.gpus) != pod.num_gpu or placement.cpu_milli != pod.cpu_milli:
            return False
        if placement.memory_mib != pod.memory_mib:
            return False
        if pod.num_gpu and placement.gpu_milli != pod.gpu_milli:
            return False
        if pod.num_gpu and not self.model_mask(pod.allowed_models)[placement.node]:
            return False
        return self.check(placement) is None

    # ------------------------------------------------------------------ GPU picking helpers
    def whole_gpus(self, node: int, count: int) -> tuple[int, ...]:
        """The first ``count`` fully free GPU slots of ``node`` in index order."""
        full = np.flatnonzero(self.gpu_free[node] == MILLI)
        return tuple(int(g) for g in full[:count])

    def best_fit_gpus(self, node: int, pod: PodDemand) -> tuple[int, ...]:
        """GPU slots for ``pod`` on ``node``, tightest first (lowest index on ties).

        Whole-GPU pods take the first fully free GPUs; sharing pods the GPU with the least free
        milli that still fits, which is what the published simulator does by default.
        """
        if pod.num_gpu == 0:
            return ()
        if pod.gpu_milli >= MILLI:
            return self.whole_gpus(node, pod.num_gpu)
        free = self.gpu_free[node]
        cand = np.flatnonzero(free >= pod.gpu_milli)
        order = cand[np.argsort(free[cand], kind="stable")]
        return tuple(int(g) for g in order[: pod.num_gpu])

    # ------------------------------------------------------------------ mutation
    def allocate(self, placement: NodeChoice) -> None:
        """Apply ``placement``; raises ValueError (and changes nothing) when it does not fit."""
        problem = self.check(placement)
        if problem is not None:
            raise ValueError(f"cannot allocate on {self.names[placement.node]}: {problem}")
        i = placement.node
        self.cpu_free[i] -= placement.cpu_milli
        self.mem_free[i] -= placement.memory_mib
        for g in placement.gpus:
            self.gpu_free[i, g] -= placement.gpu_milli
        col = placement.class_column
        if col >= 0:
            self.class_counts[i, col] += 1
        self.pod_count[i] += 1
        self.node_version[i] += 1

    def release(self, placement: NodeChoice) -> None:
        """Undo a previous :meth:`allocate`; raises ValueError if it would exceed capacity."""
        i = placement.node
        if not 0 <= i < self.num_nodes:
            raise ValueError(f"node index {i} out of range")
        if self.cpu_free[i] + placement.cpu_milli > self.cpu_cap[i]:
            raise ValueError("release exceeds CPU capacity")
        if self.mem_free[i] + placement.memory_mib > self.mem_cap[i]:
            raise ValueError("release exceeds memory capacity")
        for g in placement.gpus:
            if not 0 <= g < int(self.num_gpu[i]):
                raise ValueError(f"GPU index {g} out of range")
            if self.gpu_free[i, g] + placement.gpu_milli > MILLI:
                raise ValueError("release exceeds GPU capacity")
        col = placement.class_column
        if (col >= 0 and self.class_counts[i, col] <= 0) or self.pod_count[i] <= 0:
            raise ValueError("release of a placement that was never allocated")
        self.cpu_free[i] += placement.cpu_milli
        self.mem_free[i] += placement.memory_mib
        for g in placement.gpus:
            self.gpu_free[i, g] += placement.gpu_milli
        if col >= 0:
            self.class_counts[i, col] -= 1
        self.pod_count[i] -= 1
        self.node_version[i] += 1


def _as_int(value: object) -> int:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return value
    if isinstance(value, float | str):
        return int(float(value))
    raise TypeError(f"expected a number, got {type(value).__name__}")
