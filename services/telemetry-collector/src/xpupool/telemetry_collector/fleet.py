"""Many simulated nodes in one collector process: ``python -m xpupool.telemetry_collector.fleet``.

A trace replay needs a thousand nodes; a thousand collector processes do not fit on a small dev
machine. This runner reads a node list (``XPUPOOL_SIMULATED_NODES``: a CSV file with the header
``node_id,profile,cpu_milli,memory_mib``), registers every node with the collector's own
:func:`~xpupool.telemetry_collector.handlers.register_node` and a :class:`SimulatedBackend`
each, then heartbeats all of them every ``XPUPOOL_SAMPLE_INTERVAL_S``. A node whose heartbeat is
refused (the lease-manager declared it lost) registers again.

It does not sample its simulated devices, take faults or serve metrics: a fleet is for placement
at scale. With ``XPUPOOL_FLEET_BUSY_SHARE`` above 0 it does report load as a fleet running long
jobs would: that share of each node's devices reports a utilisation that moves every interval
(each sample drawn anew between 40 and 100 %), written with the node's heartbeat (one script per
node and interval), as one collector per node writes it. Every such change enters the ledger's
change log, as live utilisation does, so what follows that log (the scheduler's kept copy) sees
production's rate of changes. The other ``XPUPOOL_*`` variables mean what they mean for one
collector (``XPUPOOL_NODE_ID``/``XPUPOOL_NODE_PROFILE`` are ignored).
"""

from __future__ import annotations

import asyncio
import csv
import io
import random
from contextlib import AsyncExitStack, suppress
from dataclasses import dataclass
from pathlib import Path

import msgspec

from xpupool.bus import Publisher
from xpupool.bus.connection import bus_settings
from xpupool.bus.lifecycle import (
    open_bus,
    run_service,
    run_until_stopped,
    stop_on_signals,
    supervise,
    watch_bus,
)
from xpupool.contracts import DeviceSample, access
from xpupool.devices import Catalog, SimulatedBackend, load_catalog
from xpupool.ledger import Ledger, open_ledger
from xpupool.obs import configure_logging, get_logger, load_settings
from xpupool.telemetry_collector import handlers
from xpupool.telemetry_collector.health import HealthModel
from xpupool.telemetry_collector.metrics import CollectorMetrics
from xpupool.telemetry_collector.settings import CollectorSettings

SERVICE = "telemetry-fleet"
FLEET_COLUMNS = ("node_id", "profile", "cpu_milli", "memory_mib")


class FleetSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What the fleet runner reads beyond the collector's settings."""

    # CSV file: node_id,profile,cpu_milli,memory_mib (one simulated node per row).
    simulated_nodes: str = ""
    # Share of each node's devices that report a moving utilisation every interval (0: none).
    fleet_busy_share: float = 0.0


@dataclass(frozen=True, slots=True)
class FleetNode:
    """One simulated node of the fleet."""

    node_id: str
    profile: str
    cpu_milli: int
    memory_mib: int


def parse_fleet(text: str) -> list[FleetNode]:
    """Parse a fleet CSV body; raises ValueError naming the first bad row."""
    out: list[FleetNode] = []
    for n, row in enumerate(csv.DictReader(io.StringIO(text)), start=2):
        try:
            out.append(
                FleetNode(
                    node_id=row["node_id"].strip(),
                    profile=row["profile"].strip(),
                    cpu_milli=int(row["cpu_milli"]),
                    memory_mib=int(row["memory_mib"]),
                )
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"fleet file line {n}: {exc!r}") from exc
    ids = [f.node_id for f in out]
    if len(set(ids)) != len(ids):
        raise ValueError("fleet file: node ids must be unique")
    return out


def format_fleet(nodes: list[FleetNode]) -> str:
    """Write a fleet CSV body (the inverse of :func:`parse_fleet`)."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(FLEET_COLUMNS)
    for f in nodes:
        writer.writerow([f.node_id, f.profile, f.cpu_milli, f.memory_mib])
    return buf.getvalue()


def node_deps(
    node: FleetNode,
    base: CollectorSettings,
    ledger: Ledger,
    catalog: Catalog,
    metrics: CollectorMetrics,
) -> handlers.CollectorDeps:
    """The collector dependencies of one fleet node (they share the ledger and metrics)."""
    settings = msgspec.structs.replace(
        base,
        node_id=node.node_id,
        node_profile=node.profile,
        backend="simulated",
        cpu_milli=node.cpu_milli,
        memory_mib=node.memory_mib,
    )
    return handlers.CollectorDeps(
        ledger=ledger,
        backend=SimulatedBackend(node.node_id, node.profile, catalog, base.seed),
        catalog=catalog,
        settings=settings,
        health=HealthModel(missed_limit=base.missed_samples_lost),
        metrics=metrics,
    )


def busy_samples(
    deps: handlers.CollectorDeps, busy_share: float, rng: random.Random
) -> list[DeviceSample]:
    """One interval's load of a node's busy devices (the first ``busy_share`` of them): a
    utilisation drawn anew each time, as a device running a real job reports it."""
    assert isinstance(deps.backend, SimulatedBackend)  # every fleet node's (node_deps)
    units = deps.backend.unit_ids
    busy = units[: round(busy_share * len(units))]
    return [DeviceSample(device_id=unit, util_pct=float(rng.randint(40, 100))) for unit in busy]


async def heartbeat_loop(
    fleet: list[handlers.CollectorDeps],
    publisher: Publisher,
    stop: asyncio.Event,
    busy_share: float = 0.0,
) -> None:
    """Heartbeat every node each interval (after its busy devices' load, if any), spread over
    the interval as independent collectors' would be; re-register a node whose heartbeat is
    refused."""
    log = get_logger()
    interval = fleet[0].settings.sample_interval_s if fleet else 1.0
    rng = random.Random(fleet[0].settings.seed if fleet else 0)
    loop = asyncio.get_running_loop()
    while not stop.is_set():
        started = loop.time()
        for n, deps in enumerate(fleet):
            # Each node at its own point of the interval: a thousand collectors do not all
            # sample at the same instant.
            delay = started + interval * n / len(fleet) - loop.time()
            if delay > 0 and busy_share > 0:
                with suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=delay)
                if stop.is_set():
                    return
            try:
                load = busy_samples(deps, busy_share, rng) if busy_share > 0 else ()
                beat = await deps.ledger.heartbeat(deps.settings.node_id, load, deps.instance)
                if not beat.ok and beat.reason != handlers.NODE_CLAIMED:
                    await publisher.publish_all(await handlers.register_node(deps))
            except Exception as error:  # noqa: BLE001  (Redis or NATS away: next round retries)
                log.warning(
                    "fleet_heartbeat_failed", node_id=deps.settings.node_id, error=repr(error)
                )
        with suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=max(0.0, started + interval - loop.time()))


async def run(base: CollectorSettings, nodes: list[FleetNode], busy_share: float = 0.0) -> None:
    """Register every node of the fleet, then heartbeat them (and report the load of their
    busy devices, ``busy_share`` of each node's) until SIGINT/SIGTERM."""
    configure_logging(SERVICE, base.log_level)
    stop = stop_on_signals()
    catalog = load_catalog(Path(base.catalog) if base.catalog else None)
    async with AsyncExitStack() as stack:
        ledger = await open_ledger(stack, base.redis_url, base.namespace, tls_ca=base.redis_tls_ca)
        metrics = CollectorMetrics(dcgm_labels=base.metrics_dcgm_labels)
        fleet = [node_deps(n, base, ledger, catalog, metrics) for n in nodes]
        for deps in fleet:
            stack.callback(deps.backend.close)

        async def run_once(run_stop: asyncio.Event) -> None:
            async with AsyncExitStack() as bus_stack:
                bus = await open_bus(
                    bus_stack, bus_settings(access.TELEMETRY_COLLECTOR, SERVICE, base), SERVICE
                )
                for deps in fleet:
                    await bus.publisher.publish_all(await handlers.register_node(deps))
                get_logger().info("fleet_registered", nodes=len(fleet))
                await run_until_stopped(
                    run_stop,
                    watch_bus(bus.nc, run_stop),
                    heartbeat_loop(fleet, bus.publisher, run_stop, busy_share),
                )

        await supervise(run_once, stop)


def main() -> None:
    """Console entry point."""
    settings = load_settings(FleetSettings)
    if not settings.simulated_nodes:
        raise SystemExit("XPUPOOL_SIMULATED_NODES must name a fleet CSV file")
    nodes = parse_fleet(Path(settings.simulated_nodes).read_text(encoding="utf-8"))
    if not 0.0 <= settings.fleet_busy_share <= 1.0:
        raise SystemExit("XPUPOOL_FLEET_BUSY_SHARE must be between 0 and 1")
    run_service(run(load_settings(CollectorSettings), nodes, settings.fleet_busy_share))


if __name__ == "__main__":
    main()
