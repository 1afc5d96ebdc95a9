"""Prometheus metrics of one collector: device gauges under DCGM-exporter names, plus our own.

Device gauges keep DCGM-exporter's names and units for every vendor, so dashboards built for
dcgm-exporter work on Ascend, Cambricon and AMD nodes too. Their identity labels are snake_case
(``gpu``, ``uuid``, ``device``, ``model_name``, ``hostname``) so the exposition passes
``promtool check metrics``; ``XPUPOOL_METRICS_DCGM_LABELS=true`` switches to DCGM-exporter's own
spelling (``UUID``, ``modelName``, ``Hostname``) for dashboards that match on it. Our own
metrics follow Prometheus conventions (``xpupool_`` prefix, base units). Each collector owns
its :class:`~prometheus_client.CollectorRegistry`; nothing goes to the process-wide default one.

Device series are rendered from the latest tick's snapshot at scrape time, so a device that
leaves the node leaves the exposition instead of lingering with its last value.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from xpupool.contracts import DeviceSample, DeviceSpec, Health
from xpupool.obs.metrics import serve_metrics

__all__ = ["DCGM_LABELS", "DEVICE_LABELS", "CollectorMetrics", "DeviceReading", "serve_metrics"]

DEVICE_LABELS: Final = ("gpu", "uuid", "device", "model_name", "hostname")
# dcgm-exporter's spelling, opt-in: promtool flags its camelCase label names.
DCGM_LABELS: Final = ("gpu", "UUID", "device", "modelName", "Hostname")
_SAMPLE_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass(frozen=True)
class DeviceReading:
    """One leasable unit at the last tick: its identity labels and what it reported."""

    labels: tuple[str, str, str, str, str]
    memory_total_mib: int
    health: Health
    sample: DeviceSample | None


def _labels(spec: DeviceSpec, node_id: str) -> tuple[str, str, str, str, str]:
    local = spec.device_id.removeprefix(f"{node_id}/")
    return (str(spec.index), spec.uuid, local, spec.model, node_id)


class _DeviceGauges:
    """A custom collector: renders the latest snapshot on every scrape (scraper's thread)."""

    def __init__(self, label_names: tuple[str, ...]) -> None:
        self.label_names = label_names
        # Replaced whole, never mutated, so the scrape thread needs no lock.
        self.readings: tuple[DeviceReading, ...] = ()

    def describe(self) -> Iterable[Metric]:
        """The families, empty: lets the registry reject a duplicate name at registration."""
        return self._families(())

    def collect(self) -> Iterable[Metric]:
        """The families filled from the latest snapshot."""
        return self._families(self.readings)

    def _families(self, readings: Sequence[DeviceReading]) -> list[Metric]:
        names = self.label_names

        def gauge(name: str, doc: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(name, doc, labels=names)

        util = gauge("DCGM_FI_DEV_GPU_UTIL", "Device utilization (in %).")
        used = gauge("DCGM_FI_DEV_FB_USED", "Device memory used (in MiB).")
        free = gauge("DCGM_FI_DEV_FB_FREE", "Device memory free (in MiB).")
        temp = gauge("DCGM_FI_DEV_GPU_TEMP", "Device temperature (in C).")
        power = gauge("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).")
        xid = gauge("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.")
        health = GaugeMetricFamily(
            "xpupool_device_health",
            "1 for the device's current health state, 0 for the others.",
            labels=(*names, "state"),
        )
        for r in readings:
            for state in Health:
                health.add_metric((*r.labels, state.value), 1.0 if state is r.health else 0.0)
            s = r.sample
            if s is None:
                continue
            if s.util_pct is not None:
                util.add_metric(r.labels, s.util_pct)
            if s.memory_used_mib is not None:
                used.add_metric(r.labels, s.memory_used_mib)
                free.add_metric(r.labels, max(r.memory_total_mib - s.memory_used_mib, 0))
            if s.temperature_c is not None:
                temp.add_metric(r.labels, s.temperature_c)
            if s.power_w is not None:
                power.add_metric(r.labels, s.power_w)
            # DCGM reports 0 until the first XID; so do we.
            xid.add_metric(r.labels, s.xid or 0)
        return [util, used, free, temp, power, xid, health]


class CollectorMetrics:
    """Every metric of one collector, in its own registry."""

    def __init__(self, *, dcgm_labels: bool = False) -> None:
        self.registry = CollectorRegistry()
        self._devices = _DeviceGauges(DCGM_LABELS if dcgm_labels else DEVICE_LABELS)
        self.registry.register(self._devices)
        self.sample_duration = Histogram(
            "xpupool_collector_sample_duration_seconds",
            "Time one sampling tick takes: backend read, ledger writes, over-use check.",
            buckets=_SAMPLE_BUCKETS,
            registry=self.registry,
        )
        self.samples = Counter(
            "xpupool_collector_samples",
            "Sampling ticks by outcome (ok, backend_unavailable, node_claimed, error).",
            ["outcome"],
            registry=self.registry,
        )

    def observe_tick(self, outcome: str, duration_s: float) -> None:
        """Count one tick and record how long it took. A tick that failed (``error``: the
        ledger down or refusing) put no reading in place of the last one, which the device
        series must not show as current until a tick succeeds: they go, as they do when the
        backend gives nothing (left in place, the DCGM gauges read flat through a Redis outage,
        as if the devices' load had stopped changing)."""
        self.samples.labels(outcome=outcome).inc()
        self.sample_duration.observe(duration_s)
        if outcome == "error":
            self._devices.readings = ()

    def update_devices(
        self,
        node_id: str,
        specs: Iterable[DeviceSpec],
        samples: Iterable[DeviceSample],
        health: Mapping[str, Health],
    ) -> None:
        """Replace the device snapshot: every registered unit, with its sample if it sent one.

        A unit missing from ``samples`` keeps only its health series (e.g. ``lost``).
        """
        by_id = {s.device_id: s for s in samples}
        self._devices.readings = tuple(
            DeviceReading(
                labels=_labels(spec, node_id),
                memory_total_mib=spec.memory_mib,
                health=health.get(spec.device_id, Health.HEALTHY),
                sample=by_id.get(spec.device_id),
            )
            for spec in sorted(specs, key=lambda s: s.device_id)
        )
