"""Collector entry point: one process per node."""

from __future__ import annotations

import asyncio
import functools
from contextlib import AsyncExitStack, suppress
from pathlib import Path

from xpupool.bus import Publisher, serve_subject
from xpupool.bus.connection import bus_settings
from xpupool.bus.lifecycle import (
    open_bus,
    run_service,
    run_until_stopped,
    stop_on_signals,
    supervise,
    watch_bus,
)
from xpupool.contracts import access, subjects
from xpupool.devices import Catalog, DeviceBackend, SimulatedBackend, load_catalog
from xpupool.devices.enforcement import running_share_limits
from xpupool.devices.registry import create_backend
from xpupool.ledger import open_ledger
from xpupool.obs import configure_logging, configure_tracing, get_logger, load_settings
from xpupool.obs.metrics import LoopLag, watch_loop_lag
from xpupool.telemetry_collector import handlers
from xpupool.telemetry_collector.health import HealthModel
from xpupool.telemetry_collector.metrics import CollectorMetrics, serve_metrics
from xpupool.telemetry_collector.settings import CollectorSettings

SERVICE = "telemetry-collector"


def build_backend(settings: CollectorSettings, catalog: Catalog) -> DeviceBackend:
    """The device backend named by the settings."""
    if settings.backend == "simulated":
        return SimulatedBackend(settings.node_id, settings.node_profile, catalog, settings.seed)
    return create_backend(settings.backend, settings.node_id, catalog)


async def sample_loop(
    deps: handlers.CollectorDeps, publisher: Publisher, stop: asyncio.Event
) -> None:
    """Sample every interval until stopped; a failed tick is logged and the next one retries."""
    log = get_logger()
    while not stop.is_set():
        try:
            await publisher.publish_all(await handlers.collect(deps))
        except Exception as error:  # noqa: BLE001  (Redis or NATS away: try next tick)
            log.warning("collect_failed", error=repr(error))
        with suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=deps.settings.sample_interval_s)


async def run(settings: CollectorSettings) -> None:
    """Run the collector until SIGINT/SIGTERM."""
    configure_logging(SERVICE, settings.log_level)
    provider = configure_tracing(SERVICE)
    stop = stop_on_signals()
    catalog = load_catalog(Path(settings.catalog) if settings.catalog else None)
    backend = build_backend(settings, catalog)
    # A bad XPUPOOL_SHARE_LIMITS stops the collector here, not at its first registration.
    limits = running_share_limits(
        settings.share_limits, simulated=isinstance(backend, SimulatedBackend)
    )
    get_logger().info(
        "share_limits", running=sorted(limits) if limits is not None else "as the catalog lists"
    )
    async with AsyncExitStack() as stack:
        stack.callback(backend.close)
        deps = handlers.CollectorDeps(
            ledger=await open_ledger(
                stack, settings.redis_url, settings.namespace, tls_ca=settings.redis_tls_ca
            ),
            backend=backend,
            catalog=catalog,
            settings=settings,
            health=HealthModel(missed_limit=settings.missed_samples_lost),
            metrics=CollectorMetrics(dcgm_labels=settings.metrics_dcgm_labels),
        )
        if settings.metrics_port:
            port = stack.enter_context(
                serve_metrics(deps.metrics.registry, settings.metrics_port, settings.metrics_addr)
            )
            get_logger().info("metrics_serving", addr=settings.metrics_addr, port=port)
        loop_lag = LoopLag(deps.metrics.registry) if settings.metrics_port else None
        name = f"{SERVICE}-{settings.node_id}"

        async def run_once(run_stop: asyncio.Event) -> None:
            # Everything on NATS lives here: a closed connection re-opens all of it (supervise).
            async with AsyncExitStack() as bus_stack:
                bus = await open_bus(
                    bus_stack,
                    bus_settings(access.TELEMETRY_COLLECTOR, name, settings),
                    source=f"/services/{SERVICE}/{settings.node_id}",
                )
                await serve_subject(
                    bus.nc,
                    subjects.SIM_FAULT,
                    functools.partial(handlers.inject_fault, deps=deps),
                    bus.publisher,
                    queue=name,
                )
                # Registered last: once the node is in the ledger, its control subject listens.
                # Registration is idempotent, so a re-opened bus registers again harmlessly.
                await bus.publisher.publish_all(await handlers.register_node(deps))
                await run_until_stopped(
                    run_stop,
                    watch_bus(bus.nc, run_stop),
                    sample_loop(deps, bus.publisher, run_stop),
                    *watch_loop_lag(loop_lag, run_stop),
                )

        await supervise(run_once, stop)
    provider.shutdown()


def main() -> None:
    """Console entry point."""
    run_service(run(load_settings(CollectorSettings)))


if __name__ == "__main__":
    main()
