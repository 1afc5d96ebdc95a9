"""The online policy: a decayed shape histogram, idempotent per key, and the same decisions as
the offline policy once it has seen the same workload."""

from __future__ import annotations

import pytest

from xpupool.placement.frag import Shape
from xpupool.placement.online import OnlineFragmentationPolicy, ShapeLearner
from xpupool.placement.ours import FragmentationPolicy, target_distribution
from xpupool.placement.policies import PolicyContext
from xpupool.placement.state import ClusterState, NodeSpec, PodDemand
from xpupool.replay.arrivals import build_fgd_workload, replay_arrivals
from xpupool.replay.trace import TracePod

SHARE = PodDemand(4_000, 1024, 1, 500)
WHOLE = PodDemand(8_000, 1024, 1, 1000)
CPU = PodDemand(2_000, 1024)


def test_observations_are_idempotent_per_key() -> None:
    learner = ShapeLearner()
    assert learner.observe(SHARE, "job-1") is True
    assert learner.observe(SHARE, "job-1") is False
    assert learner.observe(SHARE, "job-2") is False  # counted, but not a new shape
    assert learner.observed == 2
    dist = learner.distribution()
    assert dist is not None and dist.shapes == (Shape.of(SHARE),) and dist.probs == (1.0,)


def test_weights_follow_the_offline_target() -> None:
    """Each request weighs 1 + gpu_weight x GPUs requested, as ``ours.target_distribution``
    weighs pods: by default its count alone, the next pod's probability."""
    for gpu_weight, weights in ((0.0, (1.0, 1.0, 1.0)), (1.0, (1.5, 2.0, 1.0))):
        learner = ShapeLearner(half_life=1e12, gpu_weight=gpu_weight)
        for pod in (SHARE, WHOLE, CPU):
            learner.observe(pod)
        dist = learner.distribution()
        assert dist is not None
        probs = dict(zip(dist.shapes, dist.probs, strict=True))
        offline = target_distribution([SHARE, WHOLE, CPU], gpu_weight)
        assert probs == pytest.approx(dict(zip(offline.shapes, offline.probs, strict=True)))
        total = sum(weights)
        for pod, weight in zip((SHARE, WHOLE, CPU), weights, strict=True):
            assert probs[Shape.of(pod)] == pytest.approx(weight / total)
    assert learner.cpu_per_gpu() == pytest.approx((4_000 + 8_000) / (500 + 1000))


def test_old_shapes_fade_with_the_half_life() -> None:
    learner = ShapeLearner(half_life=100)
    learner.observe(CPU)
    for _ in range(100):
        learner.observe(PodDemand(2_000, 1024, 0, 0, frozenset({"T4"})))
    dist = learner.distribution()
    assert dist is not None
    old = dict(zip(dist.shapes, dist.probs, strict=True))[Shape.of(CPU)]
    # Request i weighs 2^(i / half_life): after one half-life the first weighs half the newest.
    total = 1.0 + sum(2 ** (i / 100) for i in range(1, 101))
    assert old == pytest.approx(1.0 / total)


def test_renormalising_keeps_proportions_and_forgets_negligible_shapes() -> None:
    learner = ShapeLearner(half_life=1.0)  # each observation doubles the next one's weight
    learner.observe(CPU)
    for _ in range(600):  # well past the float guard: renormalised several times
        learner.observe(SHARE)
    dist = learner.distribution()
    assert dist is not None
    assert dist.shapes == (Shape.of(SHARE),)  # the single CPU request fell below negligible
    assert sum(dist.probs) == pytest.approx(1.0)


def test_new_shapes_rebuild_at_once_and_known_ones_periodically() -> None:
    policy = OnlineFragmentationPolicy(rebuild_every=3, learn_on_choose=False)
    policy.observe(SHARE, "a")
    first = policy.current()
    policy.observe(SHARE, "b")
    assert policy.current() is first  # same shape, period not reached
    policy.observe(WHOLE, "c")
    second = policy.current()
    assert second is not first  # a new shape
    for key in "def":
        policy.observe(SHARE, key)
    assert policy.current() is not second  # the period elapsed
    assert policy.rebuilds == 3


def test_after_seeing_the_workload_it_decides_as_the_offline_policy(
    small_nodes: list[NodeSpec], small_pods: list[TracePod]
) -> None:
    """With no decay, no coverage cut and the whole workload observed first, the learned target
    is exactly the offline one, so every decision is the same."""
    original = [p.demand for p in small_pods]
    offline = FragmentationPolicy.from_context(PolicyContext(workload=original))
    online = OnlineFragmentationPolicy(
        half_life=1e12, rebuild_every=10**9, learn_on_choose=False, coverage=1.0
    )
    for i, pod in enumerate(original):
        online.observe(pod, i)
    capacity = sum(n.num_gpu for n in small_nodes) * 1000
    workload = build_fgd_workload(original, 42, capacity)
    metric = offline.target
    a = replay_arrivals(small_nodes, workload, offline, metric, record_placements=True)
    b = replay_arrivals(small_nodes, workload, online, metric, record_placements=True)
    assert len(a.placements) > 100
    assert a.placements == b.placements
    assert a.alloc_at(100) == b.alloc_at(100)


def test_learning_while_placing_tracks_the_offline_policy(
    small_nodes: list[NodeSpec], small_pods: list[TracePod]
) -> None:
    """Learning from the arrivals only (the replay's ``xpupool-online``) costs at most a little
    allocation against knowing the workload in advance (the reduced trace, seed 42)."""
    original = [p.demand for p in small_pods]
    offline = FragmentationPolicy.from_context(PolicyContext(workload=original))
    capacity = sum(n.num_gpu for n in small_nodes) * 1000
    workload = build_fgd_workload(original, 42, capacity)
    a = replay_arrivals(small_nodes, workload, offline, offline.target)
    b = replay_arrivals(small_nodes, workload, OnlineFragmentationPolicy(), offline.target)
    assert b.alloc_at(100) >= a.alloc_at(100) - 1.0


def test_a_rare_new_shape_waits_for_the_periodic_rebuild() -> None:
    policy = OnlineFragmentationPolicy(half_life=1e12, rebuild_every=1000, learn_on_choose=False)
    for i in range(500):
        policy.observe(SHARE, i)
    built = policy.current()
    policy.observe(PodDemand(1_000, 512, 1, 1000, frozenset({"T4"})), "rare")  # < 1 % of weight
    assert policy.current() is built
    for i in range(500, 1499):  # the period counts from the rebuild: 1 + 999 observations
        policy.observe(SHARE, i)
    assert policy.current() is not built


def test_the_target_keeps_the_shapes_covering_most_of_the_weight() -> None:
    """Rare shapes beyond the coverage are left out of the target (and renormalised away)."""
    learner = ShapeLearner(half_life=1e12, coverage=0.99)
    for i in range(200):
        learner.observe(SHARE, i)
    learner.observe(CPU, "rare")  # 1 of 301 units of weight: beyond 99 %
    dist = learner.distribution()
    assert dist is not None and dist.shapes == (Shape.of(SHARE),) and dist.probs == (1.0,)
    full = ShapeLearner(half_life=1e12, coverage=1.0)
    for i in range(200):
        full.observe(SHARE, i)
    full.observe(CPU, "rare")
    both = full.distribution()
    assert both is not None and len(both.shapes) == 2


def test_unconstrained_pods_keep_off_a_model_that_constrained_demand_claims() -> None:
    """Once requests pinned to the small model "T" have been seen, a pod that may run anywhere
    goes to the big model's nodes, though best fit alone prefers the small (tighter) T node."""
    nodes = [NodeSpec(f"g{i}", 96_000, 10**6, 8, "G") for i in range(4)] + [
        NodeSpec(f"t{i}", 16_000, 10**6, 2, "T") for i in range(4)
    ]
    state = ClusterState.from_nodes(nodes)
    free_pod = PodDemand(4000, 1000, 1, 1000, name="free")
    plain = OnlineFragmentationPolicy()
    for i in range(50):
        plain.observe(PodDemand(4000, 1000, 1, 1000, name=f"u{i}"))
    pinned = OnlineFragmentationPolicy()
    for i in range(50):
        models = frozenset({"T"}) if i % 2 else None
        pinned.observe(PodDemand(4000, 1000, 1, 1000, models, name=f"p{i}"))
    inner = pinned.current()
    assert inner is not None
    rho = dict(zip(state.models, inner.model_pressure(state), strict=True))
    assert rho["T"] > 1.0 > rho["G"]
    got_plain = plain.choose(state, free_pod)
    got_pinned = pinned.choose(state, free_pod)
    assert got_plain is not None and state.models[state.model_id[got_plain.node]] == "T"
    assert got_pinned is not None and state.models[state.model_id[got_pinned.node]] == "G"


def test_learner_keeps_the_demand_of_each_constraint() -> None:
    """``set_demand`` is each constraint's share of the GPU request (CPU-only pods excluded)."""
    learner = ShapeLearner(half_life=1e9)
    learner.observe(PodDemand(1000, 10, 1, 1000, frozenset({"T"})))
    learner.observe(PodDemand(1000, 10, 3, 1000))
    learner.observe(PodDemand(1000, 10))
    got = learner.set_demand()
    assert got[frozenset({"T"})] == pytest.approx(0.25)
    assert got[None] == pytest.approx(0.75)
