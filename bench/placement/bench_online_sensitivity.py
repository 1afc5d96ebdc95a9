"""How much the scheduler default's two knobs move its allocation: the learning window
(``half_life``, in requests) and the rebuild period (``rebuild_every``).

Neither is fitted to the trace; this bench shows the allocation at 100 % arrival on the default
trace (FGD protocol) barely moves across a wide range of both. Run:
``just bench-online-sensitivity [--seeds 42-44]``.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from xpupool.placement import ShapeDistribution
from xpupool.placement.online import OnlineFragmentationPolicy
from xpupool.replay.arrivals import build_fgd_workload, fgd_cluster, replay_arrivals
from xpupool.replay.trace import find_trace_dir, load_nodes, load_pods

SETTINGS = ((1_000.0, 256), (5_000.0, 64), (5_000.0, 256), (5_000.0, 1024), (50_000.0, 256))
"""(half_life, rebuild_every) pairs; (5,000, 256) is the default."""


def main() -> None:
    """Print allocation at 100 % arrival per setting and seed."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", default="42-44")
    args = parser.parse_args()
    first, _, last = args.seeds.partition("-")
    seeds = range(int(first), int(last or first) + 1)
    trace = find_trace_dir(Path(__file__).resolve())
    if trace is None:
        raise SystemExit("trace not found: expected ../shared/traces/alibaba-gpu-v2023")
    nodes = load_nodes(trace / "openb_node_list_gpu_node.csv")
    original = [p.demand for p in load_pods(trace / "openb_pod_list_default.csv")]
    typical = ShapeDistribution.typical(original)
    capacity = sum(n.num_gpu for n in nodes) * 1000
    workloads = {seed: build_fgd_workload(original, seed, capacity) for seed in seeds}
    clusters = {seed: fgd_cluster(nodes, seed) for seed in seeds}
    print("half_life  rebuild_every  alloc@100 per seed            mean")
    for half_life, rebuild_every in SETTINGS:
        allocs = [
            replay_arrivals(
                clusters[seed],
                workloads[seed],
                OnlineFragmentationPolicy(half_life, rebuild_every),
                typical,
            ).alloc_at(100)
            for seed in seeds
        ]
        per_seed = " ".join(f"{a:6.2f}" for a in allocs)
        print(
            f"{half_life:9.0f}  {rebuild_every:13d}  {per_seed:28}  {statistics.mean(allocs):6.2f}"
        )


if __name__ == "__main__":
    main()
