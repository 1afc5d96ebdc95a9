"""Workload variants sampled from a pod list, to check that a policy generalises.

The trace's README says the published variant lists were sampled from the default list to
emphasise a workload type (CPU-only, GPU-sharing, multi-GPU) and that ~33 % of GPU tasks carry
GPU-model constraints in production. These generators do the same from any list, with a seed:

* ``sharing-heavy``: 80 % of GPU pods are sharing pods (default list: ~44 %);
* ``multigpu-heavy``: multi-GPU pods carry 50 % of the GPU request (default: ~7 %);
* ``cpu-only-heavy``: the GPU pods are kept, CPU-only pods are resampled to 2.5x their count;
* ``gpuspec33``: 33 % of GPU pods get a model constraint (one or two models that have a node
  able to host the pod; the first drawn in proportion to that model's GPU count). Proportional
  draws hide what production constraints do, hence:
* ``constrained10/20/25/33``: 10/20/25/33 % of GPU pods constrained the way the published
  constrained lists are (see "Constrained variants" below).

All variants keep the original total GPU request (except ``cpu-only-heavy``, which only adds
CPU-only pods), so the replay's 1.3x inflation means the same thing.

Constrained variants
--------------------
Measured on the published lists ``openb_pod_list_gpuspec{05,10,20,25,33}.csv`` of
alibaba/clusterdata (cluster-trace-gpu-v2023; the data is not part of this repository). Fleet:
6,212 GPUs = G2 4,392 (70.7 %), T4 842 (13.6 %), G3 312 (5.0 %), P100 265 (4.3 %), V100M32 204
(3.3 %), V100M16 195 (3.1 %), A10 2.

* Every list has the default list's 8,152 pods with the same shapes and names; only
  ``gpu_spec`` differs, never on CPU-only pods. Constrained share of the 7,064 GPU pods: 5.2,
  10.4, 20.4, 24.9, 33.8 %; of their GPU request: 5.6, 10.9, 20.4, 25.9, 34.8 %. The lists are
  independent draws (gpuspec10's constrained pods are not a subset of gpuspec20's).
* By kind (gpuspec33): 28.7 % of sharing pods, 37.7 % of 1-GPU pods and 37.3 % of multi-GPU pods
  are constrained, i.e. 0.85x / 1.12x / 1.10x the overall rate; other lists alike.
* Set sizes (gpuspec33, 2,388 constrained pods): 1 model 84.2 %, 2 models 6.3 %, 3 5.4 %,
  4 1.4 %, 5+ 2.8 %. Share of the constrained GPU request by set: T4 48.6 %, G2 18.2 %,
  V100M16|V100M32 8.5 % (including a ``V100M16|V100M32|V100M32`` spelling), P100 7.4 %, G3 6.1 %,
  P100|V100M16|V100M32 5.1 %, V100M32 1.0 %, V100M16 0.1 %, sets of 4+ models (all but G3, or
  all but G2) 4.9 %, others < 1 %. The other lists have the same mix (T4 singletons 45-49 %).
* Demand against capacity, i.e. constrained GPU request / GPUs of the set (gpuspec 10/20/25/33):
  T4 alone 0.33 / 0.68 / 0.86 / **1.22**; P100 alone 0.22 / 0.45 / 0.47 / 0.59; G3 alone
  0.05 / 0.19 / 0.32 / 0.41; V100M16|V100M32 0.14 / 0.24 / 0.32 / 0.37; G2 alone 0.04 / 0.05 /
  0.07 / 0.09. Demand *naming* V100M16 (any set containing it) is 2.0x its capacity at 33 %.
  So constraints land on the minority models, above all the largest one (T4), which at 33 % is
  asked for more than it holds (before the replay's 1.3x inflation); the majority model (G2)
  is hardly ever named alone.
* Shapes: T4 singletons are 1-GPU pods only (54 % whole, 46 % sharing; T4 nodes have 2 or 4
  GPUs), P100 singletons are sharing pods (278 of 279; P100 nodes have 8-64 CPUs), G2 and G3
  singletons take the multi-GPU pods (8-GPU nodes). Every constrained pod but one names a model
  with a node able to host it.

The generator (:func:`constrained`) follows that construction on any node list, by the models'
roles rather than their names: the *majority* model (most GPUs), the *largest minority* (second
most), the *small minorities* (the others with >= 1 % of the GPUs) and tiny pools (< 1 %, named
only inside broad sets). The catalogue of sets and their share of constrained demand is the
measured mix: largest minority alone 48.6 %, majority alone 18.2 %, each small minority alone
14.6 % split in proportion to their GPUs, the two smallest minorities together 8.5 % and the
three smallest 5.1 % (on the trace: V100M16|V100M32 and P100|V100M16|V100M32), all models but
the majority 2.1 % and all models but one small minority 2.8 %. Pods are picked without
replacement, GPU pods only, with the measured per-kind rates, and each gets a set drawn among
those that contain a model with a node able to host it (sets are drawn in proportion to their
share divided by the pod's GPU request, so that the *demand* follows the mix, not the count).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Final

import numpy as np

from xpupool.placement.state import MILLI, NodeSpec, PodDemand
from xpupool.replay.trace import TracePod

#: Constrained variants and the share of GPU pods each constrains.
CONSTRAINED_FRACTIONS: Final = {
    "constrained10": 0.10,
    "constrained20": 0.20,
    "constrained25": 0.25,
    "constrained33": 0.33,
}

VARIANTS: Final = (
    "sharing-heavy",
    "multigpu-heavy",
    "cpu-only-heavy",
    "gpuspec33",
    *CONSTRAINED_FRACTIONS,
)

#: Share of the constrained GPU request by role of the set (measured, gpuspec33; see above).
SHARE_LARGEST_MINORITY: Final = 0.486
SHARE_MAJORITY: Final = 0.182
SHARE_SMALL_MINORITIES: Final = 0.146
SHARE_TWO_SMALLEST: Final = 0.085
SHARE_THREE_SMALLEST: Final = 0.051
SHARE_ALL_BUT_MAJORITY: Final = 0.021
SHARE_ALL_BUT_ONE_SMALL: Final = 0.028
#: Constraint rate of sharing / whole-GPU pods relative to all GPU pods (measured, gpuspec33).
RATE_SHARING: Final = 0.85
RATE_WHOLE: Final = 1.11
#: Models with less than this share of the GPUs are named only inside broad sets.
TINY_POOL: Final = 0.01


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


def constraint_catalogue(nodes: Sequence[NodeSpec]) -> list[tuple[frozenset[str], float]]:
    """The constraint sets of the measured mix for this fleet, with their demand shares.

    Roles come from the GPU count of each model (see the module docstring); a set that two roles
    produce (small fleets) adds up its shares, and an empty role drops its share.
    """
    gpus: dict[str, int] = {}
    for n in nodes:
        if n.model and n.num_gpu:
            gpus[n.model] = gpus.get(n.model, 0) + n.num_gpu
    if not gpus:
        return []
    total = sum(gpus.values())
    ranked = sorted(gpus, key=lambda m: (-gpus[m], m))
    every = frozenset(gpus)
    named = [m for m in ranked if gpus[m] >= TINY_POOL * total] or ranked[:1]
    majority = named[0]
    out: dict[frozenset[str], float] = {}

    def add(models: frozenset[str], share: float) -> None:
        if models and share > 0:
            out[models] = out.get(models, 0.0) + share

    add(frozenset({majority}), SHARE_MAJORITY)
    if len(named) > 1:
        add(frozenset({named[1]}), SHARE_LARGEST_MINORITY)
    small = sorted(named[2:], key=lambda m: (gpus[m], m))
    small_gpus = sum(gpus[m] for m in small)
    for m in small:
        add(frozenset({m}), SHARE_SMALL_MINORITIES * gpus[m] / small_gpus)
    if len(small) >= 2:
        add(frozenset(small[:2]), SHARE_TWO_SMALLEST)
    if len(small) >= 3:
        add(frozenset(small[:3]), SHARE_THREE_SMALLEST)
    if len(every) > 1:
        add(every - {majority}, SHARE_ALL_BUT_MAJORITY)
    for m in small:
        add(every - {m}, SHARE_ALL_BUT_ONE_SMALL / len(small))
    return sorted(out.items(), key=lambda kv: (-kv[1], sorted(kv[0])))


def constrained(
    pods: Sequence[TracePod],
    rng: np.random.Generator,
    nodes: Sequence[NodeSpec],
    fraction: float,
) -> list[TracePod]:
    """``fraction`` of the GPU pods constrained the production way (see the module docstring).

    Pods already constrained are kept as they are and count towards the fraction.
    """
    if not 0 <= fraction <= 1:
        raise ValueError("fraction must be in [0, 1]")
    catalogue = constraint_catalogue(nodes)
    hosts_cache: dict[tuple[int, int, int], frozenset[str]] = {}

    def hosts(d: PodDemand) -> frozenset[str]:
        key = (d.cpu_milli, d.memory_mib, d.num_gpu)
        got = hosts_cache.get(key)
        if got is None:
            got = frozenset(n.model for n in nodes if n.model and _node_fits(n, d))
            hosts_cache[key] = got
        return got

    gpu_idx = [i for i, p in enumerate(pods) if p.demand.num_gpu]
    target = round(fraction * len(gpu_idx)) - sum(
        1 for i in gpu_idx if pods[i].demand.allowed_models
    )
    free = [
        i
        for i in gpu_idx
        if not pods[i].demand.allowed_models
        and any(models & hosts(pods[i].demand) for models, _ in catalogue)
    ]
    out = list(pods)
    if target <= 0 or not free:
        return out
    rate = np.array(
        [RATE_SHARING if pods[i].demand.is_sharing else RATE_WHOLE for i in free],
        dtype=np.float64,
    )
    picked = rng.choice(len(free), size=min(target, len(free)), replace=False, p=rate / rate.sum())
    for k in np.sort(picked):
        i = free[int(k)]
        d = pods[i].demand
        ok = hosts(d)
        sets = [models for models, _ in catalogue if models & ok]
        weights = np.array([w for models, w in catalogue if models & ok], dtype=np.float64)
        weights /= d.gpu_request_milli / MILLI
        models = sets[int(rng.choice(len(sets), p=weights / weights.sum()))]
        out[i] = replace(pods[i], demand=replace(d, allowed_models=models))
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
    if name in CONSTRAINED_FRACTIONS:
        fraction = CONSTRAINED_FRACTIONS[name]
        builders[name] = lambda: constrained(pods, rng, nodes, fraction)
    if name not in builders:
        raise KeyError(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")
    if (name == "gpuspec33" or name in CONSTRAINED_FRACTIONS) and not nodes:
        raise ValueError(f"{name} needs the node list")
    return _renamed(builders[name](), f"openb-pod-{name}")
