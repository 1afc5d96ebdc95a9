"""How much the scheduler default's knobs move its allocation: the learning window
(``half_life``, in requests), the rebuild period (``rebuild_every``) and the weight of a shape's
GPU request in the learned target (``gpu_weight``: 0 counts each request once, as FGD weighs
shapes; 1 weighs it by 1 + GPUs requested).

None is fitted to the trace. Two tables of allocation at 100 % arrival (FGD protocol): the window
and rebuild period on the default trace, then ``gpu_weight`` on the default trace and each
generated variant (``--traces``, sampled with ``--variant-seed``), with FGD beside it. Run:
``just bench-online-sensitivity [--seeds 42-44] [--traces default,multigpu-heavy]
[--variant-seed 0] [--gpu-weights 0,0.5,1]``.
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing
import os
import statistics
from collections.abc import Sequence
from pathlib import Path

from xpupool.placement import ShapeDistribution
from xpupool.placement.online import (
    DEFAULT_HALF_LIFE,
    DEFAULT_REBUILD_EVERY,
    OnlineFragmentationPolicy,
)
from xpupool.placement.ours import DEFAULT_GPU_WEIGHT
from xpupool.placement.policies import FGDPolicy
from xpupool.placement.state import NodeSpec, PodDemand
from xpupool.replay.arrivals import build_fgd_workload, fgd_cluster, replay_arrivals
from xpupool.replay.trace import find_trace_dir, load_nodes, load_pods
from xpupool.replay.variants import VARIANTS, make_variant

SETTINGS = ((1_000.0, 256), (5_000.0, 64), (5_000.0, 256), (5_000.0, 1024), (50_000.0, 256))
"""(half_life, rebuild_every) pairs; (5,000, 256) is the default."""

Run = tuple[str, int, str, float, float, float]
"""(trace, seed, policy: "fgd" or "online", half_life, rebuild_every, gpu_weight)"""


@functools.cache
def _workload(
    trace: str, variant_seed: int
) -> tuple[list[NodeSpec], list[PodDemand], ShapeDistribution]:
    """A trace's nodes, pods and typical shapes, read and sampled once per worker process."""
    found = find_trace_dir(Path(__file__).resolve())
    if found is None:
        raise SystemExit("trace not found: expected ../shared/traces/alibaba-gpu-v2023")
    nodes = load_nodes(found / "openb_node_list_gpu_node.csv")
    pods = load_pods(found / "openb_pod_list_default.csv")
    if trace != "default":
        pods = make_variant(trace, pods, variant_seed, nodes)
    demands = [p.demand for p in pods]
    return nodes, demands, ShapeDistribution.typical(demands)


def _alloc(run: Run, variant_seed: int) -> float:
    trace, seed, policy, half_life, rebuild_every, gpu_weight = run
    nodes, pods, typical = _workload(trace, variant_seed)
    capacity = sum(n.num_gpu for n in nodes) * 1000
    chosen = (
        FGDPolicy(typical)
        if policy == "fgd"
        else OnlineFragmentationPolicy(half_life, int(rebuild_every), gpu_weight=gpu_weight)
    )
    workload = build_fgd_workload(pods, seed, capacity)
    return replay_arrivals(fgd_cluster(nodes, seed), workload, chosen, typical).alloc_at(100)


def _run_all(runs: Sequence[Run], variant_seed: int, jobs: int) -> dict[Run, float]:
    args = [(run, variant_seed) for run in runs]
    if jobs <= 1:
        return {run: _alloc(*a) for run, a in zip(runs, args, strict=True)}
    with multiprocessing.get_context("spawn").Pool(jobs) as pool:
        return dict(zip(runs, pool.starmap(_alloc, args), strict=True))


def _row(label: str, allocs: Sequence[float]) -> str:
    per_seed = " ".join(f"{a:6.2f}" for a in allocs)
    return f"{label:28} {per_seed}  mean {statistics.mean(allocs):6.2f}"


def main() -> None:
    """Print allocation at 100 % arrival per setting and seed."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", default="42-44")
    parser.add_argument("--traces", default="default,multigpu-heavy,cpu-only-heavy,constrained33")
    parser.add_argument("--variant-seed", type=int, default=0)
    parser.add_argument("--gpu-weights", default="0,0.5,1")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args()
    first, _, last = args.seeds.partition("-")
    seeds = range(int(first), int(last or first) + 1)
    traces = args.traces.split(",")
    unknown = set(traces) - {"default", *VARIANTS}
    if unknown:
        raise SystemExit(f"unknown traces {sorted(unknown)}; known: default, {', '.join(VARIANTS)}")
    weights = [float(w) for w in args.gpu_weights.split(",")]

    window = [
        ("default", s, "online", h, r, DEFAULT_GPU_WEIGHT) for h, r in SETTINGS for s in seeds
    ]
    weighted = [
        (t, s, "online", DEFAULT_HALF_LIFE, DEFAULT_REBUILD_EVERY, w)
        for t in traces
        for w in weights
        for s in seeds
    ]
    baseline = [(t, s, "fgd", 0.0, 0.0, 0.0) for t in traces for s in seeds]
    done = _run_all(window + weighted + baseline, args.variant_seed, args.jobs)

    print(f"default trace, gpu_weight {DEFAULT_GPU_WEIGHT:g}: alloc@100 per seed {list(seeds)}")
    for h, r in SETTINGS:
        allocs = [done[("default", s, "online", h, r, DEFAULT_GPU_WEIGHT)] for s in seeds]
        print(_row(f"half_life {h:7.0f} rebuild {r:4d}", allocs))
    print(f"\ngpu_weight per trace (variant seed {args.variant_seed}), alloc@100 per seed")
    for t in traces:
        print(t)
        print(_row("  fgd", [done[(t, s, "fgd", 0.0, 0.0, 0.0)] for s in seeds]))
        for w in weights:
            allocs = [
                done[(t, s, "online", DEFAULT_HALF_LIFE, DEFAULT_REBUILD_EVERY, w)] for s in seeds
            ]
            print(_row(f"  gpu_weight {w:g}", allocs))


if __name__ == "__main__":
    main()
