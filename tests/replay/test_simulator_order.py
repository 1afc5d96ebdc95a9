"""The FGD protocol's node renaming (``fgd_cluster``): every policy's ties follow a random node
order drawn once per run, as the published simulator's renamed nodes make them."""

from __future__ import annotations

import pytest

from xpupool.placement.registry import make_policy
from xpupool.placement.state import ClusterState, NodeChoice, NodeSpec, PodDemand
from xpupool.replay.arrivals import fgd_cluster

CPU_POD = PodDemand(16_000, 1_000)
SPECS = [  # three shapes, listed out of name order
    NodeSpec("n4", 64_000, 10**6, 8, "G"),
    NodeSpec("n1", 32_000, 10**6, 2, "G"),
    NodeSpec("n5", 64_000, 10**6, 4, "G"),
    NodeSpec("n0", 32_000, 10**6, 2, "G"),
    NodeSpec("n3", 64_000, 10**6, 8, "G"),
    NodeSpec("n2", 64_000, 10**6, 4, "G"),
]


def _tie_order(nodes: list[NodeSpec]) -> list[int]:
    """Row indices by renamed name: the order ties go in."""
    return sorted(range(len(nodes)), key=lambda i: nodes[i].name)


def test_names_get_a_seeded_permutation_prefix_and_rows_keep_their_order() -> None:
    renamed = fgd_cluster(SPECS, 42)
    assert [n.name.split("-", 1)[1] for n in renamed] == [n.name for n in SPECS]
    prefixes = sorted(int(n.name.split("-", 1)[0]) for n in renamed)
    assert prefixes == list(range(len(SPECS)))
    assert renamed == fgd_cluster(SPECS, 42)
    assert [n.cpu_milli for n in renamed] == [n.cpu_milli for n in SPECS]
    firsts = {_tie_order(fgd_cluster(SPECS, seed))[0] for seed in range(30)}
    assert len(firsts) > 2  # the order differs from seed to seed


def test_wide_clusters_keep_the_prefixes_sortable() -> None:
    nodes = [NodeSpec(f"n{i}", 1000, 1000, 1, "G") for i in range(10_500)]
    renamed = fgd_cluster(nodes, 1)
    assert {len(n.name.split("-", 1)[0]) for n in renamed} == {5}


@pytest.mark.parametrize("policy", ["packing", "clustering", "firstfit"])
@pytest.mark.parametrize("seed", [0, 42])
def test_cpu_only_pods_fill_nodes_in_the_renamed_order(policy: str, seed: int) -> None:
    """Packing and clustering score CPU-only pods 0 everywhere (the simulator's MinNodeScore)
    and first-fit scores nothing: the pods go node after node in the run's random order, not
    to the first plain names."""
    nodes = fgd_cluster(SPECS, seed)
    st = ClusterState.from_nodes(nodes)
    chosen = make_policy(policy)
    seen: list[int] = []
    for _ in range(24):
        pl = chosen.choose(st, CPU_POD)
        if pl is None:
            break
        st.allocate(pl)
        if not seen or seen[-1] != pl.node:
            seen.append(pl.node)
    assert seen == _tie_order(nodes)


def test_scores_still_win_over_the_tie_order() -> None:
    """The order only breaks ties: a sharing pod still joins the GPU that already shares."""
    for seed in range(10):
        nodes = fgd_cluster(SPECS, seed)
        st = ClusterState.from_nodes(nodes)
        used = _tie_order(nodes)[-1]  # last in the tie order
        st.allocate(NodeChoice.for_pod(used, (0,), PodDemand(1_000, 0, 1, 500)))
        pl = make_policy("packing").choose(st, PodDemand(1_000, 0, 1, 300))
        assert pl is not None and pl.node == used and pl.gpus == (0,)
