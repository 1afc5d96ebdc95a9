"""Baselines' defining behaviour on tiny hand-made clusters, and the fragmentation metric."""

from __future__ import annotations

import numpy as np
import pytest

from xpupool.placement.frag import FragEvaluator, Shape, ShapeDistribution
from xpupool.placement.ours import FragmentationPolicy
from xpupool.placement.policies import (
    BestFitPolicy,
    ClusteringPolicy,
    DotProdPolicy,
    FGDPolicy,
    PackingPolicy,
    PolicyContext,
    RandomPolicy,
    sigmoid_score,
)
from xpupool.placement.registry import DEFAULT_POLICY, POLICIES, make_policy
from xpupool.placement.state import ClusterState, NodeChoice, NodeSpec, PodDemand


def _state(*nodes: NodeSpec) -> ClusterState:
    return ClusterState.from_nodes(list(nodes))


def test_registry_has_all_policies_and_default() -> None:
    """POLICIES names the six baselines, first-fit, the fragmentation policy told the workload
    (``xpupool-static``) and the online form the scheduler's default places with."""
    assert set(POLICIES) == {
        "random",
        "dotprod",
        "clustering",
        "packing",
        "bestfit",
        "fgd",
        "firstfit",
        "xpupool-static",
        "xpupool-online",
    }
    assert DEFAULT_POLICY == "xpupool-online"
    with pytest.raises(KeyError):
        make_policy("nope")


def test_firstfit_takes_first_name_then_tightest_gpu() -> None:
    """First-fit ignores how full nodes are: first feasible name; sharing pods the tightest GPU."""
    st = _state(
        NodeSpec("b", 32_000, 10**6, 2, "G"),
        NodeSpec("a", 96_000, 10**6, 8, "G"),
        NodeSpec("c", 8_000, 10**6, 2, "T"),
    )
    pol = make_policy("firstfit")
    pl = pol.choose(st, PodDemand(8000, 1000, 1, 1000))
    assert pl is not None and pl.node == 1 and pl.gpus == (0,)
    st.allocate(NodeChoice.for_pod(1, (0,), PodDemand(8000, 1000, 1, 300)))
    st.allocate(NodeChoice.for_pod(1, (1,), PodDemand(8000, 1000, 1, 600)))
    pl = pol.choose(st, PodDemand(1000, 1000, 1, 300))
    assert pl is not None and pl.node == 1 and pl.gpus == (1,)
    # CPU and model feasibility: only "c" is a T node.
    pl = pol.choose(st, PodDemand(1000, 10, 2, 1000, frozenset({"T"})))
    assert pl is not None and pl.node == 2 and pl.gpus == (0, 1)
    assert pol.choose(st, PodDemand(200_000, 10, 0, 0)) is None


def test_bestfit_picks_tightest_node() -> None:
    """BestFit chooses the node with the least normalised CPU+GPU leftover."""
    st = _state(NodeSpec("a", 96_000, 10**6, 8, "G"), NodeSpec("b", 32_000, 10**6, 2, "G"))
    pl = BestFitPolicy().choose(st, PodDemand(8000, 1000, 1, 1000))
    assert pl is not None and pl.node == 1 and pl.gpus == (0,)


def test_dotprod_prefers_small_dot_product() -> None:
    """DotProd picks the node whose free vector aligns least with the request."""
    st = _state(NodeSpec("a", 128_000, 10**6, 8, "G"), NodeSpec("b", 16_000, 10**6, 2, "G"))
    pl = DotProdPolicy().choose(st, PodDemand(8000, 1000, 1, 1000))
    assert pl is not None and pl.node == 1


def test_packing_prefers_partially_used_gpu() -> None:
    """Packing puts a sharing pod on the fullest partially used GPU, not on an idle node."""
    st = _state(NodeSpec("a", 64_000, 10**6, 2, "G"), NodeSpec("b", 64_000, 10**6, 4, "G"))
    st.allocate(NodeChoice(1, (1,), 400, 0, 0))
    st.allocate(NodeChoice(1, (3,), 700, 0, 0))
    pl = PackingPolicy().choose(st, PodDemand(1000, 0, 1, 200))
    assert pl is not None and (pl.node, pl.gpus) == (1, (3,))


def test_packing_prefers_used_node_for_whole_gpu() -> None:
    """Packing sends whole-GPU pods to a used node before an idle one."""
    st = _state(NodeSpec("a", 64_000, 10**6, 2, "G"), NodeSpec("b", 64_000, 10**6, 4, "G"))
    st.allocate(NodeChoice(1, (0,), 1000, 0, 0))
    pl = PackingPolicy().choose(st, PodDemand(1000, 0, 2, 1000))
    assert pl is not None and (pl.node, pl.gpus) == (1, (1, 2))


def test_clustering_prefers_same_class_node() -> None:
    """Clustering groups pods of the same GPU class: a sharing pod joins sharing pods."""
    st = _state(
        NodeSpec("a", 64_000, 10**6, 4, "G"),
        NodeSpec("b", 64_000, 10**6, 4, "G"),
        NodeSpec("c", 64_000, 10**6, 4, "G"),
    )
    st.allocate(NodeChoice(0, (0,), 1000, 0, 0))
    st.allocate(NodeChoice(2, (0,), 300, 0, 0))
    pl = ClusteringPolicy().choose(st, PodDemand(1000, 0, 1, 300))
    assert pl is not None and pl.node == 2
    whole = ClusteringPolicy().choose(st, PodDemand(1000, 0, 1, 1000))
    assert whole is not None and whole.node == 0


def test_ties_go_to_first_node_name() -> None:
    """Equal scores go to the node whose name sorts first, not the first in list order."""
    st = _state(NodeSpec("z", 64_000, 10**6, 2, "G"), NodeSpec("m", 64_000, 10**6, 2, "G"))
    for policy in (BestFitPolicy(), DotProdPolicy(), PackingPolicy(), ClusteringPolicy()):
        pl = policy.choose(st, PodDemand(1000, 0, 1, 1000))
        assert pl is not None and pl.node == 1, policy.name


def test_random_is_seeded_and_picks_random_gpu() -> None:
    """Random depends only on its RNG, and spreads sharing pods over the fitting GPUs."""
    st = _state(*[NodeSpec(f"n{i}", 64_000, 10**6, 8, "G") for i in range(5)])
    pod = PodDemand(1000, 0, 1, 100)
    a = [RandomPolicy(np.random.default_rng(7)).choose(st, pod) for _ in range(3)]
    b = [RandomPolicy(np.random.default_rng(7)).choose(st, pod) for _ in range(3)]
    assert a == b
    pol = RandomPolicy(np.random.default_rng(1))
    seen = {(p.node, p.gpus) for p in (pol.choose(st, pod) for _ in range(200)) if p}
    assert len({g for _, g in seen}) > 4 and len({n for n, _ in seen}) == 5


def _two_shapes() -> ShapeDistribution:
    return ShapeDistribution((Shape(0, 500, 1), Shape(0, 1000, 1)), (0.5, 0.5))


def test_fgd_minimises_fragmentation_increase() -> None:
    """FGD fills the GPU whose leftover would be a fragment anyway, against name order."""
    st = _state(NodeSpec("b", 64_000, 10**6, 1, "G"), NodeSpec("a", 64_000, 10**6, 1, "G"))
    st.allocate(NodeChoice(0, (0,), 400, 0, 0))
    pl = FGDPolicy(_two_shapes()).choose(st, PodDemand(0, 0, 1, 500))
    assert pl is not None and pl.node == 0
    ev = FragEvaluator(_two_shapes(), st.models)
    before = ev.nodes(st)
    assert before.tolist() == [300.0, 0.0]


def test_fgd_picks_gpu_within_node() -> None:
    """FGD chooses, inside a node, the GPU whose use fragments least."""
    st = _state(NodeSpec("a", 64_000, 10**6, 2, "G"))
    st.allocate(NodeChoice(0, (1,), 400, 0, 0))
    pl = FGDPolicy(_two_shapes()).choose(st, PodDemand(0, 0, 1, 500))
    assert pl is not None and pl.gpus == (1,)


def test_sigmoid_score_is_truncated_integer() -> None:
    """FGD's score is int(100 x sigmoid(delta/1000)): 50 at zero, saturating at 99-100."""
    out = sigmoid_score(np.array([0.0, 39.0, -1000.0, 1e6]))
    assert out.tolist() == [50, 50, 26, 100]


def test_frag_hand_computed_example() -> None:
    """F_n on a hand-worked node: CPU-only, fitting, GPU-short and CPU-short shapes."""
    st = _state(NodeSpec("a", 10_000, 10**6, 2, "G"))
    st.allocate(NodeChoice(0, (1,), 700, 0, 0))
    dist = ShapeDistribution(
        (Shape(1000, 0, 0), Shape(4000, 500, 1), Shape(1000, 1000, 2), Shape(20_000, 1000, 1)),
        (0.25, 0.25, 0.25, 0.25),
    )
    frag = FragEvaluator(dist, st.models).nodes(st)
    # CPU-only: 1300; sharing 500 fits, GPU with 300 free is a fragment: 300;
    # two whole GPUs do not fit: 1300; 20 CPUs do not fit: 1300.
    assert frag[0] == pytest.approx(0.25 * (1300 + 300 + 1300 + 1300))


def test_frag_counts_wrong_model_as_fragment() -> None:
    """A shape restricted to another GPU model sees all idle GPU of the node as fragment."""
    st = _state(NodeSpec("a", 10_000, 10**6, 2, "G2"), NodeSpec("b", 10_000, 10**6, 2, "T4"))
    dist = ShapeDistribution((Shape(1000, 1000, 1, ("T4",)),), (1.0,))
    assert FragEvaluator(dist, st.models).nodes(st).tolist() == [2000.0, 0.0]


def test_typical_shapes_cover_95_percent() -> None:
    """typical() keeps the most frequent shapes until >= 95 % of pods, then renormalises."""
    pods = [PodDemand(1000, 0, 1, 500)] * 90 + [PodDemand(2000, 0)] * 6 + [PodDemand(3000, 0)] * 4
    dist = ShapeDistribution.typical(pods)
    assert dist.shapes == (Shape(1000, 500, 1), Shape(2000, 0, 0))
    assert sum(dist.probs) == pytest.approx(1.0)
    assert dist.probs[0] == pytest.approx(90 / 96)


def test_xpupool_avoids_stranding_gpus_with_cpu_only_pods() -> None:
    """xpupool sends a CPU-only pod to the CPU-rich node instead of the GPU-dense one."""
    st = _state(
        NodeSpec("a-dense", 24_000, 10**6, 8, "G"), NodeSpec("b-rich", 104_000, 10**6, 2, "G")
    )
    dist = ShapeDistribution((Shape(11_000, 1000, 1), Shape(20_000, 0, 0)), (0.8, 0.2))
    pol = FragmentationPolicy(dist)
    pl = pol.choose(st, PodDemand(20_000, 0))
    assert pl is not None and pl.node == 1


def test_xpupool_from_context_uses_workload() -> None:
    """The default policy builds its target from the context's workload."""
    pods = [PodDemand(4000, 0, 1, 500), PodDemand(8000, 0, 1, 1000), PodDemand(2000, 0)]
    pol = make_policy("xpupool-static", PolicyContext(workload=pods))
    assert isinstance(pol, FragmentationPolicy)
    assert pol.cpu_per_gpu == pytest.approx(12_000 / 1500)
    with pytest.raises(ValueError):
        make_policy("fgd", PolicyContext())
