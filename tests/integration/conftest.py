"""Fixtures shared by the integration tests."""

from __future__ import annotations

from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client

from xpupool.bus import ensure_streams
from xpupool.contracts import subjects
from xpupool.devstack.servers import NatsServer


@pytest.fixture
async def nc(nats_server: NatsServer) -> AsyncIterator[Client]:
    """A connection to the test's nats-server, with xpupool's streams declared."""
    client = await nats.connect(nats_server.url)
    await ensure_streams(client.jetstream(), subjects.STREAMS)
    yield client
    await client.drain()
