"""The scheduler's Prometheus metrics (its own registry, nothing on the process-wide one).

The scheduler exports the pool, queue and decision series; the lease-manager exports the lease,
outbox and usage series, so no series is exported by two services.

- ``xpupool_pool_devices{vendor,model,state}``, ``xpupool_pool_memory_bytes{...}`` and
  ``xpupool_pool_capacity_units{...}`` (normalized capacity): ``state`` is ``total``, ``used``
  or ``free``; ``xpupool_pool_device_utilization_ratio{vendor,model}``: mean live load (0-1)
  of the devices that report one; a lost node's devices are left out. Rendered at scrape time
  from a snapshot the service's event loop refreshes (:meth:`SchedulerMetrics.observe_pool`),
  never read on the scrape thread.
- ``xpupool_scheduler_queue_pending_requests{queue}`` and
  ``xpupool_scheduler_queue_oldest_wait_seconds{queue}``: as of this replica's last cycle (0
  for a queue it has only granted on admission, and for every queue while a peer holds the
  cycle lock: take the maximum over replicas).
- ``xpupool_scheduler_fair_share_usage_units{queue}``: the decayed normalized capacity a queue
  (subtree included) has used, as this replica's fair-share history ranks queues by;
- ``xpupool_scheduler_grants_total{queue}``, ``xpupool_scheduler_rejections_total{reason}``
  (what a cycle rejected; requests refused at admission are answered at once and not counted
  here), ``xpupool_scheduler_preemptions_total{queue}`` (victim leases asked to end);
- ``xpupool_scheduler_admission_views_total{view}``: lone arrivals placed on the copy of the
  ledger kept from the last read and admitted so (``kept``), and those the ledger refused
  because it had changed since (``changed``; decided again on a read);
- ``xpupool_scheduler_carried_reads_total{step}``: change-log reads a batch's commit carried in
  its round trip because more requests had arrived meanwhile (``carried``), and the batches that
  decided on such a read instead of reading themselves (``used``);
- ``xpupool_scheduler_submit_to_grant_seconds``: histogram from a request's admission to its
  committed reservation; ``xpupool_scheduler_cycle_duration_seconds``: one cycle that had jobs
  to decide, and ``xpupool_scheduler_cycle_phase_seconds{phase}`` the same cycle's ``read`` (the
  waiting jobs, the pool and the growth), ``decide`` and ``commit``, so a slow cycle says which
  part was slow.

Several replicas: pool gauges are ledger-wide, so every replica reports the same values and
dashboards take ``max by (...)``; queue gauges are each replica's last cycle, also read with
``max by (queue)``; every decision is made by exactly one replica (the cycle lock, and each
commit re-checks), so the counters and histograms are summed over replicas.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, GCCollector, Histogram
from prometheus_client.metrics_core import GaugeMetricFamily, Metric

from xpupool.contracts import Health, JobReason
from xpupool.obs.metrics import serve_metrics
from xpupool.placement.inventory import NodeState, PoolSnapshot

__all__ = [
    "PoolRow",
    "PoolSummary",
    "QueueRow",
    "SchedulerMetrics",
    "node_sums",
    "pool_rows",
    "queue_rows",
    "serve_metrics",
]

MIB: Final = 1024 * 1024
_LATENCY_BUCKETS: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5, 10, 30, 60, 300, 1800)
CYCLE_PHASES: Final = ("read", "decide", "commit")
_CYCLE_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


@dataclass(frozen=True)
class PoolRow:
    """One (vendor, model) of the pool: counts and sums over its schedulable devices."""

    vendor: str
    model: str
    devices: int
    devices_used: int
    memory_bytes: int
    memory_free_bytes: int
    capacity_units: float
    capacity_free_units: float
    util_sum: float
    util_reporting: int


@dataclass(frozen=True)
class QueueRow:
    """One queue as of a cycle: pending requests and how long the oldest has waited."""

    queue: str
    pending: int
    oldest_wait_s: float


_Sums = tuple[float, ...]
"""Per (vendor, model): devices, used, memory bytes, free memory bytes, capacity units, free
capacity units, utilisation sum, devices reporting utilisation."""
_NodeSums = tuple[tuple[tuple[str, str], _Sums], ...]


def node_sums(node: NodeState) -> _NodeSums:
    """One node's part of the pool rows, by (vendor, model). A device counts as used when
    anything holds part of it; its free capacity is the fraction of memory nobody holds, times
    its capacity units. A lost device (a node that stopped heartbeating: the snapshot keeps its
    devices, marked lost, for the leases it still accounts for) is no part of the pool, as in
    the working pool's totals and the console's: counted, it showed as free capacity, with its
    last load in the mean, for as long as the node stayed lost."""
    acc: dict[tuple[str, str], list[float]] = {}
    for d in node.devices:
        if d.health == Health.LOST:
            continue
        row = acc.get((d.vendor, d.model))
        if row is None:
            row = acc[(d.vendor, d.model)] = [0.0] * 8
        free_mib = 0 if d.exclusive else d.memory_free_mib
        row[0] += 1
        if d.exclusive or d.holders > 0 or d.memory_free_mib < d.memory_total_mib:
            row[1] += 1
        row[2] += d.memory_total_mib * MIB
        row[3] += free_mib * MIB
        row[4] += d.capacity_units
        row[5] += d.capacity_units * (free_mib / max(d.memory_total_mib, 1))
        if d.util_pct is not None:
            row[6] += d.util_pct / 100
            row[7] += 1
    return tuple((key, tuple(sums)) for key, sums in acc.items())


def _rows(parts: Iterable[_NodeSums]) -> tuple[PoolRow, ...]:
    by_key: dict[tuple[str, str], list[_Sums]] = {}
    for part in parts:
        for key, sums in part:
            by_key.setdefault(key, []).append(sums)
    rows = []
    for (vendor, model), node_rows in sorted(by_key.items()):
        r = [sum(column) for column in zip(*node_rows, strict=True)]
        devices, used, memory, memory_free = (int(x) for x in r[:4])
        units, units_free, util_sum = r[4:7]
        rows.append(
            PoolRow(
                vendor,
                model,
                devices,
                used,
                memory,
                memory_free,
                units,
                units_free,
                util_sum,
                int(r[7]),
            )
        )
    return tuple(rows)


def pool_rows(snapshot: PoolSnapshot) -> tuple[PoolRow, ...]:
    """The pool by vendor and model (:func:`node_sums` of every node, added up)."""
    return _rows(node_sums(node) for node in snapshot.nodes)


class PoolSummary:
    """:func:`pool_rows` of successive snapshots, each node's part kept while the snapshot holds
    the very same node state: the scheduler's snapshot cache replaces only the nodes that
    changed, so a refresh walks the devices of those alone. Walking every device each refresh
    held the event loop for 10-20 ms at 10,000 devices, a stall every admission queued behind;
    where many nodes did change (live load on a busy fleet), the walk yields to the loop every
    ``YIELD_EVERY_NODES`` nodes it sums afresh."""

    YIELD_EVERY_NODES: Final = 128

    def __init__(self) -> None:
        self._parts: dict[str, tuple[NodeState, _NodeSums]] = {}

    async def rows(self, snapshot: PoolSnapshot) -> tuple[PoolRow, ...]:
        """The pool rows of ``snapshot``, equal to ``pool_rows(snapshot)``."""
        kept: dict[str, tuple[NodeState, _NodeSums]] = self._parts
        parts: dict[str, tuple[NodeState, _NodeSums]] = {}
        summed = 0
        for node in snapshot.nodes:
            part = kept.get(node.node_id)
            if part is None or part[0] is not node:
                part = (node, node_sums(node))
                summed += 1
                if summed % self.YIELD_EVERY_NODES == 0:
                    await asyncio.sleep(0)
            parts[node.node_id] = part
        self._parts = parts
        return _rows(part for _, part in parts.values())


class _PoolGauges:
    """A custom collector over the last pool summary (rendered on the scrape thread)."""

    def __init__(self) -> None:
        # Replaced whole by the event loop, never mutated, so the scrape thread needs no lock.
        self.rows: tuple[PoolRow, ...] = ()

    def describe(self) -> Iterable[Metric]:
        """The families, empty: lets the registry reject a duplicate name at registration."""
        return self._families(())

    def collect(self) -> Iterable[Metric]:
        """The families filled from the latest summary."""
        return self._families(self.rows)

    @staticmethod
    def _families(rows: Sequence[PoolRow]) -> list[Metric]:
        labels = ("vendor", "model", "state")
        devices = GaugeMetricFamily(
            "xpupool_pool_devices", "Schedulable devices: total, used, free", labels=labels
        )
        memory = GaugeMetricFamily(
            "xpupool_pool_memory_bytes", "Device memory: total, used, free", labels=labels
        )
        units = GaugeMetricFamily(
            "xpupool_pool_capacity_units",
            "Normalized device capacity: total, used, free",
            labels=labels,
        )
        util = GaugeMetricFamily(
            "xpupool_pool_device_utilization_ratio",
            "Mean live load (0-1) of the devices that report one",
            labels=("vendor", "model"),
        )
        for r in rows:
            for family, total, free in (
                (devices, r.devices, r.devices - r.devices_used),
                (memory, r.memory_bytes, r.memory_free_bytes),
                (units, r.capacity_units, r.capacity_free_units),
            ):
                family.add_metric((r.vendor, r.model, "total"), total)
                family.add_metric((r.vendor, r.model, "used"), total - free)
                family.add_metric((r.vendor, r.model, "free"), free)
            if r.util_reporting:
                util.add_metric((r.vendor, r.model), r.util_sum / r.util_reporting)
        return [devices, memory, units, util]


class SchedulerMetrics:
    """Every series the scheduler exports."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        # The cyclic collector's passes by generation (python_gc_collections_total): its full
        # passes stall every request in flight (``xpupool.bus.lifecycle.freeze_heap``).
        GCCollector(registry=self.registry)
        r = self.registry
        self._pool = _PoolGauges()
        self._pool_summary = PoolSummary()
        r.register(self._pool)
        self.queue_pending = Gauge(
            "xpupool_scheduler_queue_pending_requests",
            "Pending requests per queue as of this replica's last cycle",
            ("queue",),
            registry=r,
        )
        self.queue_oldest = Gauge(
            "xpupool_scheduler_queue_oldest_wait_seconds",
            "How long the oldest pending request of a queue has waited",
            ("queue",),
            registry=r,
        )
        self.fair_share_usage = Gauge(
            "xpupool_scheduler_fair_share_usage_units",
            "Decayed normalized capacity a queue has used (what fair share ranks queues by)",
            ("queue",),
            registry=r,
        )
        self.grants = Counter(
            "xpupool_scheduler_grants", "Reservations committed", ("queue",), registry=r
        )
        self.rejections = Counter(
            "xpupool_scheduler_rejections", "Requests rejected, by reason", ("reason",), registry=r
        )
        self.preemptions = Counter(
            "xpupool_scheduler_preemptions",
            "Leases asked to end so a queue's request can run",
            ("queue",),
            registry=r,
        )
        self.admission_views = Counter(
            "xpupool_scheduler_admission_views",
            "Lone arrivals placed on the kept copy of the ledger and admitted so (kept), or "
            "refused because the ledger had changed since (changed)",
            ("view",),
            registry=r,
        )
        self.carried_reads = Counter(
            "xpupool_scheduler_carried_reads",
            "Change-log reads a commit carried for the next batch (carried), and the batches "
            "that decided on one (used)",
            ("step",),
            registry=r,
        )
        self.grant_latency = Histogram(
            "xpupool_scheduler_submit_to_grant_seconds",
            "From a request's admission to its committed reservation",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.cycle_seconds = Histogram(
            "xpupool_scheduler_cycle_duration_seconds",
            "One scheduling cycle: ledger read, decisions, commits",
            buckets=_CYCLE_BUCKETS,
            registry=r,
        )
        self.cycle_phase_seconds = Histogram(
            "xpupool_scheduler_cycle_phase_seconds",
            "One part of a scheduling cycle: read (the ledger), decide, commit",
            ("phase",),
            buckets=_CYCLE_BUCKETS,
            registry=r,
        )
        # Every reason exists from the start, so a rate over it is 0 rather than no data.
        for reason in JobReason:
            self.rejections.labels(reason.value)
        for view in ("kept", "changed"):
            self.admission_views.labels(view)
        for step in ("carried", "used"):
            self.carried_reads.labels(step)
        for phase in CYCLE_PHASES:
            self.cycle_phase_seconds.labels(phase)
        self._queues: set[str] = set()

    def observe_cycle(self, read_s: float, decide_s: float, commit_s: float) -> None:
        """One cycle that decided jobs: its whole time and each of its phases."""
        self.cycle_seconds.observe(read_s + decide_s + commit_s)
        for phase, seconds in zip(CYCLE_PHASES, (read_s, decide_s, commit_s), strict=True):
            self.cycle_phase_seconds.labels(phase).observe(seconds)

    async def observe_pool(self, snapshot: PoolSnapshot) -> None:
        """Replace the pool summary (called from the event loop, read by scrapes)."""
        self._pool.rows = await self._pool_summary.rows(snapshot)

    def observe_queues(self, rows: Iterable[QueueRow]) -> None:
        """Set the queue gauges from one cycle; a queue with nothing pending reads 0."""
        seen = set()
        for row in rows:
            seen.add(row.queue)
            self.queue_pending.labels(row.queue).set(row.pending)
            self.queue_oldest.labels(row.queue).set(row.oldest_wait_s)
        for queue in self._queues - seen:
            self.queue_pending.labels(queue).set(0)
            self.queue_oldest.labels(queue).set(0)
        self._queues |= seen

    def observe_fair_share(self, usage_units: Mapping[str, float]) -> None:
        """Set each queue's decayed usage from the fair-share history after a cycle."""
        for queue, units in usage_units.items():
            self.fair_share_usage.labels(queue).set(units)

    def admission_view(self, view: str) -> None:
        """Count one admission decided on the kept copy: ``kept`` when the ledger took it,
        ``changed`` when it refused it for a change since."""
        self.admission_views.labels(view).inc()

    def carried_read(self, step: str) -> None:
        """Count a change-log read a commit carried (``carried``) or a batch used (``used``)."""
        self.carried_reads.labels(step).inc()

    def granted(self, queue: str, waited_s: float) -> None:
        """Count one committed reservation and how long its request waited for it. A queue
        first seen granting (on admission, no cycle having seen it wait) reads 0 pending."""
        self.grants.labels(queue).inc()
        self.grant_latency.observe(max(waited_s, 0.0))
        if queue not in self._queues:
            self._queues.add(queue)
            self.queue_pending.labels(queue).set(0)
            self.queue_oldest.labels(queue).set(0)


def queue_rows(waits: Iterable[tuple[str, float]]) -> list[QueueRow]:
    """Per queue: how many pending and the longest wait, from (queue, waited seconds) pairs."""
    acc: dict[str, tuple[int, float]] = {}
    for queue, waited in waits:
        count, oldest = acc.get(queue, (0, 0.0))
        acc[queue] = (count + 1, max(oldest, waited))
    return [QueueRow(q, n, w) for q, (n, w) in sorted(acc.items())]
