"""The outbox relay against a real redis-server it can lose and get back."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any

import msgspec
import pytest

from tests.conftest import eventually
from xpupool.contracts import JobCancelled
from xpupool.devstack.servers import RedisServer
from xpupool.ledger import Ledger, OutboxRelay

pytestmark = pytest.mark.integration


async def test_a_relay_started_while_redis_is_away_waits_for_it(
    ledger: Ledger, redis_server: RedisServer
) -> None:
    """A relay (re)started while Redis is down (a service restarting its bus after losing
    NATS) keeps retrying instead of failing its service, and relays once Redis is back."""
    sent: list[msgspec.Struct] = []

    async def build(entries: Sequence[dict[str, str]]) -> list[Sequence[msgspec.Struct]]:
        return [[JobCancelled(job_id=e["job_id"], tenant="t", waited_s=0.0)] for e in entries]

    async def send(event: msgspec.Struct) -> Sequence[Awaitable[Any]]:
        sent.append(event)
        return []

    redis_server.kill()
    stop = asyncio.Event()
    relay = asyncio.create_task(OutboxRelay(ledger, "test", build, send).run(stop))
    await asyncio.sleep(1.5)
    assert not relay.done()  # still retrying, not failed
    redis_server.restart()
    await ledger.redis.xadd(ledger.key("outbox", "test"), {"kind": "cancelled", "job_id": "j1"})
    await eventually(lambda: sent, timeout_s=10)
    assert [getattr(e, "job_id", None) for e in sent] == ["j1"]
    stop.set()
    await asyncio.wait_for(relay, 5)
