"""Process lifecycle: open the bus, stop on SIGINT/SIGTERM, run a service's loops until then."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Coroutine
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client
from nats.js import JetStreamContext

from xpupool.bus.connection import BusSettings, connect, ensure_streams
from xpupool.bus.publisher import Publisher
from xpupool.contracts import subjects
from xpupool.obs import get_logger


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM (call from inside the running loop)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    return stop


async def run_until_stopped(stop: asyncio.Event, *loops: Coroutine[Any, Any, None]) -> None:
    """Run the service's loops; when ``stop`` is set, or any loop dies, stop them all.

    A loop that raises is a bug, not a transient fault (those are retried inside each loop), so
    the process exits non-zero and its supervisor restarts it.
    """
    log = get_logger()
    tasks = [asyncio.create_task(loop) for loop in loops]
    stopper = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
    stop.set()
    failed = [t for t in done if t is not stopper and t.exception() is not None]
    for task in tasks:
        if not task.done():
            task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    log.info("service_stopped")
    if failed:
        raise failed[0].exception()  # type: ignore[misc]


@dataclass(frozen=True)
class Bus:
    """A service's NATS connection, its JetStream context and its publisher."""

    nc: Client
    js: JetStreamContext
    publisher: Publisher


async def open_bus(stack: AsyncExitStack, url: str, name: str, source: str) -> Bus:
    """Connect (drained when ``stack`` closes), declare the streams, build the publisher."""
    nc = await connect(BusSettings(url=url, name=name))
    stack.push_async_callback(nc.drain)
    js = nc.jetstream()
    await ensure_streams(js, subjects.STREAMS)
    return Bus(nc, js, Publisher(nc, js, source=source))
