"""Lease-manager entry point: wires NATS, Redis and the handlers, runs until SIGTERM."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AsyncExitStack, suppress
from typing import Any

import msgspec

from xpupool.bus import DispatchStats, TenantRateLimit, consume_stream, serve_subject
from xpupool.bus.connection import bus_settings
from xpupool.bus.lifecycle import (
    Bus,
    open_bus,
    run_service,
    run_until_stopped,
    stop_on_signals,
    supervise,
    watch_bus,
)
from xpupool.contracts import access, subjects
from xpupool.lease_manager import handlers
from xpupool.lease_manager.grant_watch import StoredGrants
from xpupool.lease_manager.metrics import (
    OUTBOXES,
    LeaseManagerMetrics,
    outbox_lag,
    serve_metrics,
)
from xpupool.lease_manager.settings import LeaseManagerSettings
from xpupool.ledger import DirectOutbox, Ledger, OutboxRelay, Retention, open_ledger
from xpupool.ledger.usage import trim_usage
from xpupool.obs import configure_logging, configure_tracing, get_logger, load_settings
from xpupool.obs.failpoints import Failpoints
from xpupool.obs.metrics import LoopLag, watch_loop_lag

SERVICE = "lease-manager"
# How many renewals, releases and lease queries one subject serves at once.
REQUEST_CONCURRENCY = 64
# How often a scheduler's command is delivered before it is given up: a ledger away (restarting,
# failing over) fails every try, and the consumer's back-off grows to 5 s a try, so 720 rides out
# an hour. The bus's default (5 tries, 6 s) dropped an EndLease over a short Redis restart: the
# cancel or preemption was lost for good and the lease lived on while its holder renewed it.
COMMAND_MAX_DELIVER = 720


async def expire_leases(
    ledger: Ledger, interval_s: float, warning_s: float, idle_warning_s: float, stop: asyncio.Event
) -> None:
    """End leases whose term passed on the ledger's clock; nothing outlives its term by more
    than ``interval_s`` plus one script run. Leases whose maximum run time ends within
    ``warning_s`` are warned first (``LeaseEnding``, once each); leases idle past their queue's
    ``idle_reclaim_s`` are warned and end ``idle_warning_s`` later."""
    log = get_logger()
    # Each step is tried on its own: a warning or reclaim refused at every tick (a record it
    # cannot read, a role whose ACL predates its script) must not keep leases past their term.
    steps: tuple[tuple[str, Callable[[], Awaitable[object]]], ...] = (
        ("warn_deadlines", functools.partial(ledger.warn_deadlines, int(warning_s * 1000))),
        ("reclaim_idle", functools.partial(ledger.reclaim_idle, int(idle_warning_s * 1000))),
        ("expire_due", ledger.expire_due),
    )
    while not stop.is_set():
        for step, run_step in steps:
            try:
                await run_step()
            except Exception as error:  # noqa: BLE001  (Redis away: try again next tick)
                log.warning("expiry_failed", step=step, error=repr(error))
        await asyncio.sleep(interval_s)


def scheduler_commands(
    bus: Bus, ledger: Ledger, stop: asyncio.Event, stats: DispatchStats
) -> list[Coroutine[Any, Any, None]]:
    """Consume the scheduler's commands: reservations to grant and leases to end. Each is
    handled again until the ledger takes it (``COMMAND_MAX_DELIVER``): both handlers are
    idempotent, and nothing else ever sends a command again (the scheduler marks a cancelled
    or preempted lease when it queues its EndLease, and queues it once)."""
    return [
        consume_stream(
            bus.js,
            durable,
            functools.partial(handler, ledger=ledger),
            bus.publisher,
            stop,
            stats=stats,
            max_deliver=COMMAND_MAX_DELIVER,
        )
        for durable, handler in (
            (subjects.LEASE_MANAGER_GRANTS, handlers.grant_reservation),
            (subjects.LEASE_MANAGER_ENDS, handlers.end_lease),
        )
    ]


async def trim_usage_records(
    ledger: Ledger, retention_s: float, interval_s: float, stop: asyncio.Event
) -> None:
    """Drop usage records of leases that ended more than ``retention_s`` ago, so the usage
    index stays bounded (a batch per call; a backlog drains over a few ticks)."""
    log = get_logger()
    while not stop.is_set():
        try:
            trimmed = await trim_usage(ledger, retention_s)
            if trimmed:
                log.info("usage_records_trimmed", count=trimmed)
        except Exception as error:  # noqa: BLE001  (Redis away: try again next tick)
            log.warning("usage_trim_failed", error=repr(error))
        await asyncio.sleep(interval_s)


async def prepare_ledger(ledger: Ledger, settings: LeaseManagerSettings) -> None:
    """Write this deployment's retention of ended jobs and leases to the ledger, and index the
    live leases of a ledger written before tenants' lease sets (``index_tenant_leases``). A
    failure (Redis away) is logged: the ledger keeps what it had until the next start."""
    wanted = Retention(job_s=settings.job_retention_s, lease_s=settings.lease_retention_s)
    log = get_logger().bind(job_retention_s=wanted.job_s, lease_retention_s=wanted.lease_s)
    try:
        before = await ledger.set_retention(wanted)
        indexed = await ledger.index_tenant_leases()
    except Exception as error:  # noqa: BLE001
        log.warning("ledger_not_prepared", error=repr(error))
        return
    if before != wanted:
        log.info("retention_set", before=None if before is None else msgspec.to_builtins(before))
    if indexed:
        log.info("tenant_leases_indexed", count=indexed)


async def reap_nodes(
    ledger: Ledger,
    grace_s: float,
    holder_grace_s: float,
    interval_s: float,
    stop: asyncio.Event,
) -> None:
    """Declare lost the nodes whose heartbeats stopped (and lift the quarantines of their lost
    leases' devices once over); the lease-manager owns this check."""
    log = get_logger()
    while not stop.is_set():
        try:
            result = await ledger.reap_nodes(int(grace_s * 1000), int(holder_grace_s * 1000))
            for node_id in result.lost:
                log.warning("node_lost", node_id=node_id)
        except Exception as error:  # noqa: BLE001
            log.warning("node_check_failed", error=repr(error))
        await asyncio.sleep(interval_s)


async def lease_metrics_loop(
    ledger: Ledger, metrics: LeaseManagerMetrics, interval_s: float, stop: asyncio.Event
) -> None:
    """Refresh the lease and outbox gauges from the ledger on the event loop, so a scrape (on
    the metrics server's thread) only renders the last values and never touches Redis or the
    event loop."""
    while not stop.is_set():
        try:
            metrics.observe_lease_states(await ledger.lease_states())
            for outbox in OUTBOXES:
                metrics.observe_outbox(outbox, *await outbox_lag(ledger, outbox))
        except Exception as error:  # noqa: BLE001  (Redis away: keep the last values, retry)
            get_logger().warning("lease_metrics_refresh_failed", error=repr(error))
        with suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval_s)


async def run(settings: LeaseManagerSettings) -> None:
    """Run the lease-manager until SIGINT/SIGTERM."""
    configure_logging(SERVICE, settings.log_level)
    provider = configure_tracing(SERVICE)
    stop = stop_on_signals()
    async with AsyncExitStack() as stack:
        ledger = await open_ledger(
            stack, settings.redis_url, settings.namespace, tls_ca=settings.redis_tls_ca
        )
        stats = DispatchStats()
        metrics = LeaseManagerMetrics()
        if settings.lease_manager_metrics_port:
            port = stack.enter_context(
                serve_metrics(
                    metrics.registry,
                    settings.lease_manager_metrics_port,
                    settings.lease_manager_metrics_addr,
                )
            )
            get_logger().info(
                "metrics_serving", addr=settings.lease_manager_metrics_addr, port=port
            )
        loop_lag = LoopLag(metrics.registry) if settings.lease_manager_metrics_port else None
        direct = DirectOutbox(ledger)
        grants = StoredGrants(metrics=metrics)
        query_limit = TenantRateLimit(settings.query_rate_per_s, settings.query_burst)
        failpoints = Failpoints.parse(settings.failpoints)

        async def run_once(run_stop: asyncio.Event) -> None:
            # Everything on NATS lives here: a closed connection re-opens all of it (supervise).
            async with AsyncExitStack() as bus_stack:
                bus = await open_bus(
                    bus_stack, bus_settings(access.LEASE_MANAGER, SERVICE, settings), SERVICE
                )
                await prepare_ledger(ledger, settings)
                commands = (handlers.reject_invalid_command, handlers.reply_too_large)
                queries = (handlers.reject_invalid_query, handlers.query_reply_too_large)
                # A holder's renewal or release publishes its own event (the direct outbox).
                # A later event of a lease waits for its grant to be stored (StoredGrants).
                renew = functools.partial(
                    handlers.renew_lease,
                    outbox=direct,
                    metrics=metrics,
                    grants=grants,
                    failpoints=failpoints,
                )
                release = functools.partial(
                    handlers.release_lease,
                    outbox=direct,
                    metrics=metrics,
                    grants=grants,
                    failpoints=failpoints,
                )
                # One bucket per tenant for both queries, kept across reconnects.
                get_lease = functools.partial(handlers.get_lease, limit=query_limit)
                list_leases = functools.partial(handlers.list_leases, limit=query_limit)
                for channel, handler, (on_invalid, too_large) in (
                    (subjects.LEASE_RENEW, renew, commands),
                    (subjects.LEASE_RELEASE, release, commands),
                    (subjects.LEASE_GET, get_lease, queries),
                    (subjects.LEASE_LIST, list_leases, queries),
                ):
                    await serve_subject(
                        bus.nc,
                        channel,
                        functools.partial(handler, ledger=ledger),
                        bus.publisher,
                        queue=SERVICE,
                        on_invalid=on_invalid,
                        stats=stats,
                        too_large_reply=too_large,
                        concurrency=REQUEST_CONCURRENCY,
                    )
                relay = OutboxRelay(
                    ledger,
                    SERVICE,
                    functools.partial(
                        handlers.build_events, ledger=ledger, metrics=metrics, grants=grants
                    ),
                    bus.publisher.send,
                    # Grants the scheduler made on admission and could not publish itself.
                    sweep_direct=True,
                )
                await run_until_stopped(
                    run_stop,
                    watch_bus(bus.nc, run_stop),
                    *scheduler_commands(bus, ledger, run_stop, stats),
                    relay.run(run_stop),
                    direct.run(bus.publisher.send, run_stop),
                    grants.run(bus.js, run_stop),
                    expire_leases(
                        ledger,
                        settings.expiry_interval_s,
                        settings.max_runtime_warning_s,
                        settings.idle_warning_s,
                        run_stop,
                    ),
                    reap_nodes(
                        ledger,
                        settings.node_grace_s,
                        settings.lost_holder_grace_s,
                        settings.node_check_interval_s,
                        run_stop,
                    ),
                    trim_usage_records(
                        ledger, settings.usage_retention_s, settings.usage_trim_interval_s, run_stop
                    ),
                    lease_metrics_loop(
                        ledger, metrics, settings.lease_manager_metrics_refresh_s, run_stop
                    ),
                    *watch_loop_lag(loop_lag, run_stop),
                )

        await supervise(run_once, stop)
    provider.shutdown()


def main() -> None:
    """Console entry point."""
    run_service(run(load_settings(LeaseManagerSettings)))


if __name__ == "__main__":
    main()
