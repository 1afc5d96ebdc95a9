"""How long the services' periodic gauge refreshes hold their event loop, at 10,000 devices and
10,000 live leases (``just bench-stalls``): the figures of PROFILE.md's "Stalls of the event
loop".

- the scheduler's pool gauges: a full walk of every device (``pool_rows``) against the kept
  per-node summary (``PoolSummary``) with nothing changed and with a tenth of the nodes changed,
  on the end-to-end bench's fleet with 30 % of its devices held;
- the lease-manager's lease gauge: reading every lease (``Ledger.leases()``, as before) against
  counting states (``Ledger.lease_states``) on a real ``redis-server`` holding 10,000 leases
  made by the ledger's own reservation script, with the longest turn the event loop waited;
- what the event-loop lag probe costs a process that does nothing else, against no probe.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib
import random
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from prometheus_client import CollectorRegistry
from redis.asyncio import Redis

from xpupool.bus.lifecycle import freeze_heap
from xpupool.contracts import DeviceSpec, Vendor
from xpupool.devstack.servers import RedisServer
from xpupool.ledger import Ledger, Reservation, SliceClaim
from xpupool.obs.metrics import LoopLag
from xpupool.scheduler.metrics import PoolSummary, pool_rows

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "services" / "scheduler" / "bench"))
bd = importlib.import_module("bench_decide")


def _ms(seconds: float) -> str:
    return f"{1000 * seconds:.1f} ms"


async def pool_gauges(devices: int) -> list[str]:
    rng = random.Random(1)
    snapshot = bd.occupy(bd.synthetic_nodes(devices, rng), 0.3, rng)
    freeze_heap()  # as the services do once their long-lived state is built
    started = time.perf_counter()
    full = pool_rows(snapshot)
    walk = time.perf_counter() - started
    summary = PoolSummary()
    await summary.rows(snapshot)
    started = time.perf_counter()
    same = await summary.rows(snapshot)
    kept = time.perf_counter() - started
    nodes = list(snapshot.nodes)
    for k in range(0, len(nodes), 10):
        node = nodes[k]
        first = dataclasses.replace(node.devices[0], util_pct=rng.uniform(0, 100))
        nodes[k] = dataclasses.replace(node, devices=(first, *node.devices[1:]))
    changed = dataclasses.replace(snapshot, nodes=tuple(nodes))
    started = time.perf_counter()
    after = await summary.rows(changed)
    tenth = time.perf_counter() - started
    assert same == full and after == pool_rows(changed)
    return [
        f"pool gauges, {devices} devices: full walk {_ms(walk)}; kept summary {_ms(kept)} "
        f"with nothing changed, {_ms(tenth)} with a tenth of the nodes changed"
    ]


async def _longest_turn(work: Callable[[], Awaitable[object]]) -> tuple[float, float]:
    """``work``'s wall time and the longest the event loop went without a turn meanwhile."""
    turns: list[float] = []

    async def probe() -> None:
        while True:
            started = time.perf_counter()
            await asyncio.sleep(0)
            turns.append(time.perf_counter() - started)

    task = asyncio.create_task(probe())
    await asyncio.sleep(0)
    started = time.perf_counter()
    await work()
    took = time.perf_counter() - started
    task.cancel()
    return took, max(turns)


async def lease_gauge(leases: int) -> list[str]:
    server = RedisServer(Path(tempfile.mkdtemp(prefix="xpupool-bench-stalls-")))
    server.start()
    redis = Redis.from_url(server.url)
    try:
        ledger = Ledger(redis)
        per_device = 100  # shares of 1 % compute and 500 MiB each
        devices = -(-leases // per_device)
        for n in range(-(-devices // 8)):
            specs = [
                DeviceSpec(
                    device_id=f"n{n}/gpu{i}",
                    vendor=Vendor.NVIDIA,
                    model="A100",
                    index=i,
                    uuid=f"GPU-{n}-{i}",
                    memory_mib=81920,
                )
                for i in range(8)
            ]
            assert (await ledger.register_node(f"n{n}", specs, 1_000_000, 4_000_000)).ok
        made = [
            Reservation(
                job_id=f"job-{j}",
                lease_id=f"lease-{j}",
                tenant=f"t{j % 8}",
                queue=f"t{j % 8}",
                priority=500,
                owner="bench",
                ttl_ms=3_600_000,
                hold_ms=3_600_000,
                slices=[SliceClaim(f"n{j // per_device // 8}/gpu{j // per_device % 8}", 500, 1)],
            )
            for j in range(leases)
        ]
        for k in range(0, leases, 500):
            assert all(r.ok for r in await ledger.reserve_many(made[k : k + 500]))
        for k in range(0, leases, 2):
            assert (await ledger.grant(f"lease-{k}")).ok
        freeze_heap()
        rows = []
        for name, work in (
            ("every lease read", ledger.leases),
            ("states counted", ledger.lease_states),
        ):
            took, turn = await _longest_turn(work)
            rows.append(f"{name} {_ms(took)} (longest turn {_ms(turn)})")
        assert await ledger.lease_states() == {"active": -(-leases // 2), "reserved": leases // 2}
        return [f"lease gauge, {leases} leases: " + "; ".join(rows)]
    finally:
        await redis.aclose()
        server.stop()


async def probe_cost(seconds: float) -> list[str]:
    async def cpu_ms_per_s(with_probe: bool) -> float:
        stop = asyncio.Event()
        task = asyncio.create_task(LoopLag(CollectorRegistry()).watch(stop)) if with_probe else None
        started = time.process_time()
        await asyncio.sleep(seconds)
        used = time.process_time() - started
        stop.set()
        if task is not None:
            await task
        return 1000 * used / seconds

    without, with_probe = await cpu_ms_per_s(False), await cpu_ms_per_s(True)
    return [f"loop-lag probe: {with_probe:.2f} CPU ms per second, against {without:.2f} without"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=10_000)
    parser.add_argument("--leases", type=int, default=10_000)
    parser.add_argument("--probe-s", type=float, default=5.0)
    args = parser.parse_args()
    print("\n".join(asyncio.run(run(args.devices, args.leases, args.probe_s))))


async def run(devices: int, leases: int, probe_s: float) -> list[str]:
    return [
        *await pool_gauges(devices),
        *await lease_gauge(leases),
        *await probe_cost(probe_s),
    ]


if __name__ == "__main__":
    main()
