"""The constrained workload variants: built the way the published constrained lists are.

On the real trace (skipped when absent) and on a small hand-made fleet: the share of GPU pods
constrained, constraints concentrated on minority models, demand on the largest minority above
its capacity at 33 %, multi-model sets, determinism per seed, every constraint hostable.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest

from xpupool.placement.state import MILLI, ClusterState, NodeSpec, PodDemand
from xpupool.replay.trace import TracePod, load_nodes, load_pods
from xpupool.replay.variants import (
    CONSTRAINED_FRACTIONS,
    constrained,
    constraint_catalogue,
    make_variant,
)


@pytest.fixture(scope="module")
def full_trace(trace_dir) -> tuple[list[NodeSpec], list[TracePod]]:
    """The whole node list and default pod list (the ratios need the real fleet)."""
    return (
        load_nodes(trace_dir / "openb_node_list_gpu_node.csv"),
        load_pods(trace_dir / "openb_pod_list_default.csv"),
    )


def _gpus_by_model(nodes: Sequence[NodeSpec]) -> Counter[str]:
    out: Counter[str] = Counter()
    for n in nodes:
        out[n.model] += n.num_gpu
    return out


def _demand_by_set(pods: Sequence[TracePod]) -> dict[frozenset[str], float]:
    """Constrained GPU request (in GPUs) per constraint set."""
    out: dict[frozenset[str], float] = {}
    for p in pods:
        models = p.demand.allowed_models
        if models:
            out[models] = out.get(models, 0.0) + p.demand.gpu_request_milli / MILLI
    return out


@pytest.mark.parametrize("variant", sorted(CONSTRAINED_FRACTIONS))
def test_fraction_and_hostable(variant: str, full_trace) -> None:
    """Exactly the variant's share of GPU pods is constrained; each to a set a node can host."""
    nodes, pods = full_trace
    out = make_variant(variant, pods, 0, nodes)
    gpu = [p.demand for p in out if p.demand.num_gpu]
    con = [d for d in gpu if d.allowed_models]
    assert len(con) == round(CONSTRAINED_FRACTIONS[variant] * len(gpu))
    assert not any(p.demand.allowed_models for p in out if p.demand.is_cpu_only)
    # Shapes and order are untouched: only the constraint changes.
    assert [(d.cpu_milli, d.num_gpu, d.gpu_milli) for d in (p.demand for p in out)] == [
        (d.cpu_milli, d.num_gpu, d.gpu_milli) for d in (p.demand for p in pods)
    ]
    state = ClusterState.from_nodes(nodes)
    for d in con:
        assert state.feasible(d).any(), d


def test_concentrated_on_minority_models(full_trace) -> None:
    """Minority models get far more constrained demand per GPU than the majority model."""
    nodes, pods = full_trace
    cap = _gpus_by_model(nodes)
    majority = max(cap, key=lambda m: cap[m])
    demand = _demand_by_set(make_variant("constrained33", pods, 0, nodes))
    single = {next(iter(s)): v for s, v in demand.items() if len(s) == 1}
    per_gpu = {m: v / cap[m] for m, v in single.items()}
    minority = max(per_gpu, key=lambda m: per_gpu[m])
    assert minority != majority
    assert per_gpu[minority] > 5 * per_gpu[majority]
    # The majority model, 70 % of the GPUs, carries well under half the constrained demand.
    assert single[majority] < 0.3 * sum(demand.values())
    # Multi-model sets exist and carry a real share.
    multi = sum(v for s, v in demand.items() if len(s) > 1)
    assert 0.08 < multi / sum(demand.values()) < 0.35


def test_largest_minority_over_capacity(full_trace) -> None:
    """At 33 % the largest minority model alone is asked for more than it holds (as T4 is)."""
    nodes, pods = full_trace
    cap = _gpus_by_model(nodes)
    largest_minority = sorted(cap, key=lambda m: -cap[m])[1]
    for seed in (0, 1, 2):
        demand = _demand_by_set(make_variant("constrained33", pods, seed, nodes))
        assert demand.get(frozenset({largest_minority}), 0.0) > cap[largest_minority]
    # ... and the ratio grows with the constrained share, as in the published lists.
    ratios = [
        _demand_by_set(make_variant(v, pods, 0, nodes))[frozenset({largest_minority})]
        / cap[largest_minority]
        for v in ("constrained10", "constrained20", "constrained25", "constrained33")
    ]
    assert ratios == sorted(ratios)
    assert 0.2 < ratios[0] < 0.5


def test_deterministic_per_seed(small_nodes, small_pods) -> None:
    """Same seed, same variant; another seed, other constraints."""
    a = make_variant("constrained25", small_pods, 3, small_nodes)
    b = make_variant("constrained25", small_pods, 3, small_nodes)
    c = make_variant("constrained25", small_pods, 4, small_nodes)
    assert [p.demand for p in a] == [p.demand for p in b]
    assert [p.demand for p in a] != [p.demand for p in c]


def test_roles_on_a_generic_fleet() -> None:
    """The catalogue is built from roles, so it works on any fleet (names carry no meaning)."""
    nodes = (
        [NodeSpec(f"a{i:03d}", 96_000, 512_000, 8, "big") for i in range(20)]  # 160 GPUs
        + [NodeSpec(f"b{i:03d}", 64_000, 256_000, 2, "mid") for i in range(20)]  # 40
        + [NodeSpec(f"c{i:03d}", 16_000, 64_000, 2, "s1") for i in range(5)]  # 10
        + [NodeSpec(f"d{i:03d}", 32_000, 128_000, 4, "s2") for i in range(3)]  # 12
        + [NodeSpec(f"e{i:03d}", 32_000, 128_000, 4, "s3") for i in range(4)]  # 16
        + [NodeSpec("f000", 32_000, 128_000, 1, "tiny")]
    )
    cat = dict(constraint_catalogue(nodes))
    assert max(cat, key=lambda s: cat[s]) == frozenset({"mid"})
    assert frozenset({"s1", "s2"}) in cat and frozenset({"s1", "s2", "s3"}) in cat
    assert frozenset({"tiny"}) not in cat
    assert sum(cat.values()) == pytest.approx(1.0, abs=0.01)
    pods = [
        TracePod(PodDemand(4_000, 8_000, 1, 500 if i % 2 else 1000, name=f"p{i}"))
        for i in range(300)
    ] + [TracePod(PodDemand(60_000, 100_000, 8, 1000, name=f"q{i}")) for i in range(20)]
    out = constrained(pods, np.random.default_rng(0), nodes, 0.5)
    state = ClusterState.from_nodes(nodes)
    con = [p.demand for p in out if p.demand.allowed_models]
    assert len(con) == 160
    for d in con:
        assert state.feasible(d).any()
    # 8-GPU pods can only be pinned to sets holding the 8-GPU model.
    assert all("big" in d.allowed_models for d in con if d.num_gpu == 8)  # type: ignore[operator]
