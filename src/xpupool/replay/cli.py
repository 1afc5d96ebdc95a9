"""``xpupool replay``: replay the Alibaba GPU trace against placement policies.

Default (FGD protocol): per seed, shuffle the pod list, inflate it to 1.3x the cluster's GPU
capacity, place arrivals one by one, drop what does not fit, and report allocation and
fragmentation at fixed arrival points. ``--dynamic`` replays creation/deletion times instead.
"""

from __future__ import annotations

import argparse
import csv
import importlib
import json
import math
import multiprocessing
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Final, TextIO

import numpy as np

from xpupool.placement.frag import ShapeDistribution
from xpupool.placement.policies import PolicyContext
from xpupool.placement.registry import BASELINES, DEFAULT_POLICY, POLICIES, make_policy
from xpupool.placement.state import MILLI, NodeSpec, PodDemand
from xpupool.replay.arrivals import (
    ALLOC_POINTS,
    FRAG_POINTS,
    POD_KINDS,
    DynamicResult,
    PolicySummary,
    RecordedPolicy,
    RunResult,
    build_fgd_workload,
    fgd_cluster,
    replay_arrivals,
    replay_dynamic,
    summarize,
    trace_name,
)
from xpupool.replay.live import main_live
from xpupool.replay.scheduler_default import decide_arrivals
from xpupool.replay.trace import TracePod, find_trace_dir, load_nodes, load_pods
from xpupool.replay.variants import VARIANTS, make_variant

NODE_FILE = "openb_node_list_gpu_node.csv"
POD_FILE = "openb_pod_list_default.csv"

#: Allocation % at 100 % arrival published with the FGD artifact (default trace, 10 seeds).
PUBLISHED_AT_100 = {
    "random": 86.30,
    "dotprod": 90.62,
    "clustering": 91.65,
    "packing": 91.78,
    "bestfit": 92.86,
    "fgd": 95.23,
}


def parse_seeds(text: str) -> list[int]:
    """``42-51`` or ``42,45,50`` (or a mix) to a list of ints."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            a, b = int(lo), int(hi)
            if b < a:
                raise argparse.ArgumentTypeError(f"empty seed range {part!r}")
            out.extend(range(a, b + 1))
        else:
            out.append(int(part))
    if not out:
        raise argparse.ArgumentTypeError("no seeds")
    return out


#: ``--policy default``: the scheduler's own default placement exactly as the service wires it
#: (the domain's ``decide`` with the registry a cycle builds, one object learning from the
#: requests it decides; ``scheduler_default``), scored by the replay. Static protocol only.
SCHEDULER_DEFAULT: Final = "default"


def parse_policies(text: str) -> list[str]:
    """Comma-separated policy names; ``all`` = every registered policy (the baselines,
    ``xpupool-static`` told the workload, and ``xpupool-online``, the placement the scheduler's
    default makes, learning it); ``default`` = the scheduler's default itself (see
    ``SCHEDULER_DEFAULT``)."""
    names: list[str] = []
    for part in text.split(","):
        key = part.strip().lower()
        if not key:
            continue
        if key == "all":
            names.extend([*BASELINES, *POLICIES])
        elif key in POLICIES or key == SCHEDULER_DEFAULT:
            names.append(key)
        else:
            raise argparse.ArgumentTypeError(
                f"unknown policy {part!r}; known: {', '.join(POLICIES)}, all, {SCHEDULER_DEFAULT}"
            )
    return list(dict.fromkeys(names))


def build_parser() -> argparse.ArgumentParser:
    """Argument parser of the replay command."""
    p = argparse.ArgumentParser(prog="xpupool replay", description=__doc__)
    p.add_argument("--nodes", type=Path, help=f"node list CSV (default: trace dir/{NODE_FILE})")
    p.add_argument("--pods", type=Path, help=f"pod list CSV (default: trace dir/{POD_FILE})")
    p.add_argument(
        "--policy",
        type=parse_policies,
        default=[DEFAULT_POLICY],
        help=f"policy name(s), comma-separated, or 'all' (known: {', '.join(POLICIES)}), or "
        f"'{SCHEDULER_DEFAULT}': the scheduler's default as the service wires it",
    )
    p.add_argument("--seeds", type=parse_seeds, default=list(range(42, 52)), help="e.g. 42-51")
    p.add_argument("--ratio", type=float, default=1.3, help="inflation target (x GPU capacity)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--placements", type=Path, help="write one CSV row per placed pod here")
    p.add_argument("--variant", choices=VARIANTS, help="replay a variant sampled from --pods")
    p.add_argument("--variant-seed", type=int, default=0, help="seed of the variant sampler")
    p.add_argument("--dynamic", action="store_true", help="replay creation/deletion times")
    p.add_argument("--plot", type=Path, help="with --dynamic: utilisation plot (needs matplotlib)")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="processes")
    p.add_argument(
        "--live",
        action="store_true",
        help="drive the arrival sequence through the running services (embedded NATS and Redis "
        "unless XPUPOOL_NATS_URL/XPUPOOL_REDIS_URL are set) and compare with the in-process run",
    )
    return p


@dataclass
class _Task:
    nodes: list[NodeSpec]
    pods: list[PodDemand]
    typical: ShapeDistribution
    policy: str
    seed: int
    ratio: float
    record: bool


def _run_task(task: _Task) -> RunResult:
    nodes = fgd_cluster(task.nodes, task.seed)
    capacity = sum(n.num_gpu for n in nodes) * MILLI
    workload = build_fgd_workload(task.pods, task.seed, capacity, task.ratio)
    ctx = PolicyContext(
        rng=np.random.default_rng(task.seed), workload=task.pods, typical=task.typical
    )
    if task.policy == SCHEDULER_DEFAULT:
        outcomes, seconds = decide_arrivals(nodes, workload)
        scored = replay_arrivals(
            nodes,
            workload,
            RecordedPolicy(SCHEDULER_DEFAULT, outcomes),
            task.typical,
            seed=task.seed,
            record_placements=task.record,
        )
        # The time is the scheduler's (decide per pod), not the recording's.
        return replace(scored, decision_ns=(np.asarray(seconds) * 1e9).astype(np.int64))
    policy = make_policy(task.policy, ctx)
    return replay_arrivals(
        nodes, workload, policy, task.typical, seed=task.seed, record_placements=task.record
    )


def _resolve_inputs(args: argparse.Namespace) -> tuple[Path, Path]:
    nodes, pods = args.nodes, args.pods
    if nodes is None or pods is None:
        trace = find_trace_dir(Path.cwd())
        if trace is None:
            raise FileNotFoundError(
                "trace not found: looked for shared/traces/alibaba-gpu-v2023/ beside every "
                "parent of the current directory; pass --nodes and --pods"
            )
        nodes = nodes or trace / NODE_FILE
        pods = pods or trace / POD_FILE
    for path in (nodes, pods):
        if not path.is_file():
            raise FileNotFoundError(f"no such file: {path}")
    return nodes, pods


def _progress(done: int, total: int, start: float, stream: TextIO) -> None:
    if stream.isatty():
        stream.write(f"\r  {done}/{total} runs, {time.monotonic() - start:.0f}s")
        stream.flush()
        if done == total:
            stream.write("\n")


def run_static(
    nodes: list[NodeSpec],
    pods: list[PodDemand],
    policies: Sequence[str],
    seeds: Sequence[int],
    ratio: float = 1.3,
    jobs: int = 1,
    record: bool = False,
    progress: TextIO | None = None,
) -> dict[str, list[RunResult]]:
    """Run every (policy, seed) of the FGD protocol, in ``jobs`` processes."""
    typical = ShapeDistribution.typical(pods)
    tasks = [_Task(nodes, pods, typical, p, s, ratio, record) for p in policies for s in seeds]
    results: dict[str, list[RunResult]] = {p: [] for p in policies}
    start = time.monotonic()
    if jobs > 1 and len(tasks) > 1:
        with multiprocessing.get_context().Pool(min(jobs, len(tasks))) as pool:
            for i, res in enumerate(pool.imap(_run_task, tasks), 1):
                results[res.policy].append(res)
                if progress is not None:
                    _progress(i, len(tasks), start, progress)
    else:
        for i, task in enumerate(tasks, 1):
            res = _run_task(task)
            results[res.policy].append(res)
            if progress is not None:
                _progress(i, len(tasks), start, progress)
    return results


def _fmt(v: float, digits: int = 2) -> str:
    return "-" if math.isnan(v) else f"{v:.{digits}f}"


def format_table(summaries: Sequence[PolicySummary], published: bool) -> str:
    """Human-readable table of the summaries."""
    head = ["policy"] + [f"@{p}" for p in ALLOC_POINTS]
    head[3] = "@100 mean+-sd"
    if published:
        head.append("published@100")
    head += ["unalloc GPUs@100"] + [f"frag@{p}" for p in FRAG_POINTS]
    head += ["lag>=1pt@", "rejected cpu/share/one/multi", "p50 us", "p99 us"]
    rows = [head]
    for s in summaries:
        row = [s.policy]
        for p in ALLOC_POINTS:
            st = s.alloc[p]
            row.append(f"{_fmt(st.mean)} +- {_fmt(st.sd)}" if p == 100 else _fmt(st.mean))
        if published:
            pub = PUBLISHED_AT_100.get(s.policy)
            row.append(f"{pub:.2f}" if pub is not None else "")
        row.append(_fmt(s.unallocated_gpus_100.mean, 0))
        row += [_fmt(s.frag[p].median) for p in FRAG_POINTS]
        row.append(str(s.first_lag_1pt) if s.first_lag_1pt is not None else "-")
        row.append("/".join(_fmt(s.rejected[k], 0) for k in POD_KINDS))
        row += [_fmt(s.decision_p50_us, 0), _fmt(s.decision_p99_us, 0)]
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [
        "  ".join(
            c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in rows
    ]
    lines.insert(1, "-" * len(lines[0]))
    note = (
        "alloc = GPU allocation % at arrival X % (mean over seeds); frag = fragmentation amount "
        "% of cluster GPU (median); decision time per pod."
    )
    return "\n".join([*lines, note])


def write_placements(path: Path, results: dict[str, list[RunResult]]) -> int:
    """CSV ``seed,policy,pod,node,gpus,gpu_milli`` (GPU indices joined by '-'; ``node`` is the
    trace's name, without the protocol's renaming prefix)."""
    count = 0
    with path.open("w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["seed", "policy", "pod", "node", "gpus", "gpu_milli"])
        for runs in results.values():
            for r in runs:
                for rec in r.placements:
                    w.writerow(
                        [
                            r.seed,
                            r.policy,
                            rec.pod,
                            trace_name(rec.node),
                            "-".join(map(str, rec.gpus)),
                            rec.gpu_milli,
                        ]
                    )
                    count += 1
    return count


def _plot(path: Path, results: Sequence[DynamicResult]) -> str | None:
    try:
        # Optional dependency: imported dynamically so the library never requires it.
        matplotlib = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        plt = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        return "--plot needs matplotlib, which is not installed (pip install matplotlib)"
    fig, ax = plt.subplots(figsize=(10, 4))
    for r in results:
        ax.step(r.util_time / 86400.0, r.util_gpu_pct, where="post", label=r.policy, lw=0.8)
    ax.set_xlabel("trace time (days)")
    ax.set_ylabel("GPU allocated (%)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        nodes_path, pods_path = _resolve_inputs(args)
        nodes = load_nodes(nodes_path)
        trace_pods: list[TracePod] = load_pods(pods_path)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        print(f"xpupool replay: {exc}", file=sys.stderr)
        return 2
    label = pods_path.name
    if args.variant:
        trace_pods = make_variant(args.variant, trace_pods, args.variant_seed, nodes)
        label = f"{label} -> {args.variant} (seed {args.variant_seed})"
    policies: list[str] = args.policy
    progress = sys.stderr if sys.stderr.isatty() else None
    if SCHEDULER_DEFAULT in policies and (args.dynamic or args.live):
        print(
            f"xpupool replay: --policy {SCHEDULER_DEFAULT} replays the static protocol only; "
            "live, the scheduler runs its default as xpupool-online",
            file=sys.stderr,
        )
        return 2
    if args.dynamic:
        return _main_dynamic(args, nodes, trace_pods, policies, label)
    if args.live:
        return main_live(nodes, trace_pods, policies, args.seeds, args.ratio, args.json)
    pods = [p.demand for p in trace_pods]
    results = run_static(
        nodes,
        pods,
        policies,
        args.seeds,
        args.ratio,
        args.jobs,
        args.placements is not None,
        progress,
    )
    total_gpus = sum(n.num_gpu for n in nodes)
    summaries = [summarize(results[p], total_gpus) for p in policies]
    if args.placements is not None:
        write_placements(args.placements, results)
    if args.json:
        out = {
            "trace": label,
            "nodes": len(nodes),
            "gpus": total_gpus,
            "seeds": args.seeds,
            "policies": [s.as_dict() for s in summaries],
        }
        print(json.dumps(out, indent=2, allow_nan=True))
    else:
        published = pods_path.name == POD_FILE and not args.variant
        print(f"trace: {label}; {len(nodes)} nodes, {total_gpus} GPUs; seeds {args.seeds}")
        print(format_table(summaries, published))
    return 0


def _main_dynamic(
    args: argparse.Namespace,
    nodes: list[NodeSpec],
    pods: list[TracePod],
    policies: Sequence[str],
    label: str,
) -> int:
    plain = [p.demand for p in pods]
    typical = ShapeDistribution.typical(plain)
    results: list[DynamicResult] = []
    for name in policies:
        ctx = PolicyContext(
            rng=np.random.default_rng(args.seeds[0]), workload=plain, typical=typical
        )
        cluster = fgd_cluster(nodes, args.seeds[0])
        results.append(replay_dynamic(cluster, pods, make_policy(name, ctx)))
    summaries = [r.as_dict() for r in results]
    message = _plot(args.plot, results) if args.plot is not None else None
    if args.json:
        print(json.dumps({"trace": label, "mode": "dynamic", "policies": summaries}, indent=2))
    else:
        print(f"trace: {label}; dynamic replay (creation/deletion times, FIFO wait queue)")
        print(
            f"{'policy':<12} {'placed':>7} {'never':>6} {'waited':>7} {'wait p50 s':>11} "
            f"{'wait p99 s':>11} {'util % (time-wtd)':>18} {'peak %':>7} {'p99 us':>7}"
        )
        for s in summaries:
            w = s["wait_s"]
            d = s["decision_us"]
            assert isinstance(w, dict) and isinstance(d, dict)
            print(
                f"{s['policy']!s:<12} {s['placed']!s:>7} {s['never_placed']!s:>6} "
                f"{s['waited']!s:>7} {w['p50']:>11.0f} {w['p99']:>11.0f} "
                f"{s['gpu_util_pct_time_weighted']:>18.2f} {s['gpu_util_pct_peak']:>7.2f} "
                f"{d['p99']:>7.0f}"
            )
    if message is not None:
        print(f"xpupool replay: {message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
