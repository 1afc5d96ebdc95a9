"""What a pair of acknowledged JetStream publishes costs the publisher: nats-py's
``publish_async`` against ``xpupool.bus.acks.JetStreamAcks``, alternately in one process.

``python bench/e2e/bench_acks.py [--pairs 2000] [--rounds 3]``: a nats-server of its own with a
file-backed stream; each pair is what a grant or a lease's end is on the wire (two copies of a
1.4 KB event with CloudEvents headers and a message id), both acknowledgements awaited before
the next pair, as a lone job's are. Prints the process's CPU and the wall time per pair.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats
import uvloop
from nats.aio.client import Client
from nats.js.api import StorageType, StreamConfig

from xpupool.bus.acks import JetStreamAcks
from xpupool.devstack.servers import NatsServer

HEADERS = {
    "ce-specversion": "1.0",
    "ce-type": "xpupool.allocation.granted",
    "ce-source": "/services/scheduler",
    "ce-id": "x",
    "ce-time": "2026-12-07T00:00:00Z",
    "content-type": "application/json",
}
PAYLOAD = b'{"x":"' + b"1" * 1400 + b'"}'

Publish = Callable[[str, bytes, dict[str, str]], Awaitable[asyncio.Future[object]]]


async def pairs(publish: Publish, label: str, n: int) -> None:
    for i in range(n):
        first = {**HEADERS, "Nats-Msg-Id": f"{label}-{time.time_ns()}-{i}"}
        second = {**first, "Nats-Msg-Id": first["Nats-Msg-Id"] + "-tenant"}
        acks = [
            await publish("bench.operator", PAYLOAD, first),
            await publish("bench.tenant", PAYLOAD, second),
        ]
        await asyncio.gather(*acks)


async def main(n: int, rounds: int) -> None:
    server = NatsServer(Path(tempfile.mkdtemp(prefix="xpupool-bench-acks-")) / "nats")
    server.start()
    try:
        nc: Client = await nats.connect(server.url)
        js = nc.jetstream()
        await js.add_stream(
            StreamConfig(name="BENCH", subjects=["bench.>"], storage=StorageType.FILE)
        )
        own = JetStreamAcks(nc)

        async def with_nats_py(subject: str, data: bytes, headers: dict[str, str]) -> object:
            return await js.publish_async(subject, data, headers=headers)

        async def with_own(subject: str, data: bytes, headers: dict[str, str]) -> object:
            return await own.publish(subject, data, headers)

        ways: list[tuple[str, Publish]] = [
            ("publish_async", with_nats_py),  # type: ignore[list-item]
            ("JetStreamAcks", with_own),  # type: ignore[list-item]
        ]
        for label, publish in ways:
            await pairs(publish, f"warm-{label}", 200)
        for _ in range(rounds):
            for label, publish in ways:
                cpu, wall = time.process_time(), time.perf_counter()
                await pairs(publish, label, n)
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                print(
                    f"{label:<14} CPU {1e6 * cpu / n:6.1f} us, wall {1e6 * wall / n:6.1f} us "
                    "per acknowledged pair"
                )
        await nc.close()
    finally:
        server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pairs", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    uvloop.run(main(args.pairs, args.rounds))
