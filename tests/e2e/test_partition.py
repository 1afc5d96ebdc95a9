"""The reliability plan's F15: a node cut off from NATS and Redis (a partition, not a crash) for
longer than the node grace, then back.

The node's collector reaches both servers through a proxy that the test stops forwarding (bytes
held, connections open, as a network that drops packets until it heals and TCP sends them
again). The ledger declares the node lost and ends its lease ``lost``; but the lease's holder,
cut off with the node, may not have heard and runs until the term it last heard of (``xpupool
run`` then stops its job within its grace). So when the partition heals before that term, the
same collector process registers the node again with the lease's device quarantined
(unhealthy) until the term plus ``XPUPOOL_LOST_HOLDER_GRACE_S``: a job waiting for a device gets
it only then, never while the old holder may still run on it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from urllib.parse import urlsplit, urlunsplit

import pytest

from tests.conftest import eventually
from tests.e2e.conftest import EventLog, Ready, terminal_counts
from xpupool.contracts import (
    AllocationGranted,
    DeviceSelector,
    EndReason,
    Health,
    JobRequested,
    LeaseEnded,
    subjects,
)
from xpupool.devstack.stack import NodeSpec, Stack
from xpupool.ledger import audit

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

HOLDER_GRACE_S = 1.0


class Partition:
    """A TCP proxy to one server that can stop forwarding (``cut``) and start again (``heal``):
    what either side sends meanwhile is held, and delivered on heal, connections stay open."""

    def __init__(self, upstream_url: str) -> None:
        self.upstream = urlsplit(upstream_url)
        self.healed = asyncio.Event()
        self.healed.set()
        self.server: asyncio.Server | None = None
        self.tasks: set[asyncio.Task[None]] = set()
        self.writers: list[asyncio.StreamWriter] = []

    async def start(self) -> str:
        """Listen; returns the URL to give the node instead of the server's."""
        self.server = await asyncio.start_server(self._connect, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        netloc = f"{self.upstream.username}@" if self.upstream.username else ""
        return urlunsplit(self.upstream._replace(netloc=f"{netloc}127.0.0.1:{port}"))

    def cut(self) -> None:
        self.healed.clear()

    def heal(self) -> None:
        self.healed.set()

    async def _connect(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        await self.healed.wait()  # a connection made while cut gets through once healed
        assert self.upstream.hostname and self.upstream.port
        up_reader, up_writer = await asyncio.open_connection(
            self.upstream.hostname, self.upstream.port
        )
        self.writers.append(up_writer)
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            task = asyncio.create_task(self._pump(source, sink))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await source.read(65536):
                await self.healed.wait()
                sink.write(data)
                await sink.drain()
        sink.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for writer in self.writers:
            writer.close()
            with contextlib.suppress(ConnectionError, OSError):
                await writer.wait_closed()
        if self.server is not None:
            await self.server.wait_closed()


async def test_a_node_cut_off_past_its_grace_comes_back_with_its_lost_lease_quarantined(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    stack = make_stack(
        [NodeSpec("node-p", "1xA100-80GB"), NodeSpec("node-o", "1xA100-80GB")],
        extra_env={
            "XPUPOOL_NODE_GRACE_S": "2",
            "XPUPOOL_SAMPLE_INTERVAL_S": "0.3",
            "XPUPOOL_LOST_HOLDER_GRACE_S": str(HOLDER_GRACE_S),
        },
    )
    ledger = await ready(stack, 2)
    assert stack.nats_url and stack.redis_url
    nats, redis = Partition(stack.nats_url), Partition(stack.redis_url)
    collector = next(s for s in stack.services if s.env.get("XPUPOOL_NODE_ID") == "node-p")
    node_key = ledger.key("node", "node-p")
    direct = await ledger.redis.hget(node_key, "instance")
    stack.restart(
        collector, XPUPOOL_NATS_URL=await nats.start(), XPUPOOL_REDIS_URL=await redis.start()
    )

    async def registered_through_the_proxies() -> bool:
        return await ledger.redis.hget(node_key, "instance") not in (None, direct)

    await eventually(registered_through_the_proxies)
    await stack.wait_until_pulling()
    log = EventLog()
    try:
        async with stack.client() as client:
            await log.attach(client.nc)
            devices = {n.node_id: n.devices[0].spec.device_id for n in await ledger.nodes()}
            cut_off = await client.submit_and_wait(
                JobRequested(
                    job_id="cut-off",
                    tenant="t",
                    lease_ttl_s=6,
                    selector=DeviceSelector(device_ids=[devices["node-p"]]),
                )
            )
            other = await client.submit_and_wait(
                JobRequested(
                    job_id="other",
                    tenant="t",
                    selector=DeviceSelector(device_ids=[devices["node-o"]]),
                )
            )
            assert isinstance(cut_off, AllocationGranted) and isinstance(other, AllocationGranted)

            nats.cut()
            redis.cut()
            ended = await eventually(lambda: log.of(LeaseEnded, "cut-off"), timeout_s=15)
            assert ended[0].reason is EndReason.LOST
            waiting = asyncio.create_task(
                client.submit_and_wait(JobRequested(job_id="next", tenant="t"), timeout_s=60)
            )
            await asyncio.sleep(0.5)
            assert not waiting.done()  # node-o is held, node-p lost
            nats.heal()
            redis.heal()

            async def quarantined() -> bool:
                node = next(n for n in await ledger.nodes() if n.node_id == "node-p")
                return node.status == "up" and node.devices[0].health is Health.UNHEALTHY

            await eventually(quarantined, timeout_s=15)
            after = await waiting
            assert isinstance(after, AllocationGranted)
            assert after.slices[0].device_id == devices["node-p"]
            # Never before the old holder's term and its grace ran out (the ledger's clock).
            free_from = cut_off.expires_at + timedelta(seconds=HOLDER_GRACE_S)
            assert after.granted_at >= free_from, (after.granted_at, free_from)
            for grant in (after, other):
                reply = await client.release(grant.lease_id, grant.fencing_token)
                assert reply.ok, reply
            await asyncio.sleep(1.0)
            expected = Counter({"AllocationGranted": 1, "LeaseEnded": 1})
            for job_id in ("cut-off", "other", "next"):
                assert await terminal_counts(client.nc, job_id) == {
                    subjects.EVENTS_STREAM.name: expected,
                    subjects.TENANT_EVENTS_STREAM.name: expected,
                }, job_id
    finally:
        await nats.close()
        await redis.close()
    assert await audit(ledger) == []
