"""Lone decisions on a kept pool, one after another, as the scheduler makes them for serial
arrivals (``place_on_arrival`` on its kept copy).

Each request is decided alone (``decide_batch`` of one, with the scheduler's registry: the
learned default policy and the trace policies), its reservation is taken back out as
``SnapshotCache.deciding`` does, and then the ledger's effect arrives as a refresh would bring
it: the grant as a lease, and the previous job's lease ended. So each decision follows a node or
two that changed, as in the end-to-end bench's serial run. Reports the p50 / mean / p90 of the
decision after a warm-up. ``--dump PATH`` writes every decision, one per line, for comparing
two versions of the placement code decision by decision.

    uv run python services/scheduler/bench/bench_serial_decide.py [--devices 10000]
        [--jobs 3000] [--mix e2e|mixed|share] [--dump PATH]
"""

from __future__ import annotations

import argparse
import importlib
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The pools and request mixes of the batch bench beside this one.
bd = importlib.import_module("bench_decide")

from xpupool.placement.default import DefaultPolicy  # noqa: E402
from xpupool.scheduler.domain import (  # noqa: E402
    LeaseSlice,
    LeaseState,
    PendingRequest,
    Reserve,
    WorkingPool,
    decide_batch,
    default_config,
)
from xpupool.scheduler.main import trace_policies  # noqa: E402
from xpupool.scheduler.settings import SchedulerSettings  # noqa: E402

WARM_UP = 200


def run(devices: int, jobs: int, mix: str, dump: Path | None) -> str:
    rng = random.Random(1)
    config = default_config()
    pool = WorkingPool(bd.occupy(bd.synthetic_nodes(devices, rng), 0.3, rng), config)
    settings = SchedulerSettings()
    extra = trace_policies(settings)
    default = DefaultPolicy.create(half_life=settings.placement_shape_half_life)
    live: list[str] = []
    seconds: list[float] = []
    decisions: list[str] = []
    for i, item in enumerate(bd.MIXES[mix](jobs, rng)):
        started = time.perf_counter()
        registry = default.cycle_registry(config.placement, extra)
        out = decide_batch(
            [PendingRequest(item.request, bd.NOW)], pool, config, history=None, policies=registry
        )
        reserved = [d for _, d in out if isinstance(d, Reserve)]
        for decision in reserved:
            pool.release(f"reservation:{decision.job_id}")
        seconds.append(time.perf_counter() - started)
        decisions.append(repr(out))
        for decision in reserved:
            slices = tuple(
                LeaseSlice(s.device_id, s.memory_mib, s.compute_pct, s.whole)
                for s in decision.slices
            )
            pool.add_lease(
                LeaseState(
                    lease_id=f"lease-{i}",
                    job_id=decision.job_id,
                    tenant=decision.tenant,
                    queue=decision.queue,
                    priority=decision.priority,
                    started_at_s=bd.NOW,
                    slices=slices,
                    capacity_units=decision.capacity_units,
                    host=decision.host,
                )
            )
            live.append(f"lease-{i}")
        if len(live) > 1:
            pool.release(live.pop(0))
    if dump is not None:
        dump.write_text("\n".join(decisions) + "\n")
    timed = sorted(seconds[WARM_UP:])
    return (
        f"{mix:<6} devices={devices:>6} p50={1e3 * timed[len(timed) // 2]:.3f}ms "
        f"mean={1e3 * statistics.mean(timed):.3f}ms p90={1e3 * timed[int(0.9 * len(timed))]:.3f}ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=10_000)
    parser.add_argument("--jobs", type=int, default=3_000)
    parser.add_argument("--mix", choices=sorted(bd.MIXES), default="e2e")
    parser.add_argument("--dump", type=Path, default=None)
    args = parser.parse_args()
    print(run(args.devices, max(args.jobs, WARM_UP + 1), args.mix, args.dump))


if __name__ == "__main__":
    main()
