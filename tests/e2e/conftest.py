"""End-to-end fixtures: wait for a stack to be ready and read its ledger."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from redis.asyncio import Redis

from tests.conftest import eventually
from xpupool.devstack.stack import Stack
from xpupool.ledger import Ledger

Ready = Callable[[Stack, int], Awaitable[Ledger]]


@pytest.fixture
async def ready() -> AsyncIterator[Ready]:
    """``await ready(stack, n)``: wait until ``n`` devices are registered; returns the ledger."""
    clients: list[Redis] = []

    async def wait(stack: Stack, devices: int) -> Ledger:
        assert stack.redis_url
        redis = Redis.from_url(stack.redis_url)
        clients.append(redis)
        ledger = Ledger(redis, stack.namespace)

        async def registered() -> bool:
            return sum(len(n.devices) for n in await ledger.nodes()) >= devices

        await eventually(registered)
        return ledger

    yield wait
    for redis in clients:
        await redis.aclose()
