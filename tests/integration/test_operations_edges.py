"""Operating edges found in review, against a real redis-server: what the scheduler's pool
gauges say once a node is lost, what a collector exports while the ledger is unreachable, and
what ``xpupool usage`` says about a record it cannot read."""

from __future__ import annotations

import asyncio

import pytest
from redis.exceptions import RedisError

from tests.integration.ledger_builders import device_spec
from xpupool.cli.main import main
from xpupool.devices import SimulatedBackend, load_catalog
from xpupool.devstack.servers import RedisServer
from xpupool.ledger import Ledger
from xpupool.scheduler.metrics import SchedulerMetrics
from xpupool.scheduler.snapshot_cache import SnapshotCache
from xpupool.telemetry_collector.handlers import CollectorDeps, collect, register_node
from xpupool.telemetry_collector.health import HealthModel
from xpupool.telemetry_collector.settings import CollectorSettings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]


def _pool(metrics: SchedulerMetrics, family: str, state: str) -> float | None:
    return metrics.registry.get_sample_value(
        family, {"vendor": "nvidia", "model": "A100", "state": state}
    )


async def test_a_lost_nodes_devices_leave_the_pool_gauges(ledger: Ledger) -> None:
    """``xpupool_pool_devices`` and its memory and capacity siblings count schedulable devices,
    and the console leaves a lost node out of the pool; but the scheduler summed every device of
    its snapshot, which keeps a lost node's devices (marked lost, so that its leases are still
    accounted for). A node that stopped heartbeating went on showing as free capacity, for as
    long as it stayed lost, with its last utilisation in the pool's mean."""
    await ledger.register_node("node-a", [device_spec("node-a", 0), device_spec("node-a", 1)])
    await ledger.register_node("node-b", [device_spec("node-b", 0)])
    metrics = SchedulerMetrics()
    cache = SnapshotCache()
    snapshot, _ = await cache.read(ledger)
    await metrics.observe_pool(snapshot)
    assert _pool(metrics, "xpupool_pool_devices", "total") == 3

    await asyncio.sleep(0.5)
    await ledger.register_node("node-b", [device_spec("node-b", 0)])  # node-b is still there
    assert (await ledger.reap_nodes(250)).ok  # node-a has been silent for 500 ms
    assert {n.node_id: n.status for n in await ledger.nodes()} == {
        "node-a": "lost",
        "node-b": "up",
    }
    snapshot, _ = await cache.read(ledger)
    await metrics.observe_pool(snapshot)
    assert _pool(metrics, "xpupool_pool_devices", "total") == 1
    assert _pool(metrics, "xpupool_pool_devices", "free") == 1
    assert _pool(metrics, "xpupool_pool_memory_bytes", "total") == 81920 * 1024 * 1024
    assert _pool(metrics, "xpupool_pool_capacity_units", "total") == pytest.approx(
        snapshot.nodes[-1].devices[0].capacity_units
    )


async def test_usage_says_in_one_line_that_a_record_does_not_decode(
    ledger: Ledger,
    redis_server: RedisServer,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A usage record the report cannot read (written by another version, or damaged) is
    reported by ``ended_usage`` as a ValueError naming the lease; ``xpupool usage`` let it out
    as a traceback instead of one line saying so (exit 1, as ``scale status`` answers a status
    it cannot read)."""
    await ledger.redis.hset(ledger.key("usage-rec"), "lease-old", b'{"lease_id": 7}')
    await ledger.redis.zadd(ledger.key("usage-ended"), {"lease-old": await ledger.now_ms()})
    monkeypatch.setenv("XPUPOOL_NAMESPACE", "test")  # the fixture's ledger
    for argv in (["usage"], ["usage", "--records"]):
        code = await asyncio.to_thread(main, ["--redis-url", redis_server.url, *argv])
        err = capsys.readouterr().err
        assert code == 1, err
        assert err.startswith("xpupool: error:") and "lease-old" in err
        assert len(err.splitlines()) == 1


async def test_a_collector_that_cannot_reach_the_ledger_shows_no_stale_readings(
    ledger: Ledger, redis_server: RedisServer
) -> None:
    """The collector drops its device readings when the backend gives none, so a scrape shows a
    gap rather than the last values as if current; but a tick that failed on the ledger (Redis
    down, or refusing) left the last tick's readings in place, and the DCGM gauges read flat,
    as if the devices' load had stopped changing, for as long as the outage lasted."""
    catalog = load_catalog(None)
    deps = CollectorDeps(
        ledger=ledger,
        backend=SimulatedBackend("node-c", "1xA100-80GB", catalog),
        catalog=catalog,
        settings=CollectorSettings(node_id="node-c", cpu_milli=8000),
        health=HealthModel(missed_limit=3),
    )
    await register_node(deps)
    await collect(deps)
    registry = deps.metrics.registry

    def readings() -> list[str]:
        return [
            sample.name
            for family in registry.collect()
            if family.name.startswith("DCGM_FI_DEV") or family.name == "xpupool_device_health"
            for sample in family.samples
        ]

    assert "DCGM_FI_DEV_FB_USED" in readings()
    redis_server.stop()
    with pytest.raises(RedisError):
        await collect(deps)
    assert registry.get_sample_value("xpupool_collector_samples_total", {"outcome": "error"}) == 1
    assert readings() == []
