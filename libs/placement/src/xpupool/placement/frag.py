"""GPU fragmentation measured against a distribution of pod shapes (FGD, ATC'23).

For a node ``n`` and a pod shape ``m``, the unallocated GPU milli of ``n`` that ``m`` cannot use
is a fragment: all of it when ``m`` is CPU-only or ``n`` cannot host ``m`` at all (too few GPUs
with enough free milli, too little CPU, wrong GPU model), otherwise only the GPUs whose free
milli is below ``m``'s per-GPU request. ``F_n = sum_m p_m frag(n, m)``; the cluster amount is
``sum_n F_n``. Memory is not part of a shape, as in the published simulator.
"""

from __future__ import annotations

import copy
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np

from xpupool.placement.state import BoolArray, ClusterState, FloatArray, IntArray, PodDemand

#: ``FragEvaluator.evaluate`` groups identical states from this many rows on.
DEDUP_MIN_ROWS: Final = 64
MEMO_MAX_ROWS: Final = 16
"""At most this many node states are looked up one by one among the values an evaluator has
computed (``FragEvaluator.evaluate``): a decision re-scores the node or two that changed, whose
states recur (a share taken, then given back); more are computed at once."""
MEMO_MAX_STATES: Final = 65_536


def group_rows(table: IntArray) -> tuple[IntArray, IntArray]:
    """Groups of equal rows of ``table``: (first row of each group, group of every row).

    Columns are packed into as few int64 words as their value ranges allow, then sorted (stable,
    so a group's representative is its first row).
    """
    k = len(table)
    if k == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    lo = table.min(axis=0)
    spans = (table.max(axis=0) - lo).tolist()
    words: list[IntArray] = []
    used = 0
    for j, span in enumerate(spans):
        bits = int(span).bit_length()
        if bits == 0:
            continue
        if bits > 62 or span < 0:  # too wide to pack (or max - min overflowed)
            _, index, groups = np.unique(table, axis=0, return_index=True, return_inverse=True)
            return index.astype(np.int64), groups.reshape(-1).astype(np.int64)
        col = table[:, j] - lo[j]
        if not words or used + bits > 62:
            words.append(col)
            used = bits
        else:
            words[-1] = (words[-1] << bits) | col
            used += bits
    if not words:
        return np.zeros(1, dtype=np.int64), np.zeros(k, dtype=np.int64)
    order = np.lexsort(words) if len(words) > 1 else np.argsort(words[0], kind="stable")
    starts = np.zeros(k, dtype=np.bool_)
    starts[0] = True
    for w in words:
        sw = w[order]
        starts[1:] |= sw[1:] != sw[:-1]
    inverse = np.empty(k, dtype=np.int64)
    inverse[order] = np.cumsum(starts) - 1
    first: IntArray = order[starts]
    return first, inverse


def _distinct_states(
    gpu_free: IntArray, cpu_free: IntArray, model_id: IntArray, cpu_levels: IntArray
) -> tuple[IntArray, IntArray] | None:
    """Groups of node states with the same GPU free multiset, model and CPU rank among
    ``cpu_levels``, or None when grouping would not pay (few rows, or all distinct)."""
    if len(gpu_free) < DEDUP_MIN_ROWS:
        return None
    key = np.column_stack(
        (
            np.sort(gpu_free, axis=1),
            np.searchsorted(cpu_levels, cpu_free, side="right"),
            model_id,
        )
    )
    first, inverse = group_rows(key)
    if len(first) == len(gpu_free):
        return None
    return first, inverse


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
        # One model mask per distinct constraint (hundreds of shapes share a few dozen).
        mask_of: dict[tuple[str, ...], int] = {(): 0}
        masks = [[True] * len(self.models)]
        which: list[int] = []
        for s in shapes:
            i = mask_of.get(s.allowed_models)
            if i is None:
                allowed = set(s.allowed_models)
                i = mask_of[s.allowed_models] = len(masks)
                masks.append([m in allowed for m in self.models])
            which.append(i)
        access = np.array(masks, dtype=np.bool_).reshape(len(masks), len(self.models))
        access = np.ascontiguousarray(access[np.array(which, dtype=np.int64)].T)
        self.access: BoolArray = access & self.gpu_shape[None, :]
        # evaluate() works per base shape (cpu, milli, count) with the probability mass each
        # GPU model can use: shapes that differ only in their model constraint (hundreds with
        # gpu_spec) then cost one column instead of one each. F is unchanged:
        # F = total x sum(p) + sum_b P[model, b] x (host_b ? below_b - total : 0).
        keys = sorted({(s.cpu_milli, s.gpu_milli, s.num_gpu) for s in shapes})
        where = {k: i for i, k in enumerate(keys)}
        base = np.array(
            [where[(s.cpu_milli, s.gpu_milli, s.num_gpu)] for s in shapes], dtype=np.int64
        )
        self._base_of_shape: IntArray = base
        self.base_cpu: IntArray = np.array([k[0] for k in keys], dtype=np.int64)
        self.base_num: IntArray = np.array([k[2] for k in keys], dtype=np.int64)
        base_milli = np.array([k[1] for k in keys], dtype=np.int64)
        self.base_thr: IntArray = np.searchsorted(self.thresholds, base_milli).astype(np.int64)
        self.base_usable: FloatArray = self._usable(self.prob)
        self.prob_sum = float(self.prob.sum())
        # Distinct CPU requests of the base shapes: a node state's CPU matters to F only through
        # how many of them it can serve, so states are grouped by that rank (see evaluate()).
        self._cpu_levels: IntArray = np.unique(self.base_cpu)
        self._shape_cpu_levels: IntArray = np.unique(self.cpu)
        # F of node states computed so far, by (model, CPU free, GPU free row bytes).
        self._memo: dict[tuple[int, int, bytes], float] = {}

    def _usable(self, prob: FloatArray) -> FloatArray:
        """``(M, B)`` probability mass of each base shape that a node of each model can host."""
        usable = np.zeros((len(self.models), len(self.base_cpu)), dtype=np.float64)
        # Accumulated shape by shape in shape order (ufunc.at is unbuffered and in index order),
        # so every cell is the same float sum as adding the shapes one at a time.
        mass = np.where(self.access, prob[None, :], 0.0)
        rows = np.broadcast_to(np.arange(len(self.models))[:, None], mass.shape)
        cols = np.broadcast_to(self._base_of_shape[None, :], mass.shape)
        np.add.at(usable, (rows, cols), mass)
        return usable

    def reweighted(self, dist: ShapeDistribution) -> FragEvaluator:
        """The evaluator of ``dist``, which has this one's shapes with other probabilities.

        Same result as ``FragEvaluator(dist, self.models)`` without rebuilding the shape tables.
        """
        if dist.shapes != self.dist.shapes:
            raise ValueError("reweighted() needs the same shapes in the same order")
        out = copy.copy(self)
        out._memo = {}
        out.dist = dist
        out.prob = np.array(dist.probs, dtype=np.float64)
        out.base_usable = out._usable(out.prob)
        out.prob_sum = float(out.prob.sum())
        return out

    def evaluate(self, gpu_free: IntArray, cpu_free: IntArray, model_id: IntArray) -> FloatArray:
        """``F`` for ``K`` node states given as ``(K, G)`` GPU free, ``(K,)`` CPU free and model.

        Each state is computed on its own (a row's value does not depend on the other rows), and
        states that ``F`` cannot tell apart (same GPU free multiset, same model, same number of
        base-shape CPU requests served) are computed once: a cluster holds many identical nodes.
        """
        if len(gpu_free) <= MEMO_MAX_ROWS:
            return self._evaluate_recalled(gpu_free, cpu_free, model_id)
        groups = _distinct_states(gpu_free, cpu_free, model_id, self._cpu_levels)
        if groups is not None:
            first, inverse = groups
            distinct = self._evaluate(gpu_free[first], cpu_free[first], model_id[first])
            out: FloatArray = distinct[inverse]
            return out
        return self._evaluate(gpu_free, cpu_free, model_id)

    def _evaluate_recalled(
        self, gpu_free: IntArray, cpu_free: IntArray, model_id: IntArray
    ) -> FloatArray:
        """``evaluate`` of a few states, each looked up among those computed before (a state's
        F is computed on its own, so it is the same value whenever it is computed)."""
        rows = np.ascontiguousarray(gpu_free, dtype=np.int64)
        row = rows.shape[1] * rows.itemsize
        raw = rows.tobytes()
        keys = [
            (m, c, raw[i * row : (i + 1) * row])
            for i, (m, c) in enumerate(zip(model_id.tolist(), cpu_free.tolist(), strict=True))
        ]
        memo = self._memo
        missing = [i for i, key in enumerate(keys) if key not in memo]
        if missing:
            if len(memo) + len(missing) > MEMO_MAX_STATES:
                memo.clear()
            at = np.array(missing, dtype=np.int64)
            values = self._evaluate(gpu_free[at], cpu_free[at], model_id[at]).tolist()
            for i, value in zip(missing, values, strict=True):
                memo[keys[i]] = value
        return np.array([memo[key] for key in keys], dtype=np.float64)

    def _counts(self, gpu_free: IntArray) -> tuple[IntArray, FloatArray]:
        """``(K, U)`` GPUs with at least threshold ``u`` free, and the free milli they hold.

        Integer-exact (the free milli sums are far below 2**53), so equal to the direct
        ``gpu_free >= threshold`` sums.
        """
        k = len(gpu_free)
        width = len(self.thresholds) + 1
        # Bin of a GPU: how many thresholds its free milli reaches (0..U); it counts for
        # threshold u exactly when its bin is > u.
        bins = np.searchsorted(self.thresholds, gpu_free, side="right")
        flat = (bins + (np.arange(k, dtype=np.int64) * width)[:, None]).ravel()
        hist = np.bincount(flat, minlength=k * width).reshape(k, width)
        held: FloatArray = np.asarray(
            np.bincount(flat, weights=gpu_free.ravel(), minlength=k * width), dtype=np.float64
        ).reshape(k, width)
        cnt: IntArray = np.cumsum(hist[:, :0:-1], axis=1)[:, ::-1]
        above: FloatArray = np.cumsum(held[:, :0:-1], axis=1)[:, ::-1]
        return cnt, above

    def _evaluate(self, gpu_free: IntArray, cpu_free: IntArray, model_id: IntArray) -> FloatArray:
        total = gpu_free.sum(axis=1)
        cnt, above = self._counts(gpu_free)
        host = (cnt[:, self.base_thr] >= self.base_num[None, :]) & (
            cpu_free[:, None] >= self.base_cpu[None, :]
        )
        # 0.0 - x: -x exactly, and +0.0 (not -0.0) for x == 0, as the integer negation gave.
        gain = np.where(host, (0.0 - above)[:, self.base_thr], 0.0)
        out: FloatArray = total * self.prob_sum + np.einsum(
            "kb,kb->k", gain, self.base_usable[model_id]
        )
        return out

    def hostable(self, gpu_free: IntArray, cpu_free: IntArray, model_id: IntArray) -> BoolArray:
        """``(K, S)``: whether each node state can host each GPU shape (CPU-only: False)."""
        groups = _distinct_states(gpu_free, cpu_free, model_id, self._shape_cpu_levels)
        if groups is not None:
            first, inverse = groups
            distinct = self._hostable(gpu_free[first], cpu_free[first], model_id[first])
            out: BoolArray = distinct[inverse]
            return out
        return self._hostable(gpu_free, cpu_free, model_id)

    def _hostable(self, gpu_free: IntArray, cpu_free: IntArray, model_id: IntArray) -> BoolArray:
        cnt, _ = self._counts(gpu_free)
        out: BoolArray = (
            (cnt[:, self.thr_index] >= self.num[None, :])
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
        stale = (self._versions != state.node_version).nonzero()[0]
        if len(stale):
            self._values[stale] = self.evaluator.nodes(state, stale)
            self._versions[stale] = state.node_version[stale]
        return self._values
