"""Lone decisions on a kept pool, one after another, as the scheduler makes them for serial
arrivals (``place_on_arrival`` on its kept copy).

Each request is decided alone (``decide_batch`` of one, with the scheduler's registry: the
learned default policy and the trace policies), its reservation never put in the pool
(``apply_last=False``, as the scheduler's ``_decide`` has it), and then the ledger's effect
arrives as a refresh would bring it: the grant as a lease, and the previous job's lease ended.
So each decision follows a node or two that changed, as in the end-to-end bench's serial run.
Reports the p50 / mean / p90 of the decision after a warm-up, and the first decision's time
(what a scheduler's first arrival after a start waits for). ``--dump PATH`` writes every
decision, one per line, for comparing two versions of the placement code decision by decision.
``--warm`` warms the default policy before the first decision and after each release, untimed,
as an idle scheduler's reads do (``DefaultPolicy.warm``). ``--fill F`` first holds that share
of the devices with leases the same decisions placed (never released): a pool as busy as a
production one, filled the way the scheduler fills it, cheapest classes first, so that those
classes are full when the timed decisions try them.

``--mix trace`` decides the Alibaba GPU trace's own pods (``openb_pod_list_default.csv``,
shuffled, each turned into a request as the live replay does: whole GPUs, gangs on one node,
compute shares, model constraints and CPU-only pods, in 91 shapes) on the trace's 1,213 nodes
(``--devices`` does not apply), 30 % of their devices held as in the synthetic pools. With
``--warm`` the report also gives what the warming took (``warm=``: its p50 per release, work
an idle scheduler does off the arrivals' path).

    uv run python services/scheduler/bench/bench_serial_decide.py [--devices 10000]
        [--jobs 3000] [--mix e2e|mixed|share|trace] [--dump PATH] [--fill F] [--warm]
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The pools and request mixes of the batch bench beside this one.
bd = importlib.import_module("bench_decide")

import numpy as np  # noqa: E402

from xpupool.placement.default import DefaultPolicy  # noqa: E402
from xpupool.placement.online import DEFAULT_REBUILD_EVERY  # noqa: E402
from xpupool.placement.policies import NodeGroups  # noqa: E402
from xpupool.replay.requests import job_request  # noqa: E402
from xpupool.replay.scheduler_default import trace_snapshot  # noqa: E402
from xpupool.replay.trace import find_trace_dir, load_nodes, load_pods  # noqa: E402
from xpupool.scheduler.domain import (  # noqa: E402
    LeaseSlice,
    LeaseState,
    NodeState,
    PendingRequest,
    Preempt,
    Reserve,
    WorkingPool,
    decide_batch,
    default_config,
)
from xpupool.scheduler.main import trace_policies  # noqa: E402
from xpupool.scheduler.settings import SchedulerSettings  # noqa: E402

WARM_UP = 200
TRACE_MIX = "trace"


def _trace_mix(rng: random.Random) -> tuple[list[NodeState], Callable[[int], list[PendingRequest]]]:
    """The trace's GPU nodes, and its pods as requests in a shuffled order (cycling)."""
    trace = find_trace_dir(Path(__file__).resolve())
    if trace is None:
        raise SystemExit("--mix trace: no ../shared/traces/alibaba-gpu-v2023 beside the repository")
    nodes = [n for n in load_nodes(trace / "openb_node_list_gpu_node.csv") if n.num_gpu]
    pods = [p.demand for p in load_pods(trace / "openb_pod_list_default.csv")]
    rng.shuffle(pods)
    turn = itertools.count()

    def requests(n: int) -> list[PendingRequest]:
        return [
            PendingRequest(job_request(f"j{i}", pods[i % len(pods)]), bd.NOW)
            for i in itertools.islice(turn, n)
        ]

    return list(trace_snapshot(nodes).nodes), requests


def _mix(
    mix: str, devices: int, rng: random.Random
) -> tuple[list[NodeState], Callable[[int], list[PendingRequest]]]:
    """The pool's nodes (before any is held) and the mix's requests, ``n`` at a time."""
    if mix == TRACE_MIX:
        return _trace_mix(rng)
    return bd.synthetic_nodes(devices, rng), lambda n: list(bd.MIXES[mix](n, rng))


def run(
    devices: int,
    jobs: int,
    mix: str,
    dump: Path | None,
    fill: float = 0.0,
    warm: bool = False,
    rebuild_every: int = DEFAULT_REBUILD_EVERY,
) -> str:
    rng = random.Random(1)
    config = default_config()
    nodes, requests = _mix(mix, devices, rng)
    pool = WorkingPool(bd.occupy(nodes, 0.3, rng), config)
    settings = SchedulerSettings()
    extra = trace_policies(settings)
    default = DefaultPolicy.create(half_life=settings.placement_shape_half_life)
    default.online.rebuild_every = rebuild_every

    def decide(item: PendingRequest) -> tuple[str, list[Reserve]]:
        """One lone decision, its reservation never put in or taken back out (as the
        scheduler's ``_decide`` and ``SnapshotCache.deciding`` do): what it decided, and the
        reservations to hold."""
        registry = default.cycle_registry(config.placement, extra)
        out = decide_batch(
            [PendingRequest(item.request, bd.NOW)],
            pool,
            config,
            history=None,
            policies=registry,
            apply_last=False,
        )
        # A preemption is held as what it becomes: its victims gone (ended here, as the ledger
        # ends them; the lone decision was not applied) and the job on the slices it reserved.
        reserved: list[Reserve] = []
        for _, d in out:
            if isinstance(d, Preempt):
                pool.release_many(d.victims)
                reserved.append(d.reserve)
            elif isinstance(d, Reserve):
                reserved.append(d)
        return repr(out), reserved

    def hold(decision: Reserve, lease_id: str) -> None:
        slices = tuple(
            LeaseSlice(s.device_id, s.memory_mib, s.compute_pct, s.whole) for s in decision.slices
        )
        pool.add_lease(
            LeaseState(
                lease_id=lease_id,
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

    filled = _fill(pool, fill, requests, decide, hold)
    if warm:
        # As a starting scheduler's first idle read does, before any arrival: untimed.
        default.warm(pool)
    live: list[str] = []
    seconds: list[float] = []
    warming: list[float] = []
    decisions: list[str] = []
    for i, item in enumerate(requests(jobs)):
        started = time.perf_counter()
        decided, reserved = decide(item)
        seconds.append(time.perf_counter() - started)
        decisions.append(decided)
        for decision in reserved:
            hold(decision, f"lease-{i}")
            live.append(f"lease-{i}")
        if len(live) > 1:
            pool.release(live.pop(0))
        if warm:
            # The scheduler's idle read after a release warms the policy (``keep_warm``),
            # off the next arrival's path: not in the decisions' times.
            started = time.perf_counter()
            default.warm(pool)
            warming.append(time.perf_counter() - started)
    if dump is not None:
        dump.write_text("\n".join(decisions) + "\n")
    # How many states the pool's nodes are in at the end (``NodeGroups``): what a refresh of
    # many rows scores (``GROUPED_REFRESH_ROWS``), against every node. (Counted after the timed
    # decisions: building the policy's view before them would take it off the first one.)
    state = default.view(pool).state
    groups = len(np.unique(NodeGroups().group_ids(state)))
    shape = f" nodes={state.num_nodes} groups={groups}"
    if rebuild_every != DEFAULT_REBUILD_EVERY:
        shape += f" rebuild_every={rebuild_every}"
    timed = sorted(seconds[WARM_UP:])
    warmed = ""
    if warm:
        warmed = (
            f" warmed (warm={1e3 * sorted(warming[WARM_UP:])[len(warming[WARM_UP:]) // 2]:.3f}ms)"
        )
    return (
        f"{mix:<6} devices={devices:>6}{shape}{filled}{warmed} "
        f"p50={1e3 * timed[len(timed) // 2]:.3f}ms "
        f"mean={1e3 * statistics.mean(timed):.3f}ms p90={1e3 * timed[int(0.9 * len(timed))]:.3f}ms "
        f"first={1e3 * seconds[0]:.1f}ms"
    )


def _fill(
    pool: WorkingPool,
    share: float,
    requests: Callable[[int], list[PendingRequest]],
    decide: Callable[[PendingRequest], tuple[str, list[Reserve]]],
    hold: Callable[[Reserve, str], None],
) -> str:
    """Hold ``share`` of the devices with leases placed by the same decisions, never released:
    a pool as busy as a production one, filled the way the scheduler fills it (the cheapest
    classes first), not at random."""
    if share <= 0:
        return ""
    held = sum(1 for i in range(len(pool.devices)) if pool.dev_holders[i] or pool.dev_exclusive[i])
    n = 0
    misses = 0
    while held < share * len(pool.devices) and misses < 100:
        for item in requests(100):
            _, reserved = decide(item)
            misses = 0 if reserved else misses + 1
            for decision in reserved:
                hold(decision, f"occupant-{n}")
                n += 1
        held = sum(
            1 for i in range(len(pool.devices)) if pool.dev_holders[i] or pool.dev_exclusive[i]
        )
    return f" held={held / len(pool.devices):.0%} by {n} more leases"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=10_000)
    parser.add_argument("--jobs", type=int, default=3_000)
    parser.add_argument("--mix", choices=[*sorted(bd.MIXES), TRACE_MIX], default="e2e")
    parser.add_argument("--dump", type=Path, default=None)
    parser.add_argument(
        "--fill",
        type=float,
        default=0.0,
        help="first hold this share of the devices with leases the same decisions placed",
    )
    parser.add_argument(
        "--warm",
        action="store_true",
        help="warm the default policy after each release, untimed, as an idle scheduler's read "
        "does (DefaultPolicy.warm): the decisions must be the same (--dump), only faster",
    )
    parser.add_argument(
        "--rebuild-every",
        type=int,
        default=DEFAULT_REBUILD_EVERY,
        help="requests between two rebuilds of the learned target (the scheduler's: "
        f"{DEFAULT_REBUILD_EVERY}); a large value shows what the rebuilds cost a lone decision",
    )
    args = parser.parse_args()
    jobs = max(args.jobs, WARM_UP + 1)
    print(run(args.devices, jobs, args.mix, args.dump, args.fill, args.warm, args.rebuild_every))


if __name__ == "__main__":
    main()
