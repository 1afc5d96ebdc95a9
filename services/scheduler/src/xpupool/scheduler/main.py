"""Scheduler entry point: wires NATS, Redis and the handlers, runs until SIGTERM."""

from __future__ import annotations

import asyncio
import functools
from contextlib import AsyncExitStack, suppress
from typing import Any

from redis.asyncio import Redis

from xpupool.bus import BusSettings, Publisher, connect, consume_stream, ensure_streams
from xpupool.bus.lifecycle import run_until_stopped, stop_on_signals
from xpupool.contracts import subjects
from xpupool.ledger import Ledger, OutboxRelay
from xpupool.obs import configure_logging, configure_tracing, get_logger, load_settings
from xpupool.scheduler import handlers
from xpupool.scheduler.settings import SchedulerSettings

SERVICE = "scheduler"


async def retry_loop(
    deps: handlers.SchedulerDeps, publisher: Publisher, wake: asyncio.Event, stop: asyncio.Event
) -> None:
    """Retry pending requests whenever capacity may have freed, and at least periodically."""
    log = get_logger()
    while not stop.is_set():
        with suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), timeout=deps.settings.retry_interval_s)
        wake.clear()
        try:
            await publisher.publish_all(await handlers.retry_pending(deps))
        except Exception as error:  # noqa: BLE001  (Redis or NATS away: next pass retries)
            log.warning("pending_retry_failed", error=repr(error))


async def run(settings: SchedulerSettings) -> None:
    """Run one scheduler replica until SIGINT/SIGTERM; replicas share the job consumer."""
    configure_logging(SERVICE, settings.log_level)
    provider = configure_tracing(SERVICE)
    stop = stop_on_signals()
    async with AsyncExitStack() as stack:
        nc = await connect(BusSettings(url=settings.nats_url, name=SERVICE))
        stack.push_async_callback(nc.drain)
        js = nc.jetstream()
        await ensure_streams(js, subjects.STREAMS)
        redis = Redis.from_url(settings.redis_url)
        stack.push_async_callback(redis.aclose)
        ledger = Ledger(redis, settings.namespace)
        publisher = Publisher(nc, js, source=f"/services/{SERVICE}")
        deps = handlers.SchedulerDeps(ledger=ledger, settings=settings)

        wake = asyncio.Event()

        async def on_capacity_change(_: Any) -> None:
            wake.set()

        for channel in (subjects.ALLOC_ENDED, subjects.NODE_REGISTERED, subjects.DEVICE_HEALTH):
            await nc.subscribe(channel.address.replace("{reason}", "*"), cb=on_capacity_change)

        relay = OutboxRelay(
            ledger,
            SERVICE,
            functools.partial(handlers.build_events, ledger=ledger),
            publisher.publish,
        )
        await run_until_stopped(
            stop,
            consume_stream(
                js,
                subjects.JOB_REQUESTED,
                "scheduler-jobs",
                functools.partial(handlers.schedule_job, deps=deps),
                publisher,
                stop,
                on_invalid=handlers.reject_invalid_request,
                on_give_up=handlers.give_up_request,
            ),
            relay.run(stop),
            retry_loop(deps, publisher, wake, stop),
        )
    provider.shutdown()


def main() -> None:
    """Console entry point."""
    asyncio.run(run(load_settings(SchedulerSettings)))


if __name__ == "__main__":
    main()
