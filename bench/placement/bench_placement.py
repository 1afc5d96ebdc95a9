"""Benchmark: every placement policy on the default Alibaba trace, FGD protocol, seeds 42-51.

Usage (from the repository root):

    uv run python bench/placement/bench_placement.py [--seeds 42-51] [--jobs 2] [--json]
        [--variants]

Prints the protocol table (allocation at arrival 90/95/100/110/130 %, the published value at
100 % for the baselines, unallocated GPUs, fragmentation, rejections, decision time). With
``--variants`` it also replays FGD and xpupool (told the workload, and learning it online as the
scheduler does) on each generated workload variant.
"""

from __future__ import annotations

import sys

from xpupool.placement.replay_cli import main as replay_main
from xpupool.placement.variants import VARIANTS


def main(argv: list[str]) -> int:
    """Run the benchmark; extra arguments are passed to ``xpupool replay``."""
    variants = "--variants" in argv
    rest = [a for a in argv if a != "--variants"]
    rc = replay_main(["--policy", "all", *rest])
    if variants:
        for name in VARIANTS:
            print(f"\n== variant {name}")
            rc = max(
                rc,
                replay_main(["--policy", "fgd,xpupool,xpupool-online", "--variant", name, *rest]),
            )
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
