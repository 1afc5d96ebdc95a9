"""Workload variants sampled from a pod list, to check that a policy generalises.

The trace's README says the published variant lists were sampled from the default list to
emphasise a workload type (CPU-only, GPU-sharing, multi-GPU) and that ~33 % of GPU tasks carry
GPU-model constraints in production. These generators do the same from any list, with a seed:

* ``sharing-heavy``: 80 % of GPU pods are sharing pods (default list: ~44 %);
* ``multigpu-heavy``: multi-GPU pods carry 50 % of the GPU request (default: ~7 %);
* ``cpu-only-heavy``: the GPU pods are kept, CPU-only pods are resampled to 2.5x their count;
* ``gpuspec33``: 33 % of GPU pods get a model constraint (one or two models that have a node
  able to host the pod; the first drawn in proportion to that model's GPU count).

All variants keep the original total GPU request (except ``cpu-only-heavy``, which only adds
CPU-only pods), so the replay's 1.3x inflation means the same thing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Final

import numpy as np

from xpupool.placement.state import NodeSpec, PodDemand
from xpupool.placement.trace import TracePod

VARIANTS: Final = ("sharing-heavy", "multigpu-heavy", "cpu-only-heavy", "gpuspec33")


def _renamed(pods: Sequence[TracePod], prefix: str) -> list[TracePod]:
    return [
        replace(p, demand=replace(p.demand, name=f"{prefix}-{i:05d}")) for i, p in enumerate(pods)
    ]


def _draw(pool: Sequence[TracePod], rng: np.random.Generator, n: int) -> list[TracePod]:
    if n <= 0 or not pool:
        return []
    return [pool[int(i)] for i in rng.integers(len(pool), size=n)]


def _fill_request(
    pool: Sequence[TracePod], rng: np.random.Generator, target_milli: float
) -> list[TracePod]:
    out: list[TracePod] = []
    total = 0
    if not pool or not any(p.demand.gpu_request_milli for p in pool):
        return out
    while total < target_milli:
        p = pool[int(rng.integers(len(pool)))]
        out.append(p)
        total += p.demand.gpu_request_milli
    return out


def sharing_heavy(pods: Sequence[TracePod], rng: np.random.Generator) -> list[TracePod]:
    """GPU pods resampled so that 80 % of them are sharing pods."""
    cpu = [p for p in pods if p.demand.is_cpu_only]
    share = [p for p in pods if p.demand.is_sharing]
    whole = [p for p in pods if p.demand.num_gpu and not p.demand.is_sharing]
    if not share or not whole:
        return list(pods)
    total = sum(p.demand.gpu_request_milli for p in pods)
    # n_share = 4 n_whole (80 % of GPU pods) at the original total GPU request.
    avg_share = np.mean([p.demand.gpu_request_milli for p in share])
    avg_whole = np.mean([p.demand.gpu_request_milli for p in whole])
    n_whole = round(total / (4 * avg_share + avg_whole))
    return cpu + _draw(share, rng, 4 * n_whole) + _draw(whole, rng, n_whole)


def multigpu_heavy(pods: Sequence[TracePod], rng: np.random.Generator) -> list[TracePod]:
    """Multi-GPU pods resampled to carry half of the GPU request."""
    cpu = [p for p in pods if p.demand.is_cpu_only]
    multi = [p for p in pods if p.demand.num_gpu > 1]
    single = [p for p in pods if p.demand.num_gpu == 1]
    total = sum(p.demand.gpu_request_milli for p in pods)
    picked = _fill_request(multi, rng, 0.5 * total)
    rest = total - sum(p.demand.gpu_request_milli for p in picked)
    return cpu + picked + _fill_request(single, rng, rest)


def cpu_only_heavy(pods: Sequence[TracePod], rng: np.random.Generator) -> list[TracePod]:
    """All GPU pods kept; CPU-only pods resampled to 2.5x their count."""
    cpu = [p for p in pods if p.demand.is_cpu_only]
    gpu = [p for p in pods if not p.demand.is_cpu_only]
    return gpu + _draw(cpu, rng, round(2.5 * len(cpu)))


def gpuspec(
    pods: Sequence[TracePod],
    rng: np.random.Generator,
    nodes: Sequence[NodeSpec],
    fraction: float = 0.33,
) -> list[TracePod]:
    """A ``fraction`` of GPU pods constrained to one or two GPU models that can host them."""
    out: list[TracePod] = []
    for p in pods:
        d = p.demand
        if d.num_gpu == 0 or d.allowed_models or rng.random() >= fraction:
            out.append(p)
            continue
        gpus_by_model: dict[str, int] = {}
        for n in nodes:
            if n.model and _node_fits(n, d):
                gpus_by_model[n.model] = gpus_by_model.get(n.model, 0) + n.num_gpu
        if not gpus_by_model:
            out.append(p)
            continue
        models = sorted(gpus_by_model)
        weights = np.array([gpus_by_model[m] for m in models], dtype=np.float64)
        first = models[int(rng.choice(len(models), p=weights / weights.sum()))]
        chosen = {first}
        others = [m for m in models if m != first]
        if others and rng.random() < 0.5:
            chosen.add(others[int(rng.integers(len(others)))])
        out.append(replace(p, demand=replace(d, allowed_models=frozenset(chosen))))
    return out


def _node_fits(node: NodeSpec, pod: PodDemand) -> bool:
    return (
        node.num_gpu >= pod.num_gpu
        and node.cpu_milli >= pod.cpu_milli
        and node.memory_mib >= pod.memory_mib
    )


def make_variant(
    name: str, pods: Sequence[TracePod], seed: int, nodes: Sequence[NodeSpec] = ()
) -> list[TracePod]:
    """Variant ``name`` of ``pods`` (see module docstring); pods get fresh unique names."""
    rng = np.random.default_rng(seed)
    builders: dict[str, Callable[[], list[TracePod]]] = {
        "sharing-heavy": lambda: sharing_heavy(pods, rng),
        "multigpu-heavy": lambda: multigpu_heavy(pods, rng),
        "cpu-only-heavy": lambda: cpu_only_heavy(pods, rng),
        "gpuspec33": lambda: gpuspec(pods, rng, nodes),
    }
    if name not in builders:
        raise KeyError(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")
    if name == "gpuspec33" and not nodes:
        raise ValueError("gpuspec33 needs the node list")
    return _renamed(builders[name](), f"openb-pod-{name}")
