"""An open-loop phase's latency second by second: a tail that is queueing or one that is stalls.

``python bench/e2e/timeline.py DIR [--bin-s S]`` reads what ``bench_e2e.py --latencies DIR``
wrote (each open phase's jobs: submit wall time and seconds to the grant, and the phase's AOF
rewrites) and prints, for each phase and each ``S`` seconds of submits, the jobs' p50, p90, p99
and slowest grant, marking the bins an AOF rewrite overlapped and the slowest of each kind of
event Redis's latency monitor logged in them (``aof-fsync-always``: an fsync of the AOF;
``command``, ``fast-command``: a command or script; ``fork``: the rewrite's), at 1 ms and
above. A tail made of queueing shows as a median that climbs with the rate everywhere; a stall,
as a few bins whose slowest jobs stand far above their neighbours'.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping, Sequence
from pathlib import Path


def _at(ordered: Sequence[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timeline(
    granted: Sequence[tuple[float, float]],
    rewrites: Sequence[tuple[float, float]],
    bin_s: float = 1.0,
    redis_events: Mapping[str, Sequence[tuple[int, int]]] | None = None,
) -> list[str]:
    """One line per ``bin_s`` of submits: p50, p90, p99 and max in ms, an AOF mark, and the
    slowest Redis latency event of each kind in the bin (``redis_events``: the kind's samples,
    each a second of the wall clock and its slowest event in ms, as ``LATENCY HISTORY`` gives
    them)."""
    if not granted:
        return ["no jobs"]
    start = min(wall for wall, _ in granted)
    bins: dict[int, list[float]] = {}
    for wall, latency in granted:
        bins.setdefault(int((wall - start) / bin_s), []).append(latency)
    lines = []
    for index in sorted(bins):
        ordered = sorted(bins[index])
        lo, hi = start + index * bin_s, start + (index + 1) * bin_s
        rewrite = any(a < hi and b > lo for a, b in rewrites)
        slowest = {
            kind: max(ms for at, ms in samples if lo - 1 < at < hi)
            for kind, samples in sorted((redis_events or {}).items())
            if any(lo - 1 < at < hi for at, _ in samples)
        }
        lines.append(
            f"{index * bin_s:7.1f} s  {len(ordered):5d} jobs  p50 {1000 * _at(ordered, 0.5):7.1f}"
            f"  p90 {1000 * _at(ordered, 0.9):7.1f}  p99 {1000 * _at(ordered, 0.99):7.1f}"
            f"  max {1000 * ordered[-1]:7.1f} ms{'  AOF rewrite' if rewrite else ''}"
            + "".join(f"  {kind} {ms} ms" for kind, ms in slowest.items())
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directory", type=Path, help="what bench_e2e.py --latencies wrote")
    parser.add_argument("--bin-s", type=float, default=1.0, help="seconds of submits per line")
    args = parser.parse_args(argv)
    phases = sorted(args.directory.glob("*-open-*.json"))
    if not phases:
        raise SystemExit(f"no *-open-*.json in {args.directory}")
    for path in phases:
        phase = json.loads(path.read_bytes())
        granted = [(float(wall), float(latency)) for wall, latency in phase["granted"]]
        rewrites = [(float(a), float(b)) for a, b in phase["aof_rewrites"]]
        events = {
            kind: [(int(at), int(ms)) for at, ms in samples]
            for kind, samples in phase.get("redis_latency_events", {}).items()
        }
        print(f"== {path.stem}")
        print("\n".join(timeline(granted, rewrites, args.bin_s, events)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
