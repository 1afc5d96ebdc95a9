"""Autoscaler entry point: wires NATS, Redis, the pool file, providers and the solver, runs until
SIGTERM.

Several replicas may run; the one holding the leader lease acts (see
:mod:`xpupool.autoscaler.state` and :mod:`xpupool.autoscaler.loop`), the others wait to take
over. ``run`` takes the solver, the simulated provider's process launcher and the node drainer
as arguments, so tests and embedders can give their own.
"""

from __future__ import annotations

import asyncio
import os
import socket
from contextlib import AsyncExitStack
from typing import Any

import msgspec

from xpupool.autoscaler.drain import LedgerDrainer, NodeDrainer
from xpupool.autoscaler.loop import Autoscaler, AutoscalerDeps
from xpupool.autoscaler.metrics import AutoscalerMetrics, serve_metrics
from xpupool.autoscaler.pools import PoolConfigError, PoolSource, ProviderConfig
from xpupool.autoscaler.providers import Provider, make_provider
from xpupool.autoscaler.providers.simulated import NodeProcessLauncher
from xpupool.autoscaler.settings import AutoscalerSettings
from xpupool.autoscaler.solver import ScaleUpSolver
from xpupool.autoscaler.state import AutoscalerState
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
from xpupool.ledger import open_ledger
from xpupool.obs import configure_logging, configure_tracing, get_logger, load_settings
from xpupool.obs.metrics import LoopLag, watch_loop_lag

SERVICE = "autoscaler"


def replica_name(settings: AutoscalerSettings) -> str:
    """This replica's name in the leader lease: the setting, else host name and pid."""
    return settings.autoscaler_replica_id or f"{socket.gethostname()}-{os.getpid()}"


async def run(
    settings: AutoscalerSettings,
    *,
    solver: ScaleUpSolver | None = None,
    launcher: NodeProcessLauncher | None = None,
    drainer: NodeDrainer | None = None,
) -> None:
    """Run one autoscaler replica until SIGINT/SIGTERM.

    ``solver``: default the placement engine's (:class:`~xpupool.autoscaler.solver
    .PlacementSolver`); ``launcher``: how the simulated provider starts collector processes
    (default: children of this process); ``drainer``: default :class:`LedgerDrainer`."""
    configure_logging(SERVICE, settings.log_level)
    provider = configure_tracing(SERVICE)
    log = get_logger()
    stop = stop_on_signals()
    try:
        pools = PoolSource(settings.pools_file or None)
    except PoolConfigError as error:
        raise SystemExit(f"autoscaler: {error}") from None
    if solver is None:
        from xpupool.autoscaler.solver import PlacementSolver

        solver = PlacementSolver()
    if launcher is None and settings.autoscaler_collector_env:
        from xpupool.autoscaler.providers.simulated import CollectorLauncher

        try:
            identity = msgspec.json.decode(settings.autoscaler_collector_env, type=dict[str, str])
        except msgspec.DecodeError as error:
            raise SystemExit(f"autoscaler: XPUPOOL_AUTOSCALER_COLLECTOR_ENV: {error}") from None
        launcher = CollectorLauncher(base_env={**os.environ, **identity})

    def providers(config: ProviderConfig) -> Provider:
        return make_provider(config, launcher=launcher)

    async with AsyncExitStack() as stack:
        ledger = await open_ledger(
            stack, settings.redis_url, settings.namespace, tls_ca=settings.redis_tls_ca
        )
        metrics = AutoscalerMetrics()
        if settings.autoscaler_metrics_port:
            port = stack.enter_context(
                serve_metrics(
                    metrics.registry,
                    settings.autoscaler_metrics_port,
                    settings.autoscaler_metrics_addr,
                )
            )
            log.info("metrics_serving", addr=settings.autoscaler_metrics_addr, port=port)
        loop_lag = LoopLag(metrics.registry) if settings.autoscaler_metrics_port else None
        state = AutoscalerState(ledger.redis, ledger.prefix, replica_name(settings))
        deps = AutoscalerDeps(
            ledger=ledger,
            state=state,
            pools=pools,
            solver=solver,
            settings=settings,
            drainer=drainer or LedgerDrainer(ledger),
            metrics=metrics,
            make_provider=providers,
        )
        autoscaler = Autoscaler(deps)
        log.info(
            "autoscaler_starting",
            replica=state.owner,
            pools=list(pools.current().names),
            source=pools.current().source,
        )

        async def on_node_change(_: Any) -> None:
            deps.wake.set()

        async def run_once(run_stop: asyncio.Event) -> None:
            # Everything on NATS lives here: a closed connection re-opens all of it (supervise).
            async with AsyncExitStack() as bus_stack:
                bus = await open_bus(
                    bus_stack, bus_settings(access.AUTOSCALER, SERVICE, settings), SERVICE
                )
                autoscaler.publish = bus.publisher.publish
                for channel in (subjects.NODE_REGISTERED, subjects.NODE_LOST):
                    await bus.nc.subscribe(channel.pattern, cb=on_node_change)
                await run_until_stopped(
                    run_stop,
                    watch_bus(bus.nc, run_stop),
                    autoscaler.keep_lease(run_stop),
                    autoscaler.run(run_stop),
                    *watch_loop_lag(loop_lag, run_stop),
                )

        try:
            await supervise(run_once, stop)
        finally:
            await autoscaler.resign()
    provider.shutdown()


def main() -> None:
    """Console entry point."""
    run_service(run(load_settings(AutoscalerSettings)))


if __name__ == "__main__":
    main()
