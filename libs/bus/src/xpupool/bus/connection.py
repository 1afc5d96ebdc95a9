"""Connecting to NATS with explicit, bounded retry settings, and declaring the streams."""

from __future__ import annotations

from dataclasses import dataclass

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError

from xpupool.contracts.subjects import Stream
from xpupool.obs import get_logger


@dataclass(frozen=True)
class BusSettings:
    """How a service reaches NATS."""

    url: str = "nats://127.0.0.1:4222"
    name: str = "xpupool"
    connect_timeout_s: float = 2.0
    reconnect_wait_s: float = 0.5
    # -1: keep trying for as long as the process lives; a service without its bus is useless,
    # and the supervisor (compose, Kubernetes) decides when to give up, not the client.
    max_reconnect_attempts: int = -1
    # How long a clean shutdown waits for in-flight messages before closing anyway.
    drain_timeout_s: float = 5.0


async def connect(settings: BusSettings) -> Client:
    """Connect with bounded connect timeout and unbounded reconnects, logging state changes."""
    log = get_logger().bind(nats_url=settings.url)

    async def on_error(error: Exception) -> None:
        log.warning("nats_error", error=repr(error))

    async def on_disconnected() -> None:
        log.warning("nats_disconnected")

    async def on_reconnected() -> None:
        log.info("nats_reconnected")

    return await nats.connect(
        settings.url,
        name=settings.name,
        connect_timeout=settings.connect_timeout_s,
        reconnect_time_wait=settings.reconnect_wait_s,
        max_reconnect_attempts=settings.max_reconnect_attempts,
        allow_reconnect=True,
        drain_timeout=settings.drain_timeout_s,
        error_cb=on_error,
        disconnected_cb=on_disconnected,
        reconnected_cb=on_reconnected,
    )


async def ensure_streams(js: JetStreamContext, streams: tuple[Stream, ...]) -> None:
    """Create each stream, or bring an existing one's subjects and limits up to date."""
    for stream in streams:
        config = StreamConfig(
            name=stream.name,
            subjects=list(stream.subjects),
            retention=RetentionPolicy.WORK_QUEUE if stream.work_queue else RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            discard=DiscardPolicy.OLD,
            max_age=stream.max_age_s,
            duplicate_window=stream.duplicate_window_s,
        )
        try:
            await js.stream_info(stream.name)
        except NotFoundError:
            try:
                await js.add_stream(config)
            except BadRequestError:
                # Another replica created it between our lookup and our create.
                await js.update_stream(config)
        else:
            await js.update_stream(config)
