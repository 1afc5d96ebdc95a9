"""Property test: on random clusters and pods no policy ever over-allocates."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from xpupool.placement.policies import PolicyContext
from xpupool.placement.registry import POLICIES, make_policy
from xpupool.placement.state import ClusterState, NodeSpec, PodDemand

MODELS = ("A", "B", "C")

nodes_st = st.lists(
    st.builds(
        lambda i, cpu, mem, gpus, model: NodeSpec(f"n{i:03d}", cpu, mem, gpus, model),
        st.integers(0, 999),
        st.integers(0, 64).map(lambda x: x * 1000),
        st.integers(0, 64).map(lambda x: x * 1024),
        st.sampled_from([0, 1, 2, 4, 8]),
        st.sampled_from(MODELS),
    ),
    min_size=1,
    max_size=8,
    unique_by=lambda n: n.name,
)


@st.composite
def pod_st(draw: st.DrawFn) -> PodDemand:
    kind = draw(st.sampled_from(["cpu", "share", "whole"]))
    cpu = draw(st.integers(0, 40)) * 1000
    mem = draw(st.integers(0, 40)) * 1024
    models = draw(st.one_of(st.none(), st.frozensets(st.sampled_from(MODELS), min_size=1)))
    if kind == "cpu":
        return PodDemand(cpu, mem)
    if kind == "share":
        return PodDemand(cpu, mem, 1, draw(st.integers(1, 999)), models)
    return PodDemand(cpu, mem, draw(st.sampled_from([1, 2, 4, 8])), 1000, models)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nodes=nodes_st, pods=st.lists(pod_st(), min_size=1, max_size=25), seed=st.integers(0, 9))
def test_no_policy_over_allocates(nodes: list[NodeSpec], pods: list[PodDemand], seed: int) -> None:
    """Every policy returns only valid placements, places a pod iff one fits, never overdraws."""
    for name in POLICIES:
        state = ClusterState.from_nodes(nodes)
        policy = make_policy(name, PolicyContext(np.random.default_rng(seed), workload=pods))
        for pod in pods:
            feasible_before = bool(state.feasible(pod).any())
            placement = policy.choose(state, pod)
            assert (placement is not None) == feasible_before, name
            if placement is None:
                continue
            assert state.fits(placement, pod), (name, placement, pod)
            if pod.num_gpu:
                assert pod.allowed_models is None or (
                    state.models[state.model_id[placement.node]] in pod.allowed_models
                )
            state.allocate(placement)
            assert (state.cpu_free >= 0).all() and (state.mem_free >= 0).all()
            assert (state.gpu_free >= 0).all() and (state.gpu_free <= 1000).all()
            assert (state.gpu_free[~state.gpu_exists] == 0).all()
