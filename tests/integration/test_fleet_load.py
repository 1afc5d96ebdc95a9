"""The simulated fleet's load telemetry (``XPUPOOL_FLEET_BUSY_SHARE``) against a real Redis and
NATS: its busy devices' utilisation moves every interval and enters the change log, as a real
collector's live utilisation does; its idle devices report nothing."""

from __future__ import annotations

import asyncio
import random

import pytest
from nats.aio.client import Client

from xpupool.bus import Publisher
from xpupool.devices import load_catalog
from xpupool.devstack.servers import NatsServer
from xpupool.ledger import Ledger
from xpupool.telemetry_collector import handlers
from xpupool.telemetry_collector.fleet import FleetNode, busy_samples, heartbeat_loop, node_deps
from xpupool.telemetry_collector.metrics import CollectorMetrics
from xpupool.telemetry_collector.settings import CollectorSettings

pytestmark = pytest.mark.integration

NODES = [FleetNode(f"f{i}", "8xA100-80GB", 256_000, 1_048_576) for i in range(2)]


def _fleet(ledger: Ledger) -> list[handlers.CollectorDeps]:
    base = CollectorSettings(sample_interval_s=0.2)
    catalog, metrics = load_catalog(None), CollectorMetrics()
    return [node_deps(node, base, ledger, catalog, metrics) for node in NODES]


async def test_busy_devices_report_a_moving_utilisation(ledger: Ledger) -> None:
    fleet = _fleet(ledger)
    rng = random.Random(1)
    samples = [busy_samples(fleet[0], 0.5, rng) for _ in range(20)]
    assert all(len(s) == 4 for s in samples)  # half of the node's 8 devices
    assert {s.device_id for s in samples[0]} == {s.device_id for s in samples[-1]}
    utils = [s.util_pct for batch in samples for s in batch]
    assert all(u is not None and 40 <= u <= 100 for u in utils)
    assert len(set(utils)) > 10  # it moves
    assert busy_samples(fleet[0], 0.0, rng) == []


async def test_fleet_load_enters_the_change_log_every_interval(
    ledger: Ledger, nats_server: NatsServer
) -> None:
    fleet = _fleet(ledger)
    for deps in fleet:
        await handlers.register_node(deps)
    busy = {s.device_id for deps in fleet for s in busy_samples(deps, 0.25, random.Random())}
    cursor = (await ledger.changes_since(None)).cursor
    nc = Client()
    await nc.connect(nats_server.url)
    stop = asyncio.Event()
    try:
        loop = asyncio.create_task(
            heartbeat_loop(fleet, Publisher(nc, "test"), stop, busy_share=0.25)
        )
        await asyncio.sleep(0.5)  # two intervals and a half
        stop.set()
        await asyncio.wait_for(loop, 5)
    finally:
        await nc.close()
    changes = await ledger.changes_since(cursor)
    assert changes.complete
    assert set(changes.devices) == busy  # the busy quarter of each node, and nothing else
    devices = {d.spec.device_id: d for node in await ledger.nodes() for d in node.devices}
    assert all(devices[d].util_pct is not None for d in busy)
    assert all(devices[d].util_pct is None for d in devices.keys() - busy)
    # Every node kept its heartbeat.
    assert all(node.last_seen_ms for node in await ledger.nodes())
