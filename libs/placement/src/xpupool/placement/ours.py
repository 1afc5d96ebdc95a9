"""xpupool's own placement policy: fragmentation descent with explicit packing pressure.

FGD (``policies.FGDPolicy``) places a pod where the expected unusable GPU milli ``F_n`` grows
least. As published it owes part of its result to two accidents: its integer 0-100 score makes
most whole-GPU placements tie, and ties go to the node whose name sorts first, which turns it
into first-fit. This policy keeps the fragmentation signal but makes the packing explicit, so it
does not depend on how nodes are named:

``cost = dF + beta x dS + alpha x leftover``, lowest wins, where

* ``dF`` is the exact (not integer-truncated) change of ``F_n`` measured against the *whole*
  observed shape distribution, so that rare but large multi-GPU shapes (which the 95 %-by-count
  "typical" set drops) still count. Each shape weighs what FGD's definition of ``F_n`` says:
  the chance that the next pod has it (its count; ``gpu_weight`` adds ``gpu_weight x GPUs
  requested`` per pod, 0 by default: weighting by size counted a large pod's GPUs twice, once in
  its weight and once in the fragment it measures, and lost 0.1 point on multi-GPU-heavy
  workloads against FGD's count). Each shape is further weighted by ``N / H_m`` (nodes in the
  cluster / nodes of the empty cluster able to host it), renormalised: a node that is one of the
  few able to host a shape is worth keeping free for it (on the trace only the 39 128-CPU nodes
  host the 120-CPU 8-GPU pods);
* ``dS`` is the change of GPU milli stranded by CPU on the node: ``S = max(0, G - C / c)`` with
  ``G``/``C`` the node's free GPU/CPU milli and ``c`` the workload's CPU milli per GPU milli
  (taken from the workload, not tuned). On the trace, CPU rather than GPU runs out first on the
  8-GPU/96-CPU nodes while the 2-GPU/104-CPU nodes keep spare CPU; FGD does not see the GPUs a
  CPU-only pod strands until the node is nearly full, so it lets CPU-heavy pods eat the CPU of
  GPU-dense nodes. Pricing stranded GPU in the same unit as fragments fixes that;
* ``leftover`` is BestFit's normalised leftover (CPU and GPU, by the largest node) after the
  placement: among placements that fragment about equally, fill the fullest node first, which
  keeps whole nodes free for large pods without relying on node names;
* ``claim`` (``gamma x`` the pod's GPU milli ``x min(1, rho_m)``, see :meth:`model_pressure`)
  prices GPU taken from a model that demand pinned to it will want: in production a third of GPU
  jobs name the models they run on, concentrated on minority models (on the trace's constrained
  lists, T4 alone is asked for 1.2x its GPUs). ``rho_m`` sets the share of the GPU request that
  can only run on ``m`` (or on sets holding it) against ``m``'s share of the free GPU, both taken
  from the workload and the current state; where no request is constrained it is 0 and the
  policy is unchanged. A pod pinned to one model pays the same on every node it may use, so the
  term only steers pods that have a choice, away from the models others depend on;
* the node name is only the final tie-break, for determinism.

``alpha`` and ``beta`` are in milli-GPU and were not fitted: on the default trace (seeds 42-44,
before the scarcity weighting was added) allocation at 100 % arrival moved by < 0.1 point for
alpha in 30..300 and beta in 1..3. ``gamma`` is 1 by construction (a milli that pinned demand will
be refused is a milli lost, as a fragment is); ``bench/placement`` reports 0.5..2.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from xpupool.placement.frag import FragCache, FragEvaluator, Shape, ShapeDistribution
from xpupool.placement.policies import (
    MAX_SPEC_CPU,
    MAX_SPEC_GPU,
    Candidates,
    NodeGroups,
    PolicyContext,
    candidates,
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

#: Packing pressure in milli-GPU of fragmentation per unit of normalised leftover.
DEFAULT_ALPHA = 100.0
#: Weight of one milli-GPU stranded by lack of CPU, relative to one milli-GPU of fragment.
DEFAULT_BETA = 1.0
#: Weight of a pod's GPU request (in GPUs) added to its count of 1 in the target distribution
#: (0: the count alone, the next pod's probability, as FGD weighs shapes; see the docstring).
DEFAULT_GPU_WEIGHT = 0.0
#: Weight of one milli-GPU taken from a model that constrained demand will claim, relative to one
#: milli-GPU of fragment (1: the milli is as lost as a fragment; see ``model_pressure``).
DEFAULT_GAMMA = 1.0

#: Pod shapes (CPU, GPUs, milli-GPU per GPU) whose candidate costs are kept between decisions;
#: the least recently decided one goes first. A share's costs take 8 bytes per row and GPU (about
#: 80 KB a shape at 10,000 devices, 10 MB for all), and the learned target's rebuilds
#: (``online.py``) start them over anyway. The Alibaba trace's pods come in 91 shapes, of which
#: 32 cover 94 % of its pods and 64 cover 99.4 %: with 32 kept, a workload of that many shapes
#: evicted costs it still used and recomputed them on every row.
KEPT_SHAPES = 128
#: Shapes whose kept costs ``warm`` brings up to date, the last decided first: an idle
#: scheduler's read is followed by the next lone arrival's decision, usually of a recent shape;
#: a row that changes before the others are decided is recomputed again, so warming every
#: shape a workload ever had would mostly be wasted.
WARM_SHAPES = 4
#: Stale rows from which a refresh of kept costs scores one node of each group of identical
#: nodes (``NodeGroups``) and copies its costs to the others: a pool's nodes come in far fewer
#: states than there are nodes (146 groups among 1,797 nodes in the e2e bench's pool of 10,000
#: devices, 105 among the trace's 1,213: ``just bench-serial-decide [--mix trace]``), so a
#: shape's costs computed over every row (its first decision after the learned target's
#: rebuild, every 256 requests) cost about a tenth. A refresh of the rows a batch or two
#: changed is left as it was: on a pool 60 % held by shares, whose nodes are mostly in states
#: of their own, grouping as few as 32 rows gained nothing
#: (``just bench-serial-decide --mix share --fill 0.6 --warm``).
GROUPED_REFRESH_ROWS = 512

#: GPU request of each model constraint (``None``: unconstrained) as a share of all GPU request.
SetDemand = Mapping[frozenset[str] | None, float]


def set_demand(pods: Sequence[PodDemand]) -> dict[frozenset[str] | None, float]:
    """Share of the GPU request of ``pods`` under each model constraint (None: unconstrained)."""
    acc: dict[frozenset[str] | None, float] = {}
    for p in pods:
        if p.num_gpu:
            acc[p.allowed_models] = acc.get(p.allowed_models, 0.0) + p.gpu_request_milli
    total = sum(acc.values())
    return {k: v / total for k, v in acc.items()} if total > 0 else {}


def target_distribution(
    pods: Sequence[PodDemand], gpu_weight: float = DEFAULT_GPU_WEIGHT
) -> ShapeDistribution:
    """All observed shapes, each pod weighted by ``1 + gpu_weight x GPUs requested``."""
    weights = [1.0 + gpu_weight * p.gpu_request_milli / MILLI for p in pods]
    return ShapeDistribution.empirical(pods, weights)


def cpu_per_gpu_milli(shapes: Sequence[Shape], probs: Sequence[float]) -> float:
    """CPU milli requested per GPU milli by the GPU shapes (0 when there are none)."""
    cpu = sum(p * s.cpu_milli for s, p in zip(shapes, probs, strict=True) if s.num_gpu)
    gpu = sum(p * s.num_gpu * s.gpu_milli for s, p in zip(shapes, probs, strict=True) if s.num_gpu)
    return cpu / gpu if gpu > 0 else 0.0


@dataclass
class _ShapeCosts:
    """One pod shape's candidate costs on every row, each row as of its ``node_version``."""

    version: IntArray
    """The row's ``node_version`` its costs were computed at (-1: never)."""
    cost: FloatArray
    """``(rows, GPUs)`` (one column for a pod that is not a share): each candidate's cost but
    the claim, at the GPU it takes, inf where there is none; already rounded as a decision
    compares it when the policy never adds a claim (``_claiming``)."""
    pod: PodDemand
    """The last pod of this shape decided (``warm`` refreshes the costs for it)."""


class FragmentationPolicy:
    """Fragmentation descent + explicit best-fit packing (see module docstring)."""

    name = "xpupool-static"

    def __init__(
        self,
        target: ShapeDistribution,
        alpha: float = DEFAULT_ALPHA,
        beta: float = DEFAULT_BETA,
        cpu_per_gpu: float | None = None,
        cpu_weight: float = 0.5,
        scarcity: bool = True,
        demand: SetDemand | None = None,
        gamma: float = DEFAULT_GAMMA,
    ) -> None:
        self.scarcity = scarcity
        # Only constraints that exclude some model can make one model scarcer than another.
        self.demand = {k: v for k, v in (demand or {}).items() if k and v > 0}
        self.gamma = gamma
        self._pressure_models: tuple[str, ...] | None = None
        self._set_masks: FloatArray = np.zeros((0, 0))
        self._set_shares: FloatArray = np.zeros(0)
        self.target = target
        self.alpha = alpha
        self.beta = beta
        self.cpu_per_gpu = (
            cpu_per_gpu
            if cpu_per_gpu is not None
            else cpu_per_gpu_milli(target.shapes, target.probs)
        )
        self.cpu_weight = cpu_weight
        self._evaluator: FragEvaluator | None = None
        self._cache: FragCache | None = None
        # The static node arrays (CPU capacity, GPUs, model) the evaluator's scarcity weights
        # were computed from: another cluster with the same models needs other weights.
        self._weighted_for: tuple[IntArray, IntArray, IntArray] | None = None
        self._groups = NodeGroups()
        self._kept: OrderedDict[tuple[int, int, int], _ShapeCosts] = OrderedDict()
        self._kept_token: object = None
        self._last_token: object = None

    @classmethod
    def from_context(cls, ctx: PolicyContext) -> FragmentationPolicy:
        """Target = the context's workload (all shapes, GPU-weighted), else its typical set."""
        if ctx.workload:
            pods = ctx.workload
            ratio = cpu_per_gpu_milli([Shape.of(p) for p in pods], [1.0] * len(pods))
            return cls(target_distribution(pods), cpu_per_gpu=ratio, demand=set_demand(pods))
        return cls(ctx.typical_shapes())

    def _frag(self, state: ClusterState) -> tuple[FragEvaluator, FragCache]:
        if (
            self._evaluator is None
            or self._evaluator.models != state.models
            or not self._weighted_on(state)
        ):
            probe = FragEvaluator(self.target, state.models)
            if self.scarcity:
                # Same evaluator as FragEvaluator(self._scarcity_weighted(state), models).
                probe = probe.reweighted(self._scarcity_weighted(state, probe))
            self._evaluator = probe
            self._cache = FragCache(self._evaluator)
            self._weighted_for = (state.cpu_cap, state.num_gpu, state.model_id)
        assert self._cache is not None
        return self._evaluator, self._cache

    def _weighted_on(self, state: ClusterState) -> bool:
        """Whether the evaluator's scarcity weights are those of ``state``'s nodes.

        They count the nodes of the empty cluster able to host each shape, so a node view
        rebuilt for a node added or removed (same models) needs new ones: kept, a policy decided
        otherwise than a fresh one on the same state. Copies of a state (one-off restricted
        ones) share its static arrays, which the identity test answers at once.
        """
        if not self.scarcity:
            return True
        was = self._weighted_for
        if was is None:
            return False
        now = (state.cpu_cap, state.num_gpu, state.model_id)
        if all(a is b for a, b in zip(now, was, strict=True)):
            return True
        if not all(np.array_equal(a, b) for a, b in zip(now, was, strict=True)):
            return False
        self._weighted_for = now  # the same cluster rebuilt: same weights
        return True

    def _scarcity_weighted(
        self, state: ClusterState, probe: FragEvaluator | None = None
    ) -> ShapeDistribution:
        """Target reweighted by how few nodes of the (empty) cluster can host each shape.

        Losing one of the 39 nodes able to host a 120-CPU 8-GPU pod costs more than losing one of
        the 1,200 that host a 1-GPU pod; ``p_m x N / H_m`` (renormalised) says so without any
        tuned constant. ``probe``: an evaluator of the target on ``state``'s models, if at hand.
        """
        if not self.scarcity:
            return self.target
        if probe is None:
            probe = FragEvaluator(self.target, state.models)
        empty = np.where(state.gpu_exists, MILLI, 0).astype(np.int64)
        hosts = probe.hostable(empty, state.cpu_cap, state.model_id).sum(axis=0)
        probs = np.array(self.target.probs) * state.num_nodes / np.maximum(hosts, 1)
        probs = np.where(hosts > 0, probs, np.array(self.target.probs))
        probs /= probs.sum()
        return ShapeDistribution(self.target.shapes, tuple(float(x) for x in probs))

    def model_pressure(self, state: ClusterState) -> FloatArray:
        """Per model of ``state``: how much of its free GPU the constrained demand will claim.

        Each constraint's share ``d_A`` of the GPU request is spread over the models ``A`` allows
        in proportion to their free GPU, and set against the model's share of the cluster's free
        GPU: ``rho_m = (free / demand) x sum_{A contains m} d_A / free_A``. ``rho_m >= 1`` means
        demand that can only run on ``m`` (or on sets ``m`` is part of) arrives at least as fast,
        per free GPU, as the workload as a whole fills the cluster: a milli of ``m`` taken by a
        pod that could have run elsewhere is then a milli that such demand will be refused.
        """
        if not self.demand:
            return np.zeros(len(state.models))
        if self._pressure_models != state.models:
            sets = list(self.demand)
            self._set_masks = np.array(
                [[m in a for m in state.models] for a in sets if a], dtype=np.float64
            )
            self._set_shares = np.array([self.demand[a] for a in sets], dtype=np.float64)
            self._pressure_models = state.models
        free = np.bincount(
            state.model_id, weights=state.gpu_free.sum(axis=1), minlength=len(state.models)
        )
        free_sets = self._set_masks @ free
        per_free = np.divide(
            self._set_shares,
            free_sets,
            out=np.full(len(free_sets), np.inf),
            where=free_sets > 0,
        )
        rho: FloatArray = float(free.sum()) * (self._set_masks.T @ np.minimum(per_free, 1e12))
        return rho

    def choose(self, state: ClusterState, pod: PodDemand) -> NodeChoice | None:
        """NodeChoice with the lowest ``dF + beta x dS + alpha x leftover + gamma x claim``."""
        feasible = state.feasible(pod)
        # A decision is a few dozen numpy calls on small arrays, so each is made as the array's
        # method or the ufunc's reduce: numpy's module functions add a Python wrapper to each.
        rows = feasible.nonzero()[0]
        if not len(rows):
            return None
        if not self._keeps(state):
            return self._choose_afresh(state, pod, feasible)
        # Every term but the claim is a function of the row's state and the pod's shape alone,
        # so each shape's candidate costs are kept per row and recomputed only on rows whose
        # version moved: a decision then costs what changed since the last one of its shape,
        # plus a few vector operations over the feasible rows.
        kept = self._kept_costs(state, pod)
        self._refresh(state, kept, feasible)
        if self._claims(pod):
            costs = (kept.cost[rows] + self._claim(state, pod, rows)[:, None]).round(6)
        elif self._claiming:
            costs = kept.cost[rows].round(6)
        else:
            costs = kept.cost[rows]
        # Lowest cost, then first node by name, then lowest GPU (flat indices are row-major).
        # Found in the flattened costs: nonzero() of the 2-D array took ten times as long
        # (22 against 2 us over a pool's 1,250 rows of eight GPUs).
        flat, width = costs.ravel(), costs.shape[1]
        hits = (flat == np.minimum.reduce(flat)).nonzero()[0]
        hit_rows, hit_gpus = hits // width, hits % width
        k = int(state.name_rank[rows[hit_rows]].argmin())
        node = int(rows[hit_rows[k]])
        if pod.is_sharing:
            return NodeChoice.for_pod(node, (int(hit_gpus[k]),), pod)
        return NodeChoice.for_pod(node, state.best_fit_gpus(node, pod), pod)

    def warm(self, state: ClusterState, shapes: int = WARM_SHAPES) -> None:
        """Bring the kept costs of the ``shapes`` shapes decided last up to date on ``state``
        (if it is the kept state): what the next decision of such a shape would compute first,
        done ahead (the scheduler does it while idle). Decisions are the same: a row's costs
        are a function of its state, and a row that changes again is recomputed again."""
        if shapes <= 0 or state.token is not self._kept_token:
            return  # (``[-0:]`` would be every shape)
        for kept in list(self._kept.values())[-shapes:]:
            self._refresh(state, kept, state.feasible(kept.pod))

    def _refresh(self, state: ClusterState, kept: _ShapeCosts, feasible: BoolArray) -> None:
        """Recompute ``kept``'s costs on the feasible rows whose version moved since."""
        stale = (feasible & (kept.version != state.node_version)).nonzero()[0]
        if not len(stale):
            return
        if len(stale) >= GROUPED_REFRESH_ROWS:
            kept.cost[stale] = self._grouped_costs(state, kept.pod, stale)
        else:
            kept.cost[stale] = np.inf
            cand, cost = self._costs_at(state, kept.pod, stale)
            kept.cost[cand.node, np.maximum(cand.gpu, 0)] = cost
        kept.version[stale] = state.node_version[stale]

    def _costs_at(
        self, state: ClusterState, pod: PodDemand, rows: IntArray
    ) -> tuple[Candidates, FloatArray]:
        """``pod``'s candidates on ``rows`` and their costs as ``_ShapeCosts.cost`` keeps them."""
        evaluator, cache = self._frag(state)
        cand = candidates(state, rows, pod)
        cost = self._candidate_costs(state, cand, evaluator, cache.values(state))
        return cand, cost if self._claiming else cost.round(6)

    def _grouped_costs(self, state: ClusterState, pod: PodDemand, rows: IntArray) -> FloatArray:
        """The costs ``_refresh`` keeps for ``pod`` on many ``rows`` (a line per row, inf where
        there is no candidate), scoring one row of each group of identical nodes among them
        (``NodeGroups``: same model, free CPU and multiset of free GPU shares) and copying its
        costs to the rest. A share's cost at a GPU depends on that GPU's free share alone among
        the slots (the after-states are the same up to slot order), so a row's slots take the
        costs of the representative's slots in the same place when both rows' slots are sorted
        by free share (stably: among equal shares only the lowest slot is a candidate in either,
        ``candidates``)."""
        groups = self._groups.group_ids(state)[rows]
        _, first, member_of = np.unique(groups, return_index=True, return_inverse=True)
        representatives = rows[first]
        cand, cost = self._costs_at(state, pod, representatives)
        line = np.empty(state.num_nodes, dtype=np.int64)
        line[representatives] = np.arange(len(representatives))
        costs = np.full(
            (len(representatives), state.gpu_free.shape[1] if pod.is_sharing else 1), np.inf
        )
        costs[line[cand.node], np.maximum(cand.gpu, 0)] = cost
        if not pod.is_sharing:
            spread: FloatArray = costs[member_of]
            return spread
        free = state.gpu_free
        by_share = np.take_along_axis(
            costs, np.argsort(free[representatives], axis=1, kind="stable"), axis=1
        )[member_of]
        out = np.empty_like(by_share)
        np.put_along_axis(out, np.argsort(free[rows], axis=1, kind="stable"), by_share, axis=1)
        return out

    def _choose_afresh(
        self, state: ClusterState, pod: PodDemand, feasible: BoolArray
    ) -> NodeChoice | None:
        """``choose`` on a state decided on once (a restricted copy): one node per group of
        identical feasible nodes is scored (see NodeGroups), the same choice, nothing kept."""
        idx = self._groups.representatives(state, feasible)
        evaluator, cache = self._frag(state)
        cand = candidates(state, idx, pod)
        cost = self._candidate_costs(state, cand, evaluator, cache.values(state))
        if self._claims(pod):
            cost = cost + self._claim(state, pod, cand.node)
        # Round away float noise so that genuinely equal costs fall to the name tie-break.
        cost = np.round(cost, 6)
        rows = np.flatnonzero(cost == cost.min())
        row = int(rows[np.argmin(state.name_rank[cand.node[rows]])])
        node = int(cand.node[row])
        if pod.is_sharing:
            return NodeChoice.for_pod(node, (int(cand.gpu[row]),), pod)
        return NodeChoice.for_pod(node, state.best_fit_gpus(node, pod), pod)

    def _candidate_costs(
        self,
        state: ClusterState,
        cand: Candidates,
        evaluator: FragEvaluator,
        before: FloatArray,
    ) -> FloatArray:
        """``dF + alpha x leftover + beta x dS`` of each candidate (the claim is added apart)."""
        after = evaluator.evaluate(cand.gpu_free, cand.cpu_free, state.model_id[cand.node])
        g_after = np.add.reduce(cand.gpu_free, axis=1)
        leftover = (
            self.cpu_weight * cand.cpu_free / MAX_SPEC_CPU
            + (1 - self.cpu_weight) * g_after / MAX_SPEC_GPU
        )
        cost: FloatArray = (after - before[cand.node]) + self.alpha * leftover
        if self.beta > 0 and self.cpu_per_gpu > 0:
            g_before = state.gpu_free[cand.node].sum(1)
            c_before = state.cpu_free[cand.node]
            s_before = np.maximum(0.0, g_before - c_before / self.cpu_per_gpu)
            s_after = np.maximum(0.0, g_after - cand.cpu_free / self.cpu_per_gpu)
            cost = cost + self.beta * (s_after - s_before)
        return cost

    @property
    def _claiming(self) -> bool:
        """Whether some pod's cost may carry a claim (constrained demand was seen)."""
        return bool(self.demand) and self.gamma > 0

    def _claims(self, pod: PodDemand) -> bool:
        return self._claiming and pod.num_gpu > 0

    def _claim(self, state: ClusterState, pod: PodDemand, nodes: IntArray) -> FloatArray:
        """``gamma x claim`` of ``pod`` on each of ``nodes`` (its model's capped pressure)."""
        rho = np.minimum(self.model_pressure(state), 1.0)
        claim: FloatArray = self.gamma * pod.gpu_request_milli * rho[state.model_id[nodes]]
        return claim

    def _keeps(self, state: ClusterState) -> bool:
        """Whether costs are kept for ``state``: the state decided on twice in a row becomes
        the kept one (a scheduler's node view, a replay's cluster); a copy made for one
        decision (held nodes, an id filter) is decided on afresh and leaves the kept costs be."""
        token = state.token
        if token is self._kept_token:
            return True
        previous, self._last_token = self._last_token, token
        if token is not previous:
            return False
        self._kept_token = token
        self._kept.clear()
        return True

    def _kept_costs(self, state: ClusterState, pod: PodDemand) -> _ShapeCosts:
        key = (pod.cpu_milli, pod.num_gpu, pod.gpu_milli)
        kept = self._kept.get(key)
        if kept is None:
            width = state.gpu_free.shape[1] if pod.is_sharing else 1
            kept = self._kept[key] = _ShapeCosts(
                version=np.full(state.num_nodes, -1, dtype=np.int64),
                cost=np.full((state.num_nodes, width), np.inf),
                pod=pod,
            )
            if len(self._kept) > KEPT_SHAPES:
                self._kept.popitem(last=False)
        else:
            self._kept.move_to_end(key)
            kept.pod = pod
        return kept
