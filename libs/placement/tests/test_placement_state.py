"""ClusterState, PodDemand and NodeChoice: feasibility and bookkeeping."""

from __future__ import annotations

import numpy as np
import pytest

from xpupool.placement.state import ClusterState, NodeChoice, NodeSpec, PodDemand


def _cluster() -> ClusterState:
    return ClusterState.from_nodes(
        [
            NodeSpec("b-node", 16_000, 64_000, 2, "T4"),
            NodeSpec("a-node", 96_000, 393_216, 8, "G2"),
            NodeSpec("c-cpu", 32_000, 128_000, 0, ""),
        ]
    )


def test_from_nodes_builds_empty_arrays() -> None:
    """A new state has everything free, padded GPU slots at 0 and the name order as ranks."""
    st = _cluster()
    assert st.gpu_capacity_milli == 10_000
    assert st.gpu_used_milli == 0
    assert st.gpu_free[0].tolist() == [1000, 1000, 0, 0, 0, 0, 0, 0]
    assert st.name_rank.tolist() == [1, 0, 2]
    assert st.models == ("", "G2", "T4")


def test_from_records_accepts_ledger_style_mappings() -> None:
    """from_records takes plain dicts with either trace or ledger key names."""
    st = ClusterState.from_records(
        [
            {"name": "n1", "cpu_milli": 8000, "memory_mib": 1000, "num_gpu": 1, "model": "A10"},
            {"sn": "n2", "cpu_milli": "4000", "memory_mib": 10, "gpu": 0, "model": "nan"},
        ]
    )
    assert st.names == ("n1", "n2")
    assert st.num_gpu.tolist() == [1, 0]
    assert st.models == ("", "A10")


def test_feasible_checks_cpu_memory_gpu_and_model() -> None:
    """feasible() rejects nodes short of CPU, memory, GPUs or with the wrong model."""
    st = _cluster()
    assert st.feasible(PodDemand(20_000, 1000, 1, 1000)).tolist() == [False, True, False]
    assert st.feasible(PodDemand(1000, 100_000, 0, 0)).tolist() == [False, True, True]
    assert st.feasible(PodDemand(1000, 1000, 4, 1000)).tolist() == [False, True, False]
    t4 = PodDemand(1000, 1000, 1, 500, frozenset({"T4"}))
    assert st.feasible(t4).tolist() == [True, False, False]


def test_feasible_is_kept_per_shape_and_follows_every_versioned_change() -> None:
    """feasible() keeps its mask per pod shape and refreshes the nodes whose version moved: it
    answers what a fresh state in the same condition answers, and its mask is read-only."""
    st, fresh = _cluster(), _cluster()
    pods = [PodDemand(4000, 2000, 1, 600), PodDemand(1000, 1000, 2, 1000), PodDemand(0, 0, 0, 0)]
    for pod in pods:
        st.feasible(pod)
    with pytest.raises(ValueError):
        st.feasible(pods[0])[1] = False
    choices = [NodeChoice.for_pod(1, (g,), pods[0]) for g in range(8)]
    choices.append(NodeChoice.for_pod(0, (0, 1), pods[1]))
    for choice in choices:
        st.allocate(choice)
        fresh.allocate(choice)
        for pod in pods:
            assert st.feasible(pod).tolist() == _cluster_like(fresh).feasible(pod).tolist()
    # The scheduler's way of writing a node: the arrays, then its version.
    st.cpu_free[1] = 0
    st.node_version[1] += 1
    assert st.feasible(pods[0]).tolist() == [False, False, False]


def _cluster_like(state: ClusterState) -> ClusterState:
    """A state in ``state``'s condition that has never answered ``feasible``."""
    return state.copy()


def test_allocate_and_release_roundtrip() -> None:
    """release() exactly undoes allocate(), including class counters and versions."""
    st = _cluster()
    pod = PodDemand(4000, 2000, 1, 300)
    pl = NodeChoice.for_pod(1, (3,), pod)
    st.allocate(pl)
    assert st.gpu_free[1, 3] == 700 and st.cpu_free[1] == 92_000 and st.mem_free[1] == 391_216
    assert st.class_counts[1, 0] == 1 and st.node_version[1] == 1
    st.release(pl)
    assert st.gpu_free[1, 3] == 1000 and st.cpu_free[1] == 96_000
    assert st.class_counts[1].sum() == 0 and st.node_version[1] == 2


def test_allocate_refuses_over_allocation() -> None:
    """allocate() raises and leaves the state untouched when a resource would go negative."""
    st = _cluster()
    before = st.gpu_free.copy()
    with pytest.raises(ValueError):
        st.allocate(NodeChoice(0, (0,), 600, 17_000, 0))
    st.allocate(NodeChoice(0, (0,), 600, 1000, 0))
    with pytest.raises(ValueError):
        st.allocate(NodeChoice(0, (0,), 600, 1000, 0))
    with pytest.raises(ValueError):
        st.allocate(NodeChoice(0, (5,), 100, 0, 0))
    assert st.gpu_free[0, 0] == 400
    assert (st.gpu_free[1:] == before[1:]).all()


def test_release_refuses_unknown_placement() -> None:
    """release() of something never allocated raises instead of exceeding capacity."""
    st = _cluster()
    with pytest.raises(ValueError):
        st.release(NodeChoice(1, (0,), 500, 0, 0))


def test_pod_demand_validation_and_kind() -> None:
    """PodDemand rejects inconsistent GPU requests and classifies pods for reports."""
    with pytest.raises(ValueError):
        PodDemand(1000, 0, 0, 500)
    with pytest.raises(ValueError):
        PodDemand(1000, 0, 1, 0)
    assert PodDemand(1, 1).kind == "cpu"
    assert PodDemand(1, 1, 1, 200).kind == "share"
    assert PodDemand(1, 1, 1, 1000).kind == "one"
    assert PodDemand(1, 1, 4, 1000).kind == "multi"


def test_best_fit_gpus_picks_tightest_then_lowest_index() -> None:
    """Sharing pods take the tightest GPU that fits; whole-GPU pods the first free ones."""
    st = _cluster()
    st.allocate(NodeChoice(1, (2,), 500, 0, 0))
    st.allocate(NodeChoice(1, (5,), 500, 0, 0))
    st.allocate(NodeChoice(1, (6,), 800, 0, 0))
    assert st.best_fit_gpus(1, PodDemand(0, 0, 1, 300)) == (2,)
    assert st.best_fit_gpus(1, PodDemand(0, 0, 1, 100)) == (6,)
    assert st.best_fit_gpus(1, PodDemand(0, 0, 3, 1000)) == (0, 1, 3)
    assert np.array_equal(st.gpu_free[1, :3], [1000, 1000, 500])
