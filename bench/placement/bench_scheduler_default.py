"""How the scheduler's own default placement (the domain's ``xpupool`` policy, as the live
scheduler runs it) does on the Alibaba trace, beside FGD on the very same arrivals.

The live request model has no CPU-only requests (``count >= 1``), so both sides replay the GPU
pods of the FGD-protocol sequence only; allocation is read at 100 % arrival like the replay's.
Run: ``uv run python bench/placement/bench_scheduler_default.py [--seeds 42-44]``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from xpupool.placement import NodeSpec, PodDemand, PolicyContext, ShapeDistribution, make_policy
from xpupool.placement.replay import build_fgd_workload, replay_arrivals
from xpupool.placement.requests import job_request
from xpupool.placement.trace import find_trace_dir, load_nodes, load_pods
from xpupool.scheduler.domain import Reserve, WorkingPool, decide, default_config
from xpupool.scheduler.trace_policies import trace_snapshot


def scheduler_default(nodes: list[NodeSpec], workload: list[PodDemand]) -> tuple[float, float]:
    """(allocation % at 100 % arrival, p99 decision ms) of the domain's default policy."""
    capacity = sum(n.num_gpu for n in nodes) * 1000
    config = default_config()
    pool = WorkingPool(trace_snapshot(nodes), config)
    arrived = allocated = 0
    at_100: float | None = None
    times = []
    for i, pod in enumerate(workload):
        started = time.perf_counter()
        decision = decide(job_request(f"j{i}", pod), pool, config, apply=True)
        times.append(time.perf_counter() - started)
        if isinstance(decision, Reserve):
            allocated += pod.gpu_request_milli
        arrived += pod.gpu_request_milli
        if at_100 is None and arrived >= capacity:
            at_100 = 100 * allocated / capacity
    assert pool.violations() == []
    return at_100 or 100 * allocated / capacity, statistics.quantiles(times, n=100)[98] * 1000


def main() -> None:
    """Print, per seed, the scheduler default vs FGD on the GPU pods of the FGD sequence."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", default="42-44")
    args = parser.parse_args()
    first, _, last = args.seeds.partition("-")
    trace = find_trace_dir(Path(__file__).resolve())
    if trace is None:
        raise SystemExit("trace not found: expected ../shared/traces/alibaba-gpu-v2023")
    nodes = load_nodes(trace / "openb_node_list_gpu_node.csv")
    original = [p.demand for p in load_pods(trace / "openb_pod_list_default.csv")]
    typical = ShapeDistribution.typical(original)
    capacity = sum(n.num_gpu for n in nodes) * 1000
    ours, fgd = [], []
    for seed in range(int(first), int(last or first) + 1):
        workload = [p for p in build_fgd_workload(original, seed, capacity) if p.num_gpu]
        ctx = PolicyContext(rng=np.random.default_rng(seed), workload=original, typical=typical)
        reference = replay_arrivals(nodes, workload, make_policy("fgd", ctx), typical)
        alloc, p99 = scheduler_default(nodes, workload)
        ours.append(alloc)
        fgd.append(reference.alloc_at(100))
        print(
            f"seed {seed}: scheduler default {alloc:.2f} % (decision p99 {p99:.1f} ms), "
            f"FGD {reference.alloc_at(100):.2f} %",
            flush=True,
        )
    mean_ours, mean_fgd = statistics.mean(ours), statistics.mean(fgd)
    print(f"mean: scheduler default {mean_ours:.2f} %, FGD {mean_fgd:.2f} %")


if __name__ == "__main__":
    main()
