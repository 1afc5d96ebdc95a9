"""Packing and Clustering break ties in the published simulator's node order.

The simulator (hkust-adsl/kubernetes-scheduler-simulator, ``pkg/simulator/simulator.go``,
``syncClusterResourceList``) sorts the nodes by name and renames node ``i`` to
``"%04d-" % perm[i] + name`` with ``perm = rand.Perm(n)`` before scheduling; its ``selectHost``
then gives equal scores to the smallest (renamed) name. Both GPU plugins score CPU-only pods
``MinNodeScore`` on every node, so those pods go to the first feasible node of that random order.
"""

from __future__ import annotations

import numpy as np
import pytest

from xpupool.placement.policies import (
    ClusteringPolicy,
    PackingPolicy,
    PolicyContext,
    SimulatorNodeOrder,
)
from xpupool.placement.registry import make_policy
from xpupool.placement.state import ClusterState, NodeSpec, Placement, PodDemand

POLICIES = (PackingPolicy, ClusteringPolicy)
CPU_POD = PodDemand(16_000, 1_000)


def _cluster() -> ClusterState:
    """Six nodes of three shapes, listed out of name order."""
    specs = [
        NodeSpec("n4", 64_000, 10**6, 8, "G"),
        NodeSpec("n1", 32_000, 10**6, 2, "G"),
        NodeSpec("n5", 64_000, 10**6, 4, "G"),
        NodeSpec("n0", 32_000, 10**6, 2, "G"),
        NodeSpec("n3", 64_000, 10**6, 8, "G"),
        NodeSpec("n2", 64_000, 10**6, 4, "G"),
    ]
    return ClusterState.from_nodes(specs)


def _expected_order(state: ClusterState, seed: int) -> list[int]:
    """Node indices in the simulator's tie order: name order renamed by a permutation."""
    by_name = sorted(range(state.num_nodes), key=lambda i: state.names[i])
    perm = np.random.default_rng(seed).spawn(1)[0].permutation(state.num_nodes)
    return [by_name[i] for i in np.argsort(perm)]


@pytest.mark.parametrize("cls", POLICIES)
def test_without_rng_ties_keep_name_order(cls: type[PackingPolicy | ClusteringPolicy]) -> None:
    """No rng: a CPU-only pod (score 0 everywhere) goes to the first node by plain name."""
    st = _cluster()
    pl = cls().choose(st, CPU_POD)
    assert pl is not None and st.names[pl.node] == "n0" and pl.gpus == ()


@pytest.mark.parametrize("cls", POLICIES)
@pytest.mark.parametrize("seed", [0, 1, 42, 51])
def test_cpu_only_pods_follow_the_permuted_order(
    cls: type[PackingPolicy | ClusteringPolicy], seed: int
) -> None:
    """CPU-only pods fill nodes in the run's fixed random order, one node after the other."""
    st = _cluster()
    policy = cls(np.random.default_rng(seed))
    seen: list[int] = []
    for _ in range(24):  # 320 CPUs in all, 16 per pod: 20 fit, then none
        pl = policy.choose(st, CPU_POD)
        if pl is None:
            break
        st.allocate(pl)
        if not seen or seen[-1] != pl.node:
            seen.append(pl.node)
    assert seen == _expected_order(st, seed)
    assert int(st.cpu_free.sum()) == 0


def test_order_is_random_across_seeds_and_fixed_within_a_run() -> None:
    """Different seeds start at different nodes; one policy keeps its order for the cluster."""
    firsts = set()
    for seed in range(30):
        st = _cluster()
        order = SimulatorNodeOrder(np.random.default_rng(seed))
        rank = order.rank(st).copy()
        assert sorted(rank.tolist()) == list(range(st.num_nodes))
        assert np.array_equal(order.rank(st.copy()), rank)  # a copy is the same cluster
        firsts.add(int(np.argmin(rank)))
    assert len(firsts) > 2


@pytest.mark.parametrize("cls", POLICIES)
def test_scores_still_win_over_the_tie_order(cls: type[PackingPolicy | ClusteringPolicy]) -> None:
    """The order only breaks ties: a sharing pod still joins the node that already shares."""
    for seed in range(10):
        st = _cluster()
        order = _expected_order(st, seed)
        used = order[-1]  # last in the tie order
        st.allocate(Placement.for_pod(used, (0,), PodDemand(1_000, 0, 1, 500)))
        pl = cls(np.random.default_rng(seed)).choose(st, PodDemand(1_000, 0, 1, 300))
        assert pl is not None and pl.node == used and pl.gpus == (0,)


@pytest.mark.parametrize("name", ["packing", "clustering"])
def test_registry_passes_the_context_rng(name: str) -> None:
    """make_policy builds both from PolicyContext.rng, so a seed fixes the tie order."""
    st = _cluster()
    pl = make_policy(name, PolicyContext(rng=np.random.default_rng(7))).choose(st, CPU_POD)
    assert pl is not None and pl.node == _expected_order(st, 7)[0]
