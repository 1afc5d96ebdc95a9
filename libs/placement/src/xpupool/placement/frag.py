"""GPU fragmentation measured against a distribution of pod shapes (FGD, ATC'23).

For a node ``n`` and a pod shape ``m``, the unallocated GPU milli of ``n`` that ``m`` cannot use
is a fragment: all of it when ``m`` is CPU-only or ``n`` cannot host ``m`` at all (too few GPUs
with enough free milli, too little CPU, wrong GPU model), otherwise only the GPUs whose free
milli is below ``m``'s per-GPU request. ``F_n = sum_m p_m frag(n, m)``; the cluster amount is
``sum_n F_n``. Memory is not part of a shape, as in the published simulator.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from xpupool.placement.state import BoolArray, ClusterState, FloatArray, IntArray, PodDemand


@dataclass(frozen=True, slots=True, order=True)
class Shape:
    """A pod shape as the fragmentation metric sees it (memory is ignored)."""

    cpu_milli: int
    gpu_milli: int
    num_gpu: int
    allowed_models: tuple[str, ...] = ()

    @classmethod
    def of(cls, pod: PodDemand) -> Shape:
        """Shape of ``pod``."""
        models = tuple(sorted(pod.allowed_models)) if pod.allowed_models else ()
        return cls(pod.cpu_milli, pod.gpu_milli, pod.num_gpu, models)


@dataclass(frozen=True, slots=True)
class ShapeDistribution:
    """Shapes with probabilities summing to 1."""

    shapes: tuple[Shape, ...]
    probs: tuple[float, ...]

    def __post_init__(self) -> None:
        if len(self.shapes) != len(self.probs) or not self.shapes:
            raise ValueError("need one probability per shape, at least one shape")

    @classmethod
    def typical(cls, pods: Iterable[PodDemand], coverage: float = 0.95) -> ShapeDistribution:
        """The most frequent shapes covering at least ``coverage`` of ``pods``, renormalised.

        Ties in frequency are broken by the larger shape first, which is the order the
        published simulator ends up with (reverse sort on (count, cpu, gpu milli, ...)).
        """
        counts = Counter(Shape.of(p) for p in pods)
        if not counts:
            raise ValueError("no pods")
        ranked = sorted(counts.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)
        total = sum(counts.values())
        chosen: list[tuple[Shape, int]] = []
        cum = 0
        for shape, cnt in ranked:
            if cum >= coverage * total:
                break
            chosen.append((shape, cnt))
            cum += cnt
        return cls(tuple(s for s, _ in chosen), tuple(c / cum for _, c in chosen))

    @classmethod
    def empirical(
        cls, pods: Iterable[PodDemand], weights: Sequence[float] | None = None
    ) -> ShapeDistribution:
        """All shapes of ``pods`` with (optionally weighted) frequencies."""
        acc: dict[Shape, float] = {}
        for i, p in enumerate(pods):
            w = 1.0 if weights is None else float(weights[i])
            s = Shape.of(p)
            acc[s] = acc.get(s, 0.0) + w
        total = sum(acc.values())
        if total <= 0:
            raise ValueError("no weight")
        items = sorted(acc.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)
        return cls(tuple(s for s, _ in items), tuple(w / total for _, w in items))


class FragEvaluator:
    """Vectorised ``F_n`` for many (hypothetical) node states at once, for one cluster's models."""

    def __init__(self, dist: ShapeDistribution, models: Sequence[str]) -> None:
        self.dist = dist
        self.models = tuple(models)
        shapes = dist.shapes
        self.prob: FloatArray = np.array(dist.probs, dtype=np.float64)
        self.cpu: IntArray = np.array([s.cpu_milli for s in shapes], dtype=np.int64)
        self.num: IntArray = np.array([s.num_gpu for s in shapes], dtype=np.int64)
        milli = np.array([s.gpu_milli for s in shapes], dtype=np.int64)
        self.thresholds: IntArray = np.unique(milli)
        self.thr_index: IntArray = np.searchsorted(self.thresholds, milli).astype(np.int64)
        # A CPU-only shape can never use a GPU, so every idle GPU milli is a fragment for it.
        self.gpu_shape: BoolArray = milli > 0
        access = np.ones((len(self.models), len(shapes)), dtype=np.bool_)
        for j, s in enumerate(shapes):
            if s.allowed_models:
                allowed = set(s.allowed_models)
                access[:, j] = [m in allowed for m in self.models]
        self.access: BoolArray = access & self.gpu_shape[None, :]
        # evaluate() works per base shape (cpu, milli, count) with the probability mass each
        # GPU model can use: shapes that differ only in their model constraint (hundreds with
        # gpu_spec) then cost one column instead of one each. F is unchanged:
        # F = total x sum(p) + sum_b P[model, b] x (host_b ? below_b - total : 0).
        keys = sorted({(s.cpu_milli, s.gpu_milli, s.num_gpu) for s in shapes})
        where = {k: i for i, k in enumerate(keys)}
        base = np.array([where[(s.cpu_milli, s.gpu_milli, s.num_gpu)] for s in shapes])
        self.base_cpu: IntArray = np.array([k[0] for k in keys], dtype=np.int64)
        self.base_num: IntArray = np.array([k[2] for k in keys], dtype=np.int64)
        base_milli = np.array([k[1] for k in keys], dtype=np.int64)
        self.base_thr: IntArray = np.searchsorted(self.thresholds, base_milli).astype(np.int64)
        usable = np.zeros((len(self.models), len(keys)), dtype=np.float64)
        for j in range(len(shapes)):
            usable[:, base[j]] += np.where(self.access[:, j], self.prob[j], 0.0)
        self.base_usable: FloatArray = usable
        self.prob_sum = float(self.prob.sum())

    def evaluate(self, gpu_free: IntArray, cpu_free: IntArray, model_id: IntArray) -> FloatArray:
        """``F`` for ``K`` node states given as ``(K, G)`` GPU free, ``(K,)`` CPU free and model."""
        total = gpu_free.sum(axis=1)
        ge = gpu_free[:, :, None] >= self.thresholds[None, None, :]
        cnt = ge.sum(axis=1)
        above = np.einsum("kg,kgu->ku", gpu_free, ge.astype(np.int64))
        host = (cnt[:, self.base_thr] >= self.base_num[None, :]) & (
            cpu_free[:, None] >= self.base_cpu[None, :]
        )
        gain = np.where(host, -above[:, self.base_thr], 0).astype(np.float64)
        out: FloatArray = total * self.prob_sum + np.einsum(
            "kb,kb->k", gain, self.base_usable[model_id]
        )
        return out

    def hostable(self, gpu_free: IntArray, cpu_free: IntArray, model_id: IntArray) -> BoolArray:
        """``(K, S)``: whether each node state can host each GPU shape (CPU-only: False)."""
        ge = gpu_free[:, :, None] >= self.thresholds[None, None, :]
        cnt_s = ge.sum(axis=1)[:, self.thr_index]
        out: BoolArray = (
            (cnt_s >= self.num[None, :])
            & (cpu_free[:, None] >= self.cpu[None, :])
            & self.access[model_id]
        )
        return out

    def nodes(self, state: ClusterState, idx: IntArray | None = None) -> FloatArray:
        """``F_n`` of the nodes ``idx`` (all nodes when None) in their current state."""
        if idx is None:
            return self.evaluate(state.gpu_free, state.cpu_free, state.model_id)
        return self.evaluate(state.gpu_free[idx], state.cpu_free[idx], state.model_id[idx])


class FragCache:
    """Per-node ``F_n`` of a state, refreshed only on nodes whose version changed."""

    def __init__(self, evaluator: FragEvaluator) -> None:
        self.evaluator = evaluator
        self._token: object = None
        self._versions: IntArray = np.zeros(0, dtype=np.int64)
        self._values: FloatArray = np.zeros(0, dtype=np.float64)

    def values(self, state: ClusterState) -> FloatArray:
        """Current ``F_n`` for every node of ``state``."""
        if self._token is not state.token or len(self._values) != state.num_nodes:
            self._values = self.evaluator.nodes(state)
            self._versions = state.node_version.copy()
            self._token = state.token
            return self._values
        stale = np.flatnonzero(self._versions != state.node_version)
        if len(stale):
            self._values[stale] = self.evaluator.nodes(state, stale)
            self._versions[stale] = state.node_version[stale]
        return self._values
