"""When a stack is ready: its services are pulling their durable consumers.

A service that has subscribed to its stream keeps a pull request waiting on the server
(``num_waiting``), so "every durable has a waiting pull" means a request published now is taken
at once, not after the service finished starting.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import nats
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from xpupool.contracts.subjects import DURABLES, Durable


async def pulling(js: JetStreamContext, durables: Sequence[Durable] = DURABLES) -> list[Durable]:
    """The durables no service is pulling yet (an empty list: all are)."""
    idle = []
    for durable in durables:
        try:
            info = await js.consumer_info(durable.stream.name, durable.name)
        except NotFoundError:
            idle.append(durable)
            continue
        if not info.num_waiting:
            idle.append(durable)
    return idle


async def wait_for_pulls(
    js: JetStreamContext, durables: Sequence[Durable] = DURABLES, timeout_s: float = 30.0
) -> None:
    """Return once every durable has a pull waiting; TimeoutError names the ones that do not."""
    deadline = time.monotonic() + timeout_s
    while idle := await pulling(js, durables):
        if time.monotonic() > deadline:
            names = ", ".join(f"{d.name} ({d.service})" for d in idle)
            raise TimeoutError(f"not pulling after {timeout_s:g} s: {names}")
        await asyncio.sleep(0.05)


async def wait_until_pulling(
    nats_url: str, durables: Sequence[Durable] = DURABLES, timeout_s: float = 30.0
) -> None:
    """``wait_for_pulls`` on a plain connection to ``nats_url`` (an open server)."""
    nc = await nats.connect(nats_url, name="xpupool-readiness")
    try:
        await wait_for_pulls(nc.jetstream(), durables, timeout_s)
    finally:
        await nc.close()
