"""Decision time per request of ``xpupool.scheduler.domain.decide_batch``.

Pools of 100, 1,000 and 10,000 devices (about 5 devices per node, four device classes, 30 % of
capacity already leased) and the 1,213-node / 6,212-GPU cluster of the Alibaba GPU trace v2023
(``shared/traces/alibaba-gpu-v2023/openb_node_list_gpu_node.csv`` when present; once with its own
models, once with G1-G3 mapped to T4 as the live stack's catalog does). Each run decides
1,000 pending requests against one snapshot and reports p50/p99/max of the per-request decision
time, plus the one-off cost of turning the snapshot into a working pool. Two request mixes:

* ``mixed``: mostly whole devices, some shares, multi-device, same-node gangs, a few selectors;
* ``share``: 90 % fractional shares (20-30 % compute, or a few GiB of memory), the case where
  every eligible device of a class is scored;
* ``e2e``: the end-to-end bench's jobs (``bench/e2e/bench_e2e.py``): half 1,000 MiB shares, a
  quarter whole devices, a quarter two-device gangs, a few shapes recurring as a production
  workload's do.

    .venv/bin/python services/scheduler/bench/bench_decide.py [--requests 1000] [--seed 1]
        [--mix mixed|share|e2e|all] [--sizes 100,1000,10000] [--no-trace]
"""

from __future__ import annotations

import argparse
import csv
import importlib
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from xpupool.contracts.payloads import (
    DeviceDemand,
    DeviceSelector,
    GangSpec,
    HostDemand,
    Intent,
    JobRequested,
    Priority,
)
from xpupool.replay.trace import find_trace_dir  # noqa: E402
from xpupool.scheduler.domain import (
    DeviceState,
    LeaseSlice,
    LeaseState,
    NodeState,
    PendingRequest,
    PoolSnapshot,
    WorkingPool,
    decide_batch,
    default_config,
)

decide_mod = importlib.import_module(
    "xpupool.scheduler.domain.decide"
)  # the module, not the function
_TRACE_DIR = find_trace_dir(Path(__file__).resolve())
# The trace lives in ../shared beside the repository; without it the trace pools are skipped.
TRACE = (_TRACE_DIR or Path("missing-trace")) / "openb_node_list_gpu_node.csv"
NOW = 1_000_000.0

# (vendor, memory MiB, capacity units, $/h, capabilities, isolation)
CLASSES: dict[str, tuple[str, int, float, float, frozenset[str], frozenset[str]]] = {
    "T4": ("nvidia", 15360, 0.25, 0.35, frozenset({"fp16"}), frozenset({"hami-core"})),
    "A100": ("nvidia", 81920, 1.0, 3.0, frozenset({"fp16", "bf16"}), frozenset({"hami-core"})),
    "910B": ("ascend", 65536, 0.9, 1.6, frozenset({"fp16", "bf16"}), frozenset({"vnpu"})),
    "MLU370": ("cambricon", 23308, 0.3, 0.6, frozenset({"fp16", "bf16"}), frozenset()),
    # Alibaba trace models (approximate catalog figures).
    "G2": ("nvidia", 16384, 0.5, 1.0, frozenset({"fp16"}), frozenset({"hami-core"})),
    "G3": ("nvidia", 32768, 0.8, 2.0, frozenset({"fp16", "bf16"}), frozenset({"hami-core"})),
    "V100M16": ("nvidia", 16384, 0.4, 1.2, frozenset({"fp16"}), frozenset({"hami-core"})),
    "V100M32": ("nvidia", 32768, 0.4, 1.5, frozenset({"fp16"}), frozenset({"hami-core"})),
    "P100": ("nvidia", 16384, 0.2, 0.6, frozenset({"fp16"}), frozenset()),
    "A10": ("nvidia", 24576, 0.4, 0.9, frozenset({"fp16", "bf16"}), frozenset({"hami-core"})),
}


def make_node(nid: str, model: str, n: int, cpu: int, mem: int, domain: str) -> NodeState:
    vendor, mib, cap, cost, caps, iso = CLASSES[model]
    devs = tuple(
        DeviceState(
            device_id=f"{nid}/{i}",
            node_id=nid,
            vendor=vendor,
            model=model,
            index=i,
            uuid=f"{nid}-{i}",
            memory_total_mib=mib,
            memory_free_mib=mib,
            capacity_units=cap,
            cost_per_hour=cost,
            capabilities=caps,
            isolation=iso,
            domain=domain,
            util_pct=None,
        )
        for i in range(n)
    )
    return NodeState(nid, devs, cpu, cpu, mem, mem)


def synthetic_nodes(n_devices: int, rng: random.Random) -> list[NodeState]:
    nodes: list[NodeState] = []
    total = 0
    while total < n_devices:
        model = rng.choices(["T4", "A100", "910B", "MLU370"], [4, 3, 2, 1])[0]
        n = min(rng.choice([2, 4, 8, 8]), n_devices - total)
        i = len(nodes)
        nodes.append(make_node(f"n{i}", model, n, 64000 * n // 4 or 16000, 512000, f"dom{i // 4}"))
        total += n
    return nodes


def trace_nodes(merge_t4: bool = False) -> list[NodeState]:
    """The trace's GPU nodes; ``merge_t4`` maps G1-G3 to T4 as the catalog-backed live stack
    does, which leaves one class of about 5,500 devices (the live cycle's worst case)."""
    merged = {"G1": "T4", "G2": "T4", "G3": "T4"} if merge_t4 else {}
    out = []
    with TRACE.open() as f:
        for i, row in enumerate(csv.DictReader(f)):
            out.append(
                make_node(
                    row["sn"],
                    merged.get(row["model"], row["model"]),
                    int(row["gpu"]),
                    int(row["cpu_milli"]),
                    int(row["memory_mib"]),
                    f"dom{i // 4}",
                )
            )
    return out


def occupy(nodes: list[NodeState], fraction: float, rng: random.Random) -> PoolSnapshot:
    """Lease about ``fraction`` of the devices (whole or shared) so the pool is not empty."""
    leases = []
    new_nodes = []
    k = 0
    for nd in nodes:
        devs = []
        for d in nd.devices:
            if rng.random() < fraction:
                k += 1
                t = f"t{rng.randrange(8)}"
                if rng.random() < 0.6:
                    d = replace(d, memory_free_mib=0, compute_free_pct=0, exclusive=True, holders=1)
                    sl = LeaseSlice(d.device_id, d.memory_total_mib, 100, True)
                else:
                    mem = d.memory_total_mib // rng.choice([2, 4])
                    d = replace(
                        d, memory_free_mib=d.memory_total_mib - mem, compute_free_pct=50, holders=1
                    )
                    sl = LeaseSlice(d.device_id, mem, 50, False)
                leases.append(
                    LeaseState(
                        lease_id=f"l{k}",
                        job_id=f"old{k}",
                        tenant=t,
                        queue=t,
                        priority=rng.choice([100, 500, 900]),
                        started_at_s=rng.uniform(0, NOW),
                        slices=(sl,),
                    )
                )
            devs.append(d)
        new_nodes.append(replace(nd, devices=tuple(devs)))
    return PoolSnapshot(tuple(new_nodes), tuple(leases), NOW)


def make_requests(n: int, rng: random.Random) -> list[PendingRequest]:
    out = []
    for i in range(n):
        r = rng.random()
        count, dev, gang = 1, DeviceDemand(), None
        if r < 0.45:
            pass
        elif r < 0.75:
            dev = rng.choice(
                [
                    DeviceDemand(memory_mib=rng.choice([2048, 4096, 8192])),
                    DeviceDemand(compute_pct=rng.choice([10, 25, 50])),
                    DeviceDemand(memory_pct=30, compute_pct=30),
                ]
            )
        elif r < 0.9:
            count = rng.choice([2, 3, 4])
        else:
            count, gang = rng.choice([4, 8]), GangSpec(same_node=True)
        sel = DeviceSelector()
        if rng.random() < 0.2:
            sel = DeviceSelector(capabilities=["bf16"])
        out.append(
            PendingRequest(
                JobRequested(
                    job_id=f"j{i}",
                    tenant=f"t{rng.randrange(8)}",
                    count=count,
                    device=dev,
                    selector=sel,
                    gang=gang,
                    intent=rng.choice(list(Intent)),
                    priority=Priority(rng.choice(["low", "normal", "normal", "high"])),
                    host=HostDemand(cpu_milli=rng.choice([0, 2000, 8000])),
                ),
                NOW - rng.uniform(0, 600),
            )
        )
    return out


def make_share_requests(n: int, rng: random.Random) -> list[PendingRequest]:
    """A share-heavy stream: 90 % single fractional slices, the rest whole devices."""
    out = []
    for i in range(n):
        if rng.random() < 0.9:
            dev = rng.choice(
                [
                    DeviceDemand(compute_pct=rng.randint(20, 30)),
                    DeviceDemand(compute_pct=rng.randint(20, 30)),
                    DeviceDemand(memory_mib=rng.choice([2048, 4096, 8192]), compute_pct=20),
                ]
            )
        else:
            dev = DeviceDemand()
        out.append(
            PendingRequest(
                JobRequested(
                    job_id=f"j{i}",
                    tenant=f"t{rng.randrange(8)}",
                    device=dev,
                    intent=rng.choice(list(Intent)),
                    priority=Priority(rng.choice(["low", "normal", "normal", "high"])),
                    host=HostDemand(cpu_milli=rng.choice([0, 1000, 2000])),
                ),
                NOW - rng.uniform(0, 600),
            )
        )
    return out


def make_e2e_requests(n: int, rng: random.Random) -> list[PendingRequest]:
    """The end-to-end bench's job mix (``bench_e2e.job``), in its order."""
    out = []
    for i in range(n):
        kind = i % 4
        count, dev, gang = 1, DeviceDemand(), None
        if kind in (0, 2):
            dev = DeviceDemand(memory_mib=1000)
        elif kind == 3:
            count, gang = 2, GangSpec()
        request = JobRequested(job_id=f"j{i}", tenant="t0", count=count, device=dev, gang=gang)
        out.append(PendingRequest(request, NOW - rng.uniform(0, 600)))
    return out


MIXES = {"mixed": make_requests, "share": make_share_requests, "e2e": make_e2e_requests}


def run(label: str, nodes: list[NodeState], n_requests: int, seed: int, mix: str) -> None:
    rng = random.Random(seed)
    snap = occupy(nodes, 0.3, rng)
    reqs = MIXES[mix](n_requests, rng)
    cfg = default_config()
    t0 = time.perf_counter()
    pool = WorkingPool(snap, cfg)
    build_ms = (time.perf_counter() - t0) * 1e3

    timings: list[float] = []
    original = decide_mod._decide_one

    def timed(item: Any, pool_: Any, ctx: Any) -> Any:
        s = time.perf_counter()
        try:
            return original(item, pool_, ctx)
        finally:
            timings.append((time.perf_counter() - s) * 1e3)

    setattr(decide_mod, "_decide_one", timed)  # noqa: B010  (a module attribute, patched)
    try:
        t0 = time.perf_counter()
        out = decide_batch(reqs, pool, now_s=NOW)
        batch_ms = (time.perf_counter() - t0) * 1e3
    finally:
        setattr(decide_mod, "_decide_one", original)  # noqa: B010
    kinds: dict[str, int] = {}
    for _, d in out:
        kinds[type(d).__name__] = kinds.get(type(d).__name__, 0) + 1
    timings.sort()

    def p(q: float) -> float:
        return timings[min(len(timings) - 1, int(q * len(timings)))]

    n_devices = sum(len(n.devices) for n in nodes)
    print(
        f"{label:<24} {mix:<5} nodes={len(nodes):>5} devices={n_devices:>6} "
        f"build={build_ms:7.1f}ms  per-request p50={p(0.50):6.2f}ms p99={p(0.99):6.2f}ms "
        f"max={timings[-1]:6.2f}ms mean={statistics.fmean(timings):5.2f}ms "
        f"batch={batch_ms:7.0f}ms  "
        f"{kinds}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--mix", choices=[*MIXES, "all"], default="all")
    ap.add_argument("--sizes", default="100,1000,10000", help="synthetic pool sizes (devices)")
    ap.add_argument("--no-trace", action="store_true", help="skip the Alibaba trace pool")
    args = ap.parse_args()
    mixes = list(MIXES) if args.mix == "all" else [args.mix]
    sizes = [int(x) for x in args.sizes.split(",") if x]
    for mix in mixes:
        for n in sizes:
            nodes = synthetic_nodes(n, random.Random(args.seed))
            run(f"synthetic {n}", nodes, args.requests, args.seed, mix)
        if TRACE.exists() and not args.no_trace:
            run("alibaba-v2023 gpu nodes", trace_nodes(), args.requests, args.seed, mix)
            run("alibaba-v2023 G*->T4", trace_nodes(True), args.requests, args.seed, mix)


if __name__ == "__main__":
    main()
