"""xpupool's policy without a workload file: the request shapes are learned from the arrivals.

``ours.FragmentationPolicy`` measures fragmentation against the distribution of pod shapes the
cluster will see. The replay can hand it the trace's pod list; a live scheduler cannot, so this
module learns the distribution from the requests themselves:

* :class:`ShapeLearner` keeps an exponentially decayed histogram of the shapes observed (each
  weighted as the offline target weights them: ``1 + gpu_weight x GPUs requested``, by default
  the count alone; a shape carries its allowed GPU models), plus decayed sums of CPU and GPU
  milli for the CPU-per-GPU ratio and of the GPU milli requested under each model constraint,
  for the model pressure of ``ours.FragmentationPolicy.model_pressure``. The decay is a *window*
  in requests (``half_life``):
  a drifting workload is followed, a stationary one converges to its true distribution. Shapes
  whose weight decays below a negligible share are dropped, so the histogram stays bounded.
* :class:`OnlineFragmentationPolicy` places with ``ours.FragmentationPolicy`` built on the learned
  distribution, rebuilt when a shape never seen before arrives (a new shape changes what is a
  fragment; a rare one waits, see ``MATERIAL_SHARE``) and otherwise every ``rebuild_every``
  observations (a rebuild re-evaluates every node once, so it is amortised, not paid per
  decision).

Nothing here is fitted to a trace: ``half_life`` and ``rebuild_every`` are a window length and an
amortisation period; ``bench/placement`` shows the allocation ratio is flat across a wide range of
both. The first requests are placed against the little that has been seen; that costs little
because the cluster is empty then.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from xpupool.placement.frag import Shape, ShapeDistribution
from xpupool.placement.ours import DEFAULT_GAMMA, DEFAULT_GPU_WEIGHT, FragmentationPolicy
from xpupool.placement.state import MILLI, ClusterState, NodeChoice, PodDemand

__all__ = [
    "DEFAULT_HALF_LIFE",
    "DEFAULT_REBUILD_EVERY",
    "MATERIAL_SHARE",
    "MAX_TARGET_SHAPES",
    "TARGET_COVERAGE",
    "OnlineFragmentationPolicy",
    "ShapeLearner",
]

#: Requests after which an observation counts half as much as a new one.
DEFAULT_HALF_LIFE = 5_000.0
#: Observations between two rebuilds of the fragmentation target (new shapes rebuild at once).
DEFAULT_REBUILD_EVERY = 256
#: A shape never seen before rebuilds the target at once when it weighs at least this much (in
#: the first requests, always); a rarer one waits for the periodic rebuild, which bounds the
#: cost of workloads with hundreds of rare shapes (GPU-model constraints).
MATERIAL_SHARE = 0.01
#: The learned target keeps the most weighted shapes covering this much of the weight...
TARGET_COVERAGE = 0.999
#: ... and never more shapes than this.
MAX_TARGET_SHAPES = 1024
#: Request keys remembered so that a request retried cycle after cycle is counted once.
_SEEN_LIMIT = 200_000
#: A shape whose share of the total weight falls below this is forgotten.
_NEGLIGIBLE = 1e-6
#: Renormalise the weights before the growing scale can overflow a float.
_SCALE_LIMIT = 1e150


class ShapeLearner:
    """An exponentially decayed histogram of request shapes (see the module docstring)."""

    def __init__(
        self,
        half_life: float = DEFAULT_HALF_LIFE,
        coverage: float = TARGET_COVERAGE,
        gpu_weight: float = DEFAULT_GPU_WEIGHT,
    ) -> None:
        if half_life <= 0:
            raise ValueError("half_life must be positive")
        if not 0 < coverage <= 1:
            raise ValueError("coverage must be in (0, 1]")
        if gpu_weight < 0:
            raise ValueError("gpu_weight must not be negative")
        self.half_life = half_life
        self.coverage = coverage
        self.gpu_weight = gpu_weight
        # Decay by making each new observation weigh more (2^(1/half_life) per request) instead
        # of shrinking every old weight: O(1) per observation, renormalised rarely.
        self._growth = 2.0 ** (1.0 / half_life)
        self._scale = 1.0
        self._weights: dict[Shape, float] = {}
        self._total = 0.0
        self._cpu = 0.0
        self._gpu = 0.0
        # Decayed GPU request per model constraint (None: unconstrained), for the model pressure.
        self._by_set: dict[frozenset[str] | None, float] = {}
        self._seen: OrderedDict[Hashable, None] = OrderedDict()
        self.observed = 0

    def observe(self, pod: PodDemand, key: Hashable | None = None) -> bool:
        """Count ``pod``; returns True when its shape was never seen (or was forgotten).

        ``key`` (a job id) makes the observation idempotent: a request decided again in every
        cycle while it waits is still one request of the workload.
        """
        if key is not None:
            if key in self._seen:
                return False
            self._seen[key] = None
            if len(self._seen) > _SEEN_LIMIT:
                self._seen.popitem(last=False)
        shape = Shape.of(pod)
        weight = self._scale * (1.0 + self.gpu_weight * pod.gpu_request_milli / MILLI)
        new = shape not in self._weights
        self._weights[shape] = self._weights.get(shape, 0.0) + weight
        self._total += weight
        if pod.num_gpu:
            self._cpu += self._scale * pod.cpu_milli
            self._gpu += self._scale * pod.gpu_request_milli
            got = self._by_set.get(pod.allowed_models, 0.0)
            self._by_set[pod.allowed_models] = got + self._scale * pod.gpu_request_milli
        self._scale *= self._growth
        self.observed += 1
        if self._scale > _SCALE_LIMIT:
            self._renormalise()
        return new

    def _renormalise(self) -> None:
        s = self._scale
        self._weights = {
            shape: w / s for shape, w in self._weights.items() if w / self._total >= _NEGLIGIBLE
        }
        self._total = sum(self._weights.values())
        floor = _NEGLIGIBLE * self._gpu
        self._by_set = {k: v / s for k, v in self._by_set.items() if v >= floor}
        self._cpu /= s
        self._gpu /= s
        self._scale = 1.0

    def distribution(self) -> ShapeDistribution | None:
        """The learned shape distribution (None before the first observation).

        The most weighted shapes covering ``coverage`` of the weight, at most
        ``MAX_TARGET_SHAPES`` of them: the rest change the fragmentation measure by next to
        nothing, and a workload asking arbitrary CPU amounts must not make every decision cost
        more. Shapes whose weight became negligible are forgotten here as well.
        """
        if not self._weights:
            return None
        floor = _NEGLIGIBLE * self._total
        self._weights = {shape: w for shape, w in self._weights.items() if w >= floor}
        self._total = sum(self._weights.values())
        items = sorted(self._weights.items(), key=lambda kv: (kv[1], kv[0]), reverse=True)
        kept: list[tuple[Shape, float]] = []
        covered = 0.0
        for shape, weight in items[:MAX_TARGET_SHAPES]:
            kept.append((shape, weight))
            covered += weight
            if covered >= self.coverage * self._total:
                break
        return ShapeDistribution(
            tuple(shape for shape, _ in kept), tuple(w / covered for _, w in kept)
        )

    def share(self, pod: PodDemand) -> float:
        """The current weight of ``pod``'s shape in the distribution (0 when unseen)."""
        return self._weights.get(Shape.of(pod), 0.0) / self._total if self._total else 0.0

    def set_demand(self) -> dict[frozenset[str] | None, float]:
        """Share of the (decayed) GPU request under each model constraint; None: unconstrained."""
        if self._gpu <= 0:
            return {}
        return {k: v / self._gpu for k, v in self._by_set.items()}

    def cpu_per_gpu(self) -> float:
        """CPU milli requested per GPU milli by the GPU requests seen (0 before any)."""
        return self._cpu / self._gpu if self._gpu > 0 else 0.0


class OnlineFragmentationPolicy:
    """``ours.FragmentationPolicy`` on a learned target (see the module docstring).

    With ``learn_on_choose`` (the replay), every pod passed to :meth:`choose` is observed first;
    a scheduler that decides a waiting request again in each cycle turns it off and calls
    :meth:`observe` with the job id instead.
    """

    name = "xpupool-online"

    def __init__(
        self,
        half_life: float = DEFAULT_HALF_LIFE,
        rebuild_every: int = DEFAULT_REBUILD_EVERY,
        *,
        learn_on_choose: bool = True,
        coverage: float = TARGET_COVERAGE,
        gamma: float = DEFAULT_GAMMA,
        gpu_weight: float = DEFAULT_GPU_WEIGHT,
    ) -> None:
        self.learner = ShapeLearner(half_life, coverage, gpu_weight)
        self.gamma = gamma
        self.rebuild_every = max(1, rebuild_every)
        self.learn_on_choose = learn_on_choose
        self._inner: FragmentationPolicy | None = None
        self._since_rebuild = 0
        self.rebuilds = 0

    def observe(self, pod: PodDemand, key: Hashable | None = None) -> None:
        """Learn from one request (idempotent per ``key``)."""
        before = self.learner.observed
        new = self.learner.observe(pod, key)
        self._since_rebuild += self.learner.observed - before
        if self._since_rebuild >= self.rebuild_every or (
            new and self.learner.share(pod) >= MATERIAL_SHARE
        ):
            self._inner = None

    def current(self) -> FragmentationPolicy | None:
        """The policy on the distribution learned so far (None before any observation)."""
        if self._inner is None:
            dist = self.learner.distribution()
            if dist is None:
                return None
            self._inner = FragmentationPolicy(
                dist,
                cpu_per_gpu=self.learner.cpu_per_gpu(),
                demand=self.learner.set_demand(),
                gamma=self.gamma,
            )
            self._since_rebuild = 0
            self.rebuilds += 1
        return self._inner

    def warm(self, state: ClusterState) -> None:
        """``FragmentationPolicy.warm`` on the current target, if one is built (a target due
        to be rebuilt is left to the next decision, which starts its kept costs over)."""
        if self._inner is not None:
            self._inner.warm(state)

    def choose(self, state: ClusterState, pod: PodDemand) -> NodeChoice | None:
        """Where ``pod`` goes under the learned target."""
        if self.learn_on_choose:
            self.observe(pod)
        inner = self.current()
        if inner is None:
            # Nothing observed yet (only when learning is external): the pod is its own workload.
            inner = FragmentationPolicy(ShapeDistribution.empirical([pod]))
        return inner.choose(state, pod)
