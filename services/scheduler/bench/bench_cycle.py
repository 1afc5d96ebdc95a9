"""Whole scheduling cycles at the Alibaba trace's scale, against a real redis-server.

Registers the trace's 1,213 GPU nodes (6,212 devices) in a fresh ledger, admits pending share
and whole-device requests, and times ``schedule_cycle`` split into reading the ledger, deciding
and committing (the cycle's own log line). Before each cycle it also times, on the same ledger, a
full read of the snapshot (``nodes()``, ``leases()``, ``build_snapshot``) beside an incremental
one (a second ``SnapshotCache``, brought up to date with what the previous cycle committed) and
checks that both are equal; at the end, the same after only a few changes.
``--full-every 0`` makes the cycles read the whole ledger each time (as before the cache).
Run: ``uv run python services/scheduler/bench/bench_cycle.py [--cycles 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

from redis.asyncio import Redis

from xpupool.contracts import DeviceDemand, Health, JobRequested
from xpupool.devices import SimulatedBackend, load_catalog, to_specs
from xpupool.devstack.servers import RedisServer
from xpupool.ledger import Ledger
from xpupool.replay.trace import find_trace_dir, load_nodes
from xpupool.scheduler import handlers
from xpupool.scheduler.config_source import ConfigSource
from xpupool.scheduler.domain import PoolSnapshot
from xpupool.scheduler.settings import SchedulerSettings
from xpupool.scheduler.snapshot import build_snapshot
from xpupool.scheduler.snapshot_cache import SnapshotCache

# The trace's undisclosed G1-G3 have no catalog memory; simulate them as T4-sized cards.
UNDISCLOSED = {"G1": "T4", "G2": "T4", "G3": "T4"}


async def full_read(ledger: Ledger) -> tuple[PoolSnapshot, float]:
    """The snapshot as the cycle read it before the cache, and the seconds it took."""
    started = time.perf_counter()
    version = await ledger.version()
    nodes, leases, now_ms = await ledger.nodes(), await ledger.leases(), await ledger.now_ms()
    snapshot = build_snapshot(nodes, leases, now_ms, version)
    return snapshot, time.perf_counter() - started


async def compare_reads(ledger: Ledger, probe: SnapshotCache) -> str:
    """Full vs incremental read of the same ledger, and whether they agree."""
    full, full_s = await full_read(ledger)
    started = time.perf_counter()
    cached, _ = await probe.read(ledger)
    incremental_s = time.perf_counter() - started
    assert probe.last is not None
    if (cached.nodes, cached.leases, cached.version) != (full.nodes, full.leases, full.version):
        raise SystemExit("the incremental snapshot differs from the full read")
    kind = "full" if probe.last.full else "incremental"
    return (
        f"full read {full_s:.3f} s, {kind} {incremental_s:.4f} s "
        f"({probe.last.nodes} nodes, {probe.last.leases} leases re-read; "
        f"x{full_s / incremental_s:.0f}), equal"
    )


async def run(
    trace: Path, cycles: int, first_batch: int, later_batch: int, full_every: int
) -> None:
    """Register the trace fleet, then time cycles over freshly admitted requests."""
    server = RedisServer(Path(tempfile.mkdtemp(prefix="xpupool-bench-")))
    server.start()
    redis = Redis.from_url(server.url)
    try:
        ledger, catalog = Ledger(redis, "bench"), load_catalog()
        for node in load_nodes(trace / "openb_node_list_gpu_node.csv"):
            model = UNDISCLOSED.get(node.model, node.model)
            backend = SimulatedBackend(node.name, f"{node.num_gpu}x{model}", catalog)
            specs = to_specs(backend.discover(), node.name, catalog)
            await ledger.register_node(node.name, specs, node.cpu_milli, node.memory_mib)
        deps = handlers.SchedulerDeps(
            ledger=ledger,
            settings=SchedulerSettings(),
            config=ConfigSource(None),
            snapshots=SnapshotCache(full_every=full_every),
        )
        probe = SnapshotCache(full_every=10**9)
        await probe.read(ledger)
        admitted = 0
        for cycle in range(cycles):
            for _ in range(first_batch if cycle == 0 else later_batch):
                share = admitted % 2 == 1
                demand = DeviceDemand(compute_pct=25) if share else DeviceDemand()
                request = JobRequested(
                    job_id=f"j{admitted}", tenant=f"t{admitted % 3}", device=demand
                )
                await handlers.admit_job(request, deps, tenant=request.tenant or "")
                admitted += 1
            reads = await compare_reads(ledger, probe)
            started = time.perf_counter()
            await handlers.schedule_cycle(deps)
            elapsed = time.perf_counter() - started
            leases = len(await ledger.leases())
            last = deps.snapshots.last
            assert last is not None
            print(
                f"cycle {cycle}: {elapsed:.3f} s  (its snapshot read: "
                f"{'full' if last.full else 'incremental'} {last.seconds:.4f} s; "
                f"{leases} leases held)\n  before it: {reads}",
                flush=True,
            )
        # A quiet moment: a few health changes only (the probe first catches up with the cycles).
        await probe.read(ledger)
        devices = [d.spec.device_id for n in await ledger.nodes() for d in n.devices]
        for device_id in random.Random(0).sample(devices, 5):
            await ledger.set_health(device_id, Health.DEGRADED, "bench")
        print(f"after 5 changes: {await compare_reads(ledger, probe)}", flush=True)
    finally:
        await redis.aclose()
        server.stop()


def main() -> None:
    """Console entry point."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--first", type=int, default=300, help="requests before cycle 0")
    parser.add_argument("--later", type=int, default=100, help="requests before each next one")
    parser.add_argument(
        "--full-every",
        type=int,
        default=100,
        help="the cycles' snapshot cache reads everything every this many reads (0: always)",
    )
    args = parser.parse_args()
    trace = find_trace_dir(Path(__file__).resolve())
    if trace is None:
        raise SystemExit("trace not found: expected ../shared/traces/alibaba-gpu-v2023")
    asyncio.run(run(trace, args.cycles, args.first, args.later, args.full_every))


if __name__ == "__main__":
    main()
