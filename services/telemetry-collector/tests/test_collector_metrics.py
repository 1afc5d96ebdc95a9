"""The collector's Prometheus exposition, scraped over HTTP."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from xpupool.contracts import DeviceSample, DeviceSpec, Health, Vendor
from xpupool.telemetry_collector.metrics import CollectorMetrics, serve_metrics


def spec(index: int) -> DeviceSpec:
    return DeviceSpec(
        device_id=f"node-m/nvidia{index}",
        vendor=Vendor.NVIDIA,
        model="A100-SXM4-80GB",
        index=index,
        uuid=f"GPU-{index}",
        memory_mib=81_920,
    )


def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    by_name: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            by_name.setdefault(s.name, []).append((s.labels, s.value))
    return by_name


def test_scrape_serves_dcgm_gauges_health_and_tick_metrics() -> None:
    """A scrape returns DCGM-named gauges with snake_case labels, the health state set, and the
    tick histogram and counter; a device without a sample keeps only its health."""
    metrics = CollectorMetrics()
    sample = DeviceSample(
        device_id="node-m/nvidia0",
        memory_used_mib=30_000,
        util_pct=25.0,
        temperature_c=41.5,
        power_w=120.0,
        health=Health.UNHEALTHY,
        xid=79,
    )
    health = {"node-m/nvidia0": Health.UNHEALTHY, "node-m/nvidia1": Health.LOST}
    metrics.update_devices("node-m", [spec(1), spec(0)], [sample], health)
    metrics.observe_tick("ok", 0.004)
    metrics.observe_tick("backend_unavailable", 0.001)
    with serve_metrics(metrics.registry, 0, "127.0.0.1") as port:
        got = scrape(port)
    labels = {
        "gpu": "0",
        "uuid": "GPU-0",
        "device": "nvidia0",
        "model_name": "A100-SXM4-80GB",
        "hostname": "node-m",
    }
    expected = {
        "DCGM_FI_DEV_GPU_UTIL": 25.0,
        "DCGM_FI_DEV_FB_USED": 30_000,
        "DCGM_FI_DEV_FB_FREE": 81_920 - 30_000,
        "DCGM_FI_DEV_GPU_TEMP": 41.5,
        "DCGM_FI_DEV_POWER_USAGE": 120.0,
        "DCGM_FI_DEV_XID_ERRORS": 79,
    }
    for name, value in expected.items():
        assert got[name] == [(labels, value)], name
    states = {(s["device"], s["state"]): v for s, v in got["xpupool_device_health"]}
    assert states[("nvidia0", "unhealthy")] == 1 and states[("nvidia0", "healthy")] == 0
    assert states[("nvidia1", "lost")] == 1 and sum(states.values()) == 2
    ticks = {s["outcome"]: v for s, v in got["xpupool_collector_samples_total"]}
    assert ticks == {"ok": 1.0, "backend_unavailable": 1.0}
    assert got["xpupool_collector_sample_duration_seconds_count"] == [({}, 2.0)]


def test_registries_are_per_collector() -> None:
    """Two collectors in one process keep separate registries (no global state)."""
    first, second = CollectorMetrics(), CollectorMetrics()
    first.observe_tick("ok", 0.1)
    assert first.registry.get_sample_value("xpupool_collector_samples_total", {"outcome": "ok"})
    assert (
        second.registry.get_sample_value("xpupool_collector_samples_total", {"outcome": "ok"})
        is None
    )


def test_dcgm_label_spelling_is_opt_in() -> None:
    """With dcgm_labels the device series use dcgm-exporter's camelCase label names."""
    metrics = CollectorMetrics(dcgm_labels=True)
    sample = DeviceSample(device_id="node-m/nvidia0", util_pct=50.0)
    metrics.update_devices("node-m", [spec(0)], [sample], {})
    labels = {
        "gpu": "0",
        "UUID": "GPU-0",
        "device": "nvidia0",
        "modelName": "A100-SXM4-80GB",
        "Hostname": "node-m",
    }
    assert metrics.registry.get_sample_value("DCGM_FI_DEV_GPU_UTIL", labels) == 50.0
    default = CollectorMetrics()
    default.update_devices("node-m", [spec(0)], [sample], {})
    assert default.registry.get_sample_value("DCGM_FI_DEV_GPU_UTIL", labels) is None
