"""Benchmark: every placement policy on the default Alibaba trace and on every generated workload
variant, FGD protocol, seeds 42-51.

Usage (from the repository root):

    uv run python bench/placement/bench_placement.py [--seeds 42-51] [--jobs 2]
        [--variant-seed 0] [--traces default,constrained33] [--policies fgd,xpupool-online]
        [--protocol] [--json]

Prints one table: GPU allocation % at 100 % arrival (mean +- sd over the seeds) per policy
(rows) and workload (columns: the default trace, then every variant of
``xpupool.replay.variants.VARIANTS``, the constrained ones included), then the decision time
per pod of each policy (p50 / p99 over all pods of all seeds) and, for the scheduler's default
(``xpupool-online``), its margin over FGD, BestFit and first-fit on each workload. With
``--protocol`` it first prints the full protocol table of the default trace (allocation at
90-130 %, the published values, fragmentation, rejections) as ``xpupool replay`` does.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from xpupool.placement import POLICIES, PolicyContext, ShapeDistribution, make_policy
from xpupool.placement.state import MILLI, NodeSpec, PodDemand
from xpupool.replay.arrivals import build_fgd_workload, fgd_cluster, replay_arrivals
from xpupool.replay.trace import find_trace_dir, load_nodes, load_pods
from xpupool.replay.variants import VARIANTS, make_variant

#: The scheduler's default and the policies it is held against in the margin table.
DEFAULT = "xpupool-online"
RIVALS = ("fgd", "bestfit", "firstfit")


@dataclass(frozen=True)
class Task:
    """One replay: a workload (by name), a policy, a seed."""

    trace: str
    policy: str
    seed: int
    nodes: list[NodeSpec]
    pods: list[PodDemand]


@dataclass(frozen=True)
class Outcome:
    """Allocation at 100 % arrival and the decision times of one replay."""

    trace: str
    policy: str
    seed: int
    alloc_100: float
    decision_ns: list[int]


def run(task: Task) -> Outcome:
    """Replay ``task`` under the FGD protocol (fragmentation against the typical shapes)."""
    typical = ShapeDistribution.typical(task.pods)
    nodes = fgd_cluster(task.nodes, task.seed)
    capacity = sum(n.num_gpu for n in nodes) * MILLI
    workload = build_fgd_workload(task.pods, task.seed, capacity)
    ctx = PolicyContext(rng=np.random.default_rng(task.seed), workload=task.pods, typical=typical)
    res = replay_arrivals(nodes, workload, make_policy(task.policy, ctx), typical, task.seed)
    return Outcome(task.trace, task.policy, task.seed, res.alloc_at(100), res.decision_ns.tolist())


def _seeds(text: str) -> list[int]:
    first, _, last = text.partition("-")
    return list(range(int(first), int(last or first) + 1))


def _stats(values: Sequence[float]) -> tuple[float, float]:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return statistics.mean(values), sd


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [
        "  ".join(
            c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in [head, *rows]
    ]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Run the benchmark and print the tables."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seeds", default="42-51", help="e.g. 42-51")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--variant-seed", type=int, default=0)
    parser.add_argument("--traces", default=",".join(("default", *VARIANTS)))
    parser.add_argument("--policies", default=",".join(POLICIES))
    parser.add_argument("--protocol", action="store_true", help="full table of the default trace")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    args = parser.parse_args(argv)
    trace_dir = find_trace_dir(Path(__file__).resolve())
    if trace_dir is None:
        raise SystemExit("trace not found: expected ../shared/traces/alibaba-gpu-v2023")
    if args.protocol:
        from xpupool.replay.cli import main as replay_main

        replay_main(["--policy", "all", "--seeds", args.seeds, "--jobs", str(args.jobs)])
        print()
    nodes = load_nodes(trace_dir / "openb_node_list_gpu_node.csv")
    original = load_pods(trace_dir / "openb_pod_list_default.csv")
    traces = [t.strip() for t in args.traces.split(",") if t.strip()]
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    seeds = _seeds(args.seeds)
    workloads = {
        t: [
            p.demand
            for p in (
                original if t == "default" else make_variant(t, original, args.variant_seed, nodes)
            )
        ]
        for t in traces
    }
    tasks = [Task(t, p, s, nodes, workloads[t]) for t in traces for p in policies for s in seeds]
    # Slowest first, so that the last minutes are not one process running alone.
    tasks.sort(key=lambda k: k.policy.startswith("xpupool"), reverse=True)
    results: dict[tuple[str, str], list[Outcome]] = {}
    with multiprocessing.get_context().Pool(max(1, args.jobs)) as pool:
        for done, out in enumerate(pool.imap_unordered(run, tasks), 1):
            results.setdefault((out.trace, out.policy), []).append(out)
            if sys.stderr.isatty():
                sys.stderr.write(f"\r  {done}/{len(tasks)} runs")
    if sys.stderr.isatty():
        sys.stderr.write("\n")
    alloc = {k: _stats([o.alloc_100 for o in v]) for k, v in results.items()}
    times = {
        k: np.percentile(np.concatenate([o.decision_ns for o in v]) / 1e6, [50, 99])
        for k, v in results.items()
    }
    if args.json:
        print(
            json.dumps(
                {
                    "seeds": seeds,
                    "variant_seed": args.variant_seed,
                    "alloc_100": {f"{t}/{p}": alloc[(t, p)] for t, p in alloc},
                    "decision_ms_p50_p99": {f"{t}/{p}": list(times[(t, p)]) for t, p in times},
                },
                indent=2,
            )
        )
        return 0
    print(
        f"GPU allocation % at 100 % arrival, mean +- sd over seeds {seeds[0]}-{seeds[-1]} "
        f"({len(nodes)} nodes; variants sampled with seed {args.variant_seed})"
    )
    cells = {k: f"{m:.2f} +- {sd:.2f}" for k, (m, sd) in alloc.items()}
    print(_table(["policy", *traces], [[p, *(cells[(t, p)] for t in traces)] for p in policies]))
    print("\ndecision time per pod, p50 / p99 ms (all pods of all seeds)")
    cells = {k: f"{v[0]:.2f} / {v[1]:.2f}" for k, v in times.items()}
    print(_table(["policy", *traces], [[p, *(cells[(t, p)] for t in traces)] for p in policies]))
    rivals = [r for r in RIVALS if r in policies]
    if DEFAULT in policies and rivals:
        print(f"\n{DEFAULT} minus each rival (points of allocation at 100 %)")
        rows = [
            [r, *(f"{alloc[(t, DEFAULT)][0] - alloc[(t, r)][0]:+.2f}" for t in traces)]
            for r in rivals
        ]
        print(_table(["rival", *traces], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
