"""The placement policy protocol, the five baselines of the FGD paper, FGD itself and first-fit.

Each baseline reproduces the published simulator (hkust-adsl/kubernetes-scheduler-simulator) as
it ran the paper's experiments, because those details move the numbers:

* scores are kube-scheduler integers 0-100, truncated, and equal scores go to the node whose
  name sorts first;
* whole-GPU pods take the first fully free GPUs of the chosen node; sharing pods take the
  tightest GPU that fits (``gpusel=best``) except for Random (random GPU) and FGD (its own);
* every policy shares one feasibility filter: CPU, memory, GPU model, enough GPUs with enough
  free milli on one node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Protocol, runtime_checkable

import numpy as np

from xpupool.placement.frag import (
    FragCache,
    FragEvaluator,
    ShapeDistribution,
    group_rows,
)
from xpupool.placement.state import (
    MILLI,
    BoolArray,
    ClusterState,
    FloatArray,
    IntArray,
    NodeChoice,
    PodDemand,
)

#: Largest node spec of the trace's cluster; BestFit and DotProd normalise by it, not per node.
MAX_SPEC_CPU: Final = 128_000
MAX_SPEC_GPU: Final = 8 * MILLI
MAX_SCORE: Final = 100


@runtime_checkable
class Policy(Protocol):
    """Chooses where a pod goes; must not mutate ``state``. None means "does not fit"."""

    name: str

    def choose(self, state: ClusterState, pod: PodDemand) -> NodeChoice | None:
        """Return a placement that :meth:`ClusterState.allocate` accepts, or None."""
        ...


@dataclass
class PolicyContext:
    """What a policy factory may use: a seeded RNG and a description of the workload.

    ``workload`` is the list of pods the cluster is expected to see (for the replay: the
    original trace list, before inflation); ``typical`` overrides the FGD target distribution.
    """

    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))
    workload: Sequence[PodDemand] | None = None
    typical: ShapeDistribution | None = None

    def typical_shapes(self) -> ShapeDistribution:
        """The FGD target workload: given, or the >= 95 % typical shapes of ``workload``."""
        if self.typical is not None:
            return self.typical
        if not self.workload:
            raise ValueError("this policy needs PolicyContext.workload or .typical")
        self.typical = ShapeDistribution.typical(self.workload)
        return self.typical


def pick_node(state: ClusterState, idx: IntArray, scores: IntArray | FloatArray) -> int:
    """Node of ``idx`` with the highest score; equal scores go to the first node name."""
    best = scores.max()
    cand = idx[scores == best]
    return int(cand[np.argmin(state.name_rank[cand])])


def _place(state: ClusterState, node: int, pod: PodDemand) -> NodeChoice:
    return NodeChoice.for_pod(node, state.best_fit_gpus(node, pod), pod)


class RandomPolicy:
    """Random-fit: a uniformly random feasible node, a random fitting GPU for sharing pods."""

    name = "random"

    def __init__(self, rng: np.random.Generator) -> None:
        self.rng = rng

    def choose(self, state: ClusterState, pod: PodDemand) -> NodeChoice | None:
        """Random feasible node; random GPU among those that fit for sharing pods."""
        idx = np.flatnonzero(state.feasible(pod))
        if len(idx) == 0:
            return None
        node = int(idx[self.rng.integers(len(idx))])
        if pod.is_sharing:
            gpus = np.flatnonzero(state.gpu_free[node] >= pod.gpu_milli)
            return NodeChoice.for_pod(node, (int(gpus[self.rng.integers(len(gpus))]),), pod)
        return _place(state, node, pod)


class DotProdPolicy:
    """Tetris dot product of free and requested (CPU, total GPU), normalised by the max spec.

    A smaller dot product scores higher (``100 x (1 - dot/2)``), as in the simulator.
    """

    name = "dotprod"

    def choose(self, state: ClusterState, pod: PodDemand) -> NodeChoice | None:
        """Node minimising the normalised dot product; tightest GPU."""
        idx = np.flatnonzero(state.feasible(pod))
        if len(idx) == 0:
            return None
        cpu = state.cpu_free[idx] / MAX_SPEC_CPU * (pod.cpu_milli / MAX_SPEC_CPU)
        gpu_left = state.gpu_free[idx].sum(axis=1)
        gpu = gpu_left / MAX_SPEC_GPU * (pod.gpu_request_milli / MAX_SPEC_GPU)
        scores = (MAX_SCORE * (1.0 - (cpu + gpu) / 2.0)).astype(np.int64)
        return _place(state, pick_node(state, idx, scores), pod)


class ClusteringPolicy:
    """GPU clustering: nodes hosting only the pod's class > mixed > idle > other classes.

    Within a tier, less free GPU scores higher (``25 x (8000 - free) / 8000``, integer maths).
    CPU-only pods score 0 everywhere, i.e. first feasible node by name.
    """

    name = "clustering"

    def choose(self, state: ClusterState, pod: PodDemand) -> NodeChoice | None:
        """Node by class affinity tier, then by GPU fill."""
        idx = np.flatnonzero(state.feasible(pod))
        if len(idx) == 0:
            return None
        if pod.num_gpu == 0:
            scores = np.zeros(len(idx), dtype=np.int64)
        else:
            col = NodeChoice.for_pod(0, range(pod.num_gpu), pod).class_column
            counts = state.class_counts[idx]
            kinds = (counts > 0).sum(axis=1)
            same = counts[:, col] > 0
            base = (MAX_SCORE // 4) * (MAX_SPEC_GPU - state.gpu_free[idx].sum(axis=1))
            base //= MAX_SPEC_GPU
            tier = np.where(same, np.where(kinds == 1, 3, 2), np.where(kinds == 0, 1, 0))
            scores = base + tier * (MAX_SCORE // 4)
        return _place(state, pick_node(state, idx, scores), pod)


class PackingPolicy:
    """GPU packing: partially used GPUs (fullest first) > free GPUs on used nodes > idle nodes."""

    name = "packing"

    def choose(self, state: ClusterState, pod: PodDemand) -> NodeChoice | None:
        """Node by the simulator's three-tier packing score; tightest GPU."""
        idx = np.flatnonzero(state.feasible(pod))
        if len(idx) == 0:
            return None
        if pod.num_gpu == 0:
            scores = np.zeros(len(idx), dtype=np.int64)
        else:
            scores = self._scores(state, idx, pod)
        return _place(state, pick_node(state, idx, scores), pod)

    @staticmethod
    def _scores(state: ClusterState, idx: IntArray, pod: PodDemand) -> IntArray:
        free = state.gpu_free[idx]
        full = (free == MILLI).sum(axis=1)
        idle = full == state.num_gpu[idx]
        idle_score = np.maximum(MAX_SCORE // 3 - full, full)
        if pod.gpu_milli >= MILLI:
            # Whole GPUs can only come from fully free ones: always case 2 on a used node.
            used_score = np.full(len(idx), max(MAX_SCORE // 2 - pod.num_gpu, MAX_SCORE // 3))
            return np.where(idle, idle_score, used_score).astype(np.int64)
        if pod.num_gpu == 1:
            fits = np.where(free >= pod.gpu_milli, free, MILLI + 1)
            tight = fits.min(axis=1)
            partial = np.maximum(MAX_SCORE - (tight * 100 // MILLI) // 10, MAX_SCORE // 2)
            used_score = np.where(tight == MILLI, max(MAX_SCORE // 2 - 1, MAX_SCORE // 3), partial)
            return np.where(idle, idle_score, used_score).astype(np.int64)
        out = np.empty(len(idx), dtype=np.int64)
        for k, node in enumerate(idx):
            out[k] = _packing_score_general(state.gpu_free[node], bool(idle[k]), int(full[k]), pod)
        return out


def _packing_score_general(free: IntArray, idle: bool, full: int, pod: PodDemand) -> int:
    # Multi-GPU sharing pods do not occur in the trace; kept for completeness.
    if idle:
        return max(MAX_SCORE // 3 - full, full)
    order = np.argsort(free, kind="stable")
    used = [int(g) for g in order if free[g] >= pod.gpu_milli][: pod.num_gpu]
    fully = sum(1 for g in used if free[g] == MILLI)
    if fully:
        return max(MAX_SCORE // 2 - fully, MAX_SCORE // 3)
    ratio = sum(int(free[g]) * 100 // MILLI for g in used)
    return max(MAX_SCORE - ratio // 10, MAX_SCORE // 2)


class BestFitPolicy:
    """Best fit on 0.5 x leftover CPU + 0.5 x leftover GPU, normalised by the largest node spec."""

    name = "bestfit"

    def choose(self, state: ClusterState, pod: PodDemand) -> NodeChoice | None:
        """Node with the least normalised leftover; tightest GPU."""
        idx = np.flatnonzero(state.feasible(pod))
        if len(idx) == 0:
            return None
        cpu_left = (state.cpu_free[idx] - pod.cpu_milli) / MAX_SPEC_CPU * 0.5
        gpu_left = (state.gpu_free[idx].sum(axis=1) - pod.gpu_request_milli) / MAX_SPEC_GPU * 0.5
        scores = ((1.0 - (cpu_left + gpu_left)) * MAX_SCORE).astype(np.int64)
        return _place(state, pick_node(state, idx, scores), pod)


class FirstFitPolicy:
    """First fit: the first feasible node in node-name order; whole GPUs take the first free
    GPUs, sharing pods the tightest GPU that fits.

    No score at all: the reference for what node-name tie-breaking alone is worth (on the
    default trace plain first-fit reaches about 94.2 %, close to FGD's published 95.23).
    """

    name = "firstfit"

    def choose(self, state: ClusterState, pod: PodDemand) -> NodeChoice | None:
        """First feasible node by name; tightest GPU."""
        idx = np.flatnonzero(state.feasible(pod))
        if len(idx) == 0:
            return None
        return _place(state, int(idx[np.argmin(state.name_rank[idx])]), pod)


def sigmoid_score(delta: FloatArray) -> IntArray:
    """FGD's integer score ``int(sigmoid(delta / 1000) x 100)`` for a frag decrease ``delta``."""
    out: IntArray = (MAX_SCORE / (1.0 + np.exp(-delta / MILLI))).astype(np.int64)
    return out


@dataclass
class Candidates:
    """Hypothetical after-states of placing one pod: one row per (node, GPU choice)."""

    node: IntArray
    gpu: IntArray
    gpu_free: IntArray
    cpu_free: IntArray


def candidates(state: ClusterState, idx: IntArray, pod: PodDemand) -> Candidates:
    """After-states of ``pod`` on each feasible node ``idx``.

    Sharing pods get one row per GPU that fits, except GPUs whose free milli equals that of a
    lower-indexed GPU on the same node: they lead to the same node state, and ties go to the
    lower index anyway. Other pods get one row per node (``gpu`` = -1).
    """
    free = state.gpu_free[idx]
    cpu_after = state.cpu_free[idx] - pod.cpu_milli
    if pod.is_sharing:
        same = free[:, :, None] == free[:, None, :]
        dup = np.logical_or.reduce(same & state.earlier_slots()[None, :, :], axis=2)
        ok = (free >= pod.gpu_milli) & ~dup
        rows, gpus = ok.nonzero()
        after = free[rows].copy()
        after[np.arange(len(rows)), gpus] -= pod.gpu_milli
        return Candidates(idx[rows], gpus.astype(np.int64), after, cpu_after[rows])
    after = free.copy()
    if pod.num_gpu > 0:
        if pod.gpu_milli >= MILLI:
            full = after == MILLI
            take = full & (full.cumsum(axis=1) <= pod.num_gpu)
            after[take] = 0
        else:
            for k, node in enumerate(idx):
                for g in state.best_fit_gpus(int(node), pod):
                    after[k, g] -= pod.gpu_milli
    minus_one = np.full(len(idx), -1, dtype=np.int64)
    return Candidates(idx, minus_one, after, cpu_after)


def _state_table(state: ClusterState, rows: IntArray) -> IntArray:
    """What a node's group is made of: sorted GPU free, CPU free, model (one row per node)."""
    out: IntArray = np.column_stack(
        (np.sort(state.gpu_free[rows], axis=1), state.cpu_free[rows], state.model_id[rows])
    )
    return out


class NodeGroups:
    """Feasible nodes that FGD and xpupool cannot tell apart, one representative per group.

    Two nodes are in one group when they have the same GPU model, the same free CPU and the same
    multiset of free GPU milli. Every candidate placement on one then has a twin on the other
    whose after-state is the same up to the order of GPU slots, hence the same ``F``, leftover
    and score; and a tie inside a group goes to its first node by name. Scoring only that node of
    each group therefore chooses exactly what scoring every feasible node chooses, and a
    ~1,200-node cluster holds far fewer distinct states (tens while it fills up).

    Groups are kept per node and refreshed only where ``node_version`` changed.
    """

    def __init__(self) -> None:
        self._token: object = None
        self._versions: IntArray = np.zeros(0, dtype=np.int64)
        self._gid: IntArray = np.zeros(0, dtype=np.int64)
        self._by_name: IntArray = np.zeros(0, dtype=np.int64)
        # State (sorted GPU free, CPU free, model) -> group id; built on the first refresh after
        # a reset, from ``_named`` (the distinct rows, group i in row i): a state that is
        # decided on only once (a restricted copy) never pays for it.
        self._ids: dict[tuple[int, ...], int] | None = None
        self._named: IntArray = np.zeros((0, 0), dtype=np.int64)

    def group_ids(self, state: ClusterState) -> IntArray:
        """Group id of every node of ``state`` in its current state."""
        n = state.num_nodes
        if (
            self._token is not state.token
            or len(self._gid) != n
            or (self._ids is not None and len(self._ids) > 4 * n + 1024)  # forget old states
        ):
            self._token = state.token
            self._versions = state.node_version.copy()
            self._by_name = np.argsort(state.name_rank, kind="stable")
            table = _state_table(state, np.arange(n, dtype=np.int64))
            first, self._gid = group_rows(table)
            self._named = table[first]
            self._ids = None
            return self._gid
        stale = np.flatnonzero(self._versions != state.node_version)
        if len(stale) == 0:
            return self._gid
        self._versions[stale] = state.node_version[stale]
        if self._ids is None:
            self._ids = {tuple(row): i for i, row in enumerate(self._named.tolist())}
        ids = self._ids
        table = _state_table(state, stale)
        self._gid[stale] = [ids.setdefault(tuple(row), len(ids)) for row in table.tolist()]
        return self._gid

    def representatives(self, state: ClusterState, mask: BoolArray) -> IntArray:
        """The first node by name of each group among the nodes of ``mask``, in index order."""
        gid = self.group_ids(state)
        by_name = self._by_name[mask[self._by_name]]
        _, first = np.unique(gid[by_name], return_index=True)
        out: IntArray = np.sort(by_name[first])
        return out


class FGDPolicy:
    """Fragmentation Gradient Descent: minimise the growth of ``F_n`` (integer sigmoid score)."""

    name = "fgd"

    def __init__(self, typical: ShapeDistribution) -> None:
        self.typical = typical
        self._evaluator: FragEvaluator | None = None
        self._cache: FragCache | None = None
        self._groups = NodeGroups()

    def _frag(self, state: ClusterState) -> tuple[FragEvaluator, FragCache]:
        if self._evaluator is None or self._evaluator.models != state.models:
            self._evaluator = FragEvaluator(self.typical, state.models)
            self._cache = FragCache(self._evaluator)
        assert self._cache is not None
        return self._evaluator, self._cache

    def choose(self, state: ClusterState, pod: PodDemand) -> NodeChoice | None:
        """NodeChoice with the highest integer FGD score; first node name, lowest GPU on ties."""
        feasible = state.feasible(pod)
        if not feasible.any():
            return None
        # One node per group of identical feasible nodes (see NodeGroups): same choice.
        idx = self._groups.representatives(state, feasible)
        evaluator, cache = self._frag(state)
        before = cache.values(state)
        cand = candidates(state, idx, pod)
        after = evaluator.evaluate(cand.gpu_free, cand.cpu_free, state.model_id[cand.node])
        scores = sigmoid_score(before[cand.node] - after)
        # Lexicographic: score desc, node name asc, GPU index asc (rows are already in GPU order).
        best = scores == scores.max()
        rows = np.flatnonzero(best)
        row = int(rows[np.argmin(state.name_rank[cand.node[rows]])])
        node = int(cand.node[row])
        if pod.is_sharing:
            return NodeChoice.for_pod(node, (int(cand.gpu[row]),), pod)
        return _place(state, node, pod)
