"""How the scheduler's own default placement does on the Alibaba trace, beside FGD on the very
same arrivals.

The scheduler side is ``xpupool.replay.scheduler_default.decide_arrivals``: the domain's
``decide`` with the registry the service builds, the learned default ``xpupool``
(``xpupool.placement.default``: intent tiers, then fragmentation against the request
shapes it has seen; it is told nothing about the trace). Every pod of the FGD-protocol sequence,
CPU-only ones included (host-only requests, ``count: 0``), is turned into a job request and
decided against a working pool of the trace's 1,213 nodes, one decision per call as a cycle with
one new request makes it.

The decisions are then scored by the replay's own code (``replay_arrivals`` with the recorded
outcomes), which re-validates every placement, so both columns are measured identically.
Decision time is per ``decide`` call, including the per-cycle set-up a one-request cycle pays.

Run: ``just bench-scheduler-trace [--seeds 42-44]``.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import numpy as np

from xpupool.placement import PolicyContext, ShapeDistribution, make_policy
from xpupool.replay.arrivals import (
    RecordedPolicy,
    RunResult,
    build_fgd_workload,
    fgd_cluster,
    replay_arrivals,
)
from xpupool.replay.scheduler_default import decide_arrivals
from xpupool.replay.trace import find_trace_dir, load_nodes, load_pods

POINTS = (90, 95, 100, 110, 130)


def _row(name: str, runs: list[RunResult]) -> str:
    cells = []
    for pct in POINTS:
        values = [r.alloc_at(pct) for r in runs]
        sd = statistics.stdev(values) if len(values) > 1 else 0.0
        cells.append(f"{statistics.mean(values):6.2f}" + (f" +- {sd:.2f}" if pct == 100 else ""))
    return f"{name:<20}" + "  ".join(cells)


def main() -> None:
    """Print the scheduler default vs FGD at every arrival point, per seed and on average."""
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
    ours: list[RunResult] = []
    fgd: list[RunResult] = []
    all_times: list[float] = []
    plain_nodes = nodes
    for seed in range(int(first), int(last or first) + 1):
        nodes = fgd_cluster(plain_nodes, seed)
        workload = build_fgd_workload(original, seed, capacity)
        ctx = PolicyContext(rng=np.random.default_rng(seed), workload=original, typical=typical)
        reference = replay_arrivals(nodes, workload, make_policy("fgd", ctx), typical, seed=seed)
        outcomes, times = decide_arrivals(nodes, workload)
        scored = replay_arrivals(
            nodes, workload, RecordedPolicy("xpupool", outcomes), typical, seed=seed
        )
        ours.append(scored)
        fgd.append(reference)
        all_times.extend(times)
        ms = np.percentile(np.array(times) * 1000, [50, 99])
        print(
            f"seed {seed}: scheduler default {scored.alloc_at(100):.2f} % "
            f"(decide p50 {ms[0]:.2f} ms, p99 {ms[1]:.2f} ms), FGD {reference.alloc_at(100):.2f} %",
            flush=True,
        )
    print(f"\nGPU allocation % at arrival {', '.join(f'{p} %' for p in POINTS)} (mean over seeds)")
    print(_row("scheduler default", ours))
    print(_row("FGD", fgd))
    ms = np.percentile(np.array(all_times) * 1000, [50, 99])
    print(f"decide() per pod: p50 {ms[0]:.2f} ms, p99 {ms[1]:.2f} ms over {len(all_times)} pods")


if __name__ == "__main__":
    main()
