"""Lease-manager entry point: wires NATS, Redis and the handlers, runs until SIGTERM."""

from __future__ import annotations

import asyncio
import functools
from contextlib import AsyncExitStack

from xpupool.bus import (
    consume_stream,
    serve_subject,
)
from xpupool.bus.lifecycle import open_bus, run_until_stopped, stop_on_signals
from xpupool.contracts import subjects
from xpupool.lease_manager import handlers
from xpupool.lease_manager.settings import LeaseManagerSettings
from xpupool.ledger import Ledger, OutboxRelay, open_ledger
from xpupool.obs import configure_logging, configure_tracing, get_logger, load_settings

SERVICE = "lease-manager"


async def expire_leases(ledger: Ledger, interval_s: float, stop: asyncio.Event) -> None:
    """End leases whose term passed on the ledger's clock; nothing outlives its term by more
    than ``interval_s`` plus one script run."""
    log = get_logger()
    while not stop.is_set():
        try:
            await ledger.expire_due()
        except Exception as error:  # noqa: BLE001  (Redis away: try again next tick)
            log.warning("expiry_failed", error=repr(error))
        await asyncio.sleep(interval_s)


async def reap_nodes(
    ledger: Ledger, grace_s: float, interval_s: float, stop: asyncio.Event
) -> None:
    """Declare lost the nodes whose heartbeats stopped; the lease-manager owns this check."""
    log = get_logger()
    while not stop.is_set():
        try:
            result = await ledger.reap_nodes(int(grace_s * 1000))
            for node_id in result.lost:
                log.warning("node_lost", node_id=node_id)
        except Exception as error:  # noqa: BLE001
            log.warning("node_check_failed", error=repr(error))
        await asyncio.sleep(interval_s)


async def run(settings: LeaseManagerSettings) -> None:
    """Run the lease-manager until SIGINT/SIGTERM."""
    configure_logging(SERVICE, settings.log_level)
    provider = configure_tracing(SERVICE)
    stop = stop_on_signals()
    async with AsyncExitStack() as stack:
        bus = await open_bus(stack, settings.nats_url, SERVICE, f"/services/{SERVICE}")
        nc, js, publisher = bus.nc, bus.js, bus.publisher
        ledger = await open_ledger(stack, settings.redis_url, settings.namespace)

        await serve_subject(
            nc,
            subjects.LEASE_RENEW,
            functools.partial(handlers.renew_lease, ledger=ledger),
            publisher,
            queue=SERVICE,
            on_invalid=handlers.reject_invalid_command,
        )
        await serve_subject(
            nc,
            subjects.LEASE_RELEASE,
            functools.partial(handlers.release_lease, ledger=ledger),
            publisher,
            queue=SERVICE,
            on_invalid=handlers.reject_invalid_command,
        )
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
                subjects.LEASE_MANAGER_GRANTS,
                functools.partial(handlers.grant_reservation, ledger=ledger),
                publisher,
                stop,
            ),
            consume_stream(
                js,
                subjects.LEASE_MANAGER_ENDS,
                functools.partial(handlers.end_lease, ledger=ledger),
                publisher,
                stop,
            ),
            relay.run(stop),
            expire_leases(ledger, settings.expiry_interval_s, stop),
            reap_nodes(ledger, settings.node_grace_s, settings.node_check_interval_s, stop),
        )
    provider.shutdown()


def main() -> None:
    """Console entry point."""
    asyncio.run(run(load_settings(LeaseManagerSettings)))


if __name__ == "__main__":
    main()
