"""Two replicas of one service racing, on a real nats-server and Redis: what one replica's relay
takes over from a peer that died or stalled still goes out in the order the ledger queued it."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Sequence
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client

from tests.conftest import eventually
from tests.integration.ledger_builders import device_spec, reservation, stored_lease_events
from xpupool.bus import Publisher
from xpupool.contracts import (
    AllocationGranted,
    LeaseEnded,
    NodeLost,
    subjects,
)
from xpupool.lease_manager.grant_watch import StoredGrants
from xpupool.lease_manager.handlers import build_events
from xpupool.ledger import Admission, Ledger, OutboxRelay, SliceClaim, new_lease_secret

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def test_a_grant_taken_from_a_dead_replica_goes_before_the_end_read_with_it(
    ledger: Ledger, nc: Client
) -> None:
    """Lease-manager replica A read a lease's grant from the outbox and died before publishing
    it. Once the entry is stale, replica B takes it (XAUTOCLAIM) in the same turn of its loop as
    it reads the lease's end, queued after the grant (the holder never got its grant, and the
    lease was preempted or expired). B publishes the batch in the order the ledger queued it:
    the grant, then the end; never the end ahead of the grant, on either stream."""
    devices = [device_spec("n1", i) for i in range(2)]
    assert (await ledger.register_node("n1", devices, 64_000, 256_000)).ok
    [waiting] = await ledger.admit_many([Admission("a", 500, b"{}", None, "queued", tenant="t")])
    assert waiting.outcome == "pending"
    assert (await ledger.reserve(reservation("a", SliceClaim("n1/nvidia0", whole=True)))).ok
    assert (await ledger.grant("lease-a", new_lease_secret())).ok
    stream = ledger.key("outbox", "lease-manager")
    await ledger.redis.xgroup_create(stream, "relay", id="0")
    await ledger.redis.xreadgroup("relay", "lm-a", {stream: ">"})  # read, never published
    # Another entry keeps replica B busy publishing while A's grant goes stale and the lease
    # ends: B then reads the end and takes the grant in one turn (its claim is due by then).
    await ledger.redis.xadd(stream, {"kind": "node_lost", "node_id": "n9", "last_seen_ms": "0"})
    gate, busy = asyncio.Event(), asyncio.Event()
    publisher = Publisher(nc, source="/lease-manager/b")
    sent: list[msgspec.Struct] = []

    async def send(event: msgspec.Struct) -> Sequence[Awaitable[Any]]:
        if isinstance(event, NodeLost):
            busy.set()
            await gate.wait()
        sent.append(event)
        return await publisher.send(event)

    grants = StoredGrants(wait_s=5.0)
    stop = asyncio.Event()
    watching = asyncio.create_task(grants.run(nc.jetstream(), stop))
    await eventually(lambda: grants.following, timeout_s=5)
    # Claims every 0.2 s, taking what stayed unacked for 0.6 s.
    relay = OutboxRelay(
        ledger,
        "lease-manager",
        functools.partial(build_events, ledger=ledger, grants=grants),
        send,
        consumer="lm-b",
        stale_after_ms=600,
    )
    relaying = asyncio.create_task(relay.run(stop))
    await asyncio.wait_for(busy.wait(), 5)
    await asyncio.sleep(0.8)  # A's grant entry is stale now
    assert (await ledger.end("lease-a", "preempted")).ok
    gate.set()
    await eventually(lambda: sum(isinstance(e, AllocationGranted | LeaseEnded) for e in sent) >= 2)
    stop.set()
    await asyncio.wait_for(asyncio.gather(relaying, watching), 5)
    for events in (subjects.EVENTS_STREAM, subjects.TENANT_EVENTS_STREAM):
        assert [type(e) for e in await stored_lease_events(nc, events)] == [
            AllocationGranted,
            LeaseEnded,
        ]
