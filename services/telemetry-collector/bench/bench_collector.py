"""Cost of one collector sampling tick, per device, for simulated nodes of 8 and 64 devices.

Starts its own redis-server and nats-server (``xpupool.devstack.servers``), registers one
simulated node of N A100s, leases every device out as a 20 GiB share and every fourth device
a second time (so the several-holders path, which reads processes, runs too), then times
``handlers.collect`` in steady state:

- CPU ms per device per sample: ``time.process_time`` around ``collect`` (the worker thread
  that reads the backend included), divided by ticks and devices;
- Redis round trips per sample: requests written on the client's connections (a pipeline or a
  script call is one), counted by a connection subclass;
- Redis commands per sample: ``INFO commandstats`` deltas (commands run inside Lua included);
- publish ms per sample: wall time to publish the tick's events (JetStream and core NATS).

    .venv/bin/python services/telemetry-collector/bench/bench_collector.py [--ticks 200]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from redis.asyncio import ConnectionPool, Redis
from redis.asyncio.connection import Connection

from xpupool.bus import BusSettings, Publisher, connect, ensure_streams
from xpupool.contracts import subjects
from xpupool.devices import SimulatedBackend, load_catalog
from xpupool.devstack.servers import NatsServer, RedisServer
from xpupool.ledger import Ledger, Reservation, SliceClaim
from xpupool.obs import configure_logging
from xpupool.telemetry_collector.handlers import CollectorDeps, collect, register_node
from xpupool.telemetry_collector.health import HealthModel
from xpupool.telemetry_collector.settings import CollectorSettings


@dataclass
class RoundTrips:
    """Requests written to Redis by one client."""

    count: int = 0


def counting_connection(counter: RoundTrips) -> type[Connection]:
    """A connection class that counts every request it writes (one per round trip)."""

    class CountingConnection(Connection):
        async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
            counter.count += 1
            await super().send_packed_command(command, check_health)

    return CountingConnection


@dataclass(frozen=True)
class Row:
    """One node size's result."""

    devices: int
    leases: int
    cpu_ms_per_sample: float
    cpu_ms_per_device: float
    round_trips: float
    commands: float
    publish_ms: float


async def _commands(redis: Redis) -> int:
    stats = await redis.info("commandstats")
    return sum(int(v["calls"]) for v in stats.values())


async def _lease(ledger: Ledger, device_id: str, lease_id: str) -> None:
    claim = SliceClaim(device_id=device_id, memory_mib=20_000, compute_pct=20)
    reservation = Reservation(
        job_id=f"job-{lease_id}",
        lease_id=lease_id,
        tenant="bench",
        queue="bench",
        priority=0,
        owner="bench",
        ttl_ms=3_600_000,
        hold_ms=3_600_000,
        slices=[claim],
    )
    if not (await ledger.reserve(reservation)).ok or not (await ledger.grant(lease_id)).ok:
        raise RuntimeError(f"could not lease {device_id}")


async def measure(devices: int, ticks: int, redis_url: str, publisher: Publisher) -> Row:
    """Register a node of ``devices`` A100s, lease them out, time ``ticks`` samples."""
    node_id = f"bench-{devices}"
    trips = RoundTrips()
    pool = ConnectionPool.from_url(redis_url, connection_class=counting_connection(trips))
    redis = Redis(connection_pool=pool)
    admin = Redis.from_url(redis_url)
    catalog = load_catalog(None)
    backend = SimulatedBackend(node_id, f"{devices}xA100-80GB", catalog)
    ledger = Ledger(redis, f"bench{devices}")
    deps = CollectorDeps(
        ledger=ledger,
        backend=backend,
        catalog=catalog,
        settings=CollectorSettings(node_id=node_id, cpu_milli=devices * 8000),
        health=HealthModel(missed_limit=3),
    )
    try:
        await register_node(deps)
        leases = 0
        for n, device_id in enumerate(backend.device_ids):
            for copy in range(2 if n % 4 == 0 else 1):
                await _lease(ledger, device_id, f"lease-{n}-{copy}")
                leases += 1
        for _ in range(5):  # warm up: scripts loaded, connections open, caches filled
            await publisher.publish_all(await collect(deps))
        trips.count, commands = 0, await _commands(admin)
        cpu = publish_s = 0.0
        for _ in range(ticks):
            started = time.process_time()
            events = await collect(deps)
            cpu += time.process_time() - started
            wall = time.perf_counter()
            await publisher.publish_all(events)
            publish_s += time.perf_counter() - wall
        round_trips = trips.count
        # The INFO call itself is one command on the server.
        commands = await _commands(admin) - commands - 1
    finally:
        await redis.aclose()
        await pool.aclose()
        await admin.aclose()
        backend.close()
    return Row(
        devices=devices,
        leases=leases,
        cpu_ms_per_sample=cpu * 1000 / ticks,
        cpu_ms_per_device=cpu * 1000 / ticks / devices,
        round_trips=round_trips / ticks,
        commands=commands / ticks,
        publish_ms=publish_s * 1000 / ticks,
    )


async def run(sizes: list[int], ticks: int) -> list[Row]:
    """Start the servers, measure every size, stop the servers."""
    with tempfile.TemporaryDirectory(prefix="bench-collector-") as tmp:
        nats, redis = NatsServer(Path(tmp) / "nats"), RedisServer(Path(tmp) / "redis")
        nats.start()
        redis.start()
        try:
            nc = await connect(BusSettings(url=nats.url, name="bench-collector"))
            js = nc.jetstream()
            await ensure_streams(js, subjects.STREAMS)
            publisher = Publisher(nc, source="/bench/collector")
            rows = [await measure(n, ticks, redis.url, publisher) for n in sizes]
            await nc.drain()
            return rows
        finally:
            nats.stop()
            redis.stop()


def main() -> None:
    """Command-line entry point: prints one table row per node size."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="8,64", help="comma-separated node sizes")
    parser.add_argument("--ticks", type=int, default=200, help="measured samples per size")
    args = parser.parse_args()
    configure_logging("bench-collector", "error")
    rows = asyncio.run(run([int(n) for n in args.devices.split(",")], args.ticks))
    print(
        f"{'devices':>7} {'leases':>6} {'CPU ms/sample':>13} {'CPU ms/dev/sample':>17} "
        f"{'Redis RT/sample':>15} {'Redis cmds/sample':>17} {'publish ms/sample':>17}"
    )
    for r in rows:
        print(
            f"{r.devices:>7} {r.leases:>6} {r.cpu_ms_per_sample:>13.2f} "
            f"{r.cpu_ms_per_device:>17.3f} {r.round_trips:>15.1f} {r.commands:>17.1f} "
            f"{r.publish_ms:>17.2f}"
        )


if __name__ == "__main__":
    main()
