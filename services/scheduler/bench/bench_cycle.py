"""Whole scheduling cycles at the Alibaba trace's scale, against a real redis-server.

Registers the trace's 1,213 GPU nodes (6,212 devices) in a fresh ledger, admits pending share
and whole-device requests, and times ``schedule_cycle`` split into reading the ledger, deciding
and committing (the cycle's own log line), plus ``Ledger.nodes()`` alone.
Run: ``uv run python services/scheduler/bench/bench_cycle.py [--cycles 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from redis.asyncio import Redis

from xpupool.contracts import DeviceDemand, JobRequested
from xpupool.devices import SimulatedBackend, load_catalog, to_specs
from xpupool.devstack.servers import RedisServer
from xpupool.ledger import Ledger
from xpupool.placement.trace import find_trace_dir, load_nodes
from xpupool.scheduler import handlers
from xpupool.scheduler.config_source import ConfigSource
from xpupool.scheduler.settings import SchedulerSettings

# The trace's undisclosed G1-G3 have no catalog memory; simulate them as T4-sized cards.
UNDISCLOSED = {"G1": "T4", "G2": "T4", "G3": "T4"}


async def run(trace: Path, cycles: int, first_batch: int, later_batch: int) -> None:
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
            ledger=ledger, settings=SchedulerSettings(), config=ConfigSource(None)
        )
        admitted = 0
        for cycle in range(cycles):
            for _ in range(first_batch if cycle == 0 else later_batch):
                share = admitted % 2 == 1
                demand = DeviceDemand(compute_pct=25) if share else DeviceDemand()
                request = JobRequested(
                    job_id=f"j{admitted}", tenant=f"t{admitted % 3}", device=demand
                )
                await handlers.admit_job(request, deps)
                admitted += 1
            started = time.perf_counter()
            await ledger.nodes()
            read_nodes = time.perf_counter() - started
            started = time.perf_counter()
            await handlers.schedule_cycle(deps)
            elapsed = time.perf_counter() - started
            leases = len(await ledger.leases())
            print(
                f"cycle {cycle}: {elapsed:.3f} s  (ledger.nodes() alone {read_nodes:.3f} s, "
                f"{leases} leases held)",
                flush=True,
            )
    finally:
        await redis.aclose()
        server.stop()


def main() -> None:
    """Console entry point."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cycles", type=int, default=3)
    parser.add_argument("--first", type=int, default=300, help="requests before cycle 0")
    parser.add_argument("--later", type=int, default=100, help="requests before each next one")
    args = parser.parse_args()
    trace = find_trace_dir(Path(__file__).resolve())
    if trace is None:
        raise SystemExit("trace not found: expected ../shared/traces/alibaba-gpu-v2023")
    asyncio.run(run(trace, args.cycles, args.first, args.later))


if __name__ == "__main__":
    main()
