"""The lease-manager's Prometheus metrics (its own registry, nothing on the process-wide one).

The lease-manager exports the lease and usage series; the scheduler exports the pool, queue and
decision series, so no series is exported by two services.

- ``xpupool_leases{state}``: live leases and reservations by ledger state, ledger-wide,
  counted by the service's event loop (:meth:`LeaseManagerMetrics.observe_lease_states`, from
  ``Ledger.lease_states``), never on a scrape;
- ``xpupool_lease_ends_total{reason}``: leases ended, by end reason;
- ``xpupool_usage_device_seconds_total{tenant,queue,model}``: device time of ended leases
  (granted to ended, per device held; a host-only lease adds none);
- ``xpupool_outbox_entries{outbox}`` and ``xpupool_outbox_oldest_age_seconds{outbox}``: events
  written by ledger scripts and not yet relayed (a relayed entry is deleted), for the
  scheduler's and the lease-manager's outboxes and the direct one (grants the scheduler
  publishes itself: an entry older than a second there means it could not), ledger-wide like
  the lease gauge;
- ``xpupool_grant_waits_total`` and ``xpupool_grant_copies_total``: later events of a lease that
  waited for its grant to be seen stored, and grants published again as a copy ahead of such an
  event because none was seen within a second (a scheduler stalled between its answer and its
  publish) or the grant watch was down (``grant_watch.StoredGrants``): copies should stay at 0.

Several replicas: the lease and outbox gauges are ledger-wide, so every replica reports the
same values and dashboards take ``max by (state)`` / ``max by (outbox)``; an outbox entry is
relayed by one replica, so the end and usage counters, counted when the ``ended`` entry
becomes a LeaseEnded event, are summed over replicas (a relay retried after a failed publish
may count an end twice: at-least-once, like the event itself).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, GCCollector

from xpupool.contracts import EndReason, LeaseEnded
from xpupool.ledger import LeaseRecord, Ledger
from xpupool.obs.metrics import serve_metrics

__all__ = [
    "OUTBOXES",
    "LeaseManagerMetrics",
    "outbox_lag",
    "serve_metrics",
    "usage_of",
]

UNKNOWN_MODEL: Final = "unknown"
# The outboxes ledger scripts queue events in: each service's (``OutboxRelay``) and the direct
# one (``DirectOutbox``), whose entries should live for milliseconds.
OUTBOXES: Final = ("scheduler", "lease-manager", "direct")


async def outbox_lag(ledger: Ledger, service: str) -> tuple[int, float]:
    """Entries waiting in a service's outbox and the age (s) of the oldest, by Redis's clock
    (stream ids carry the ms they were added at)."""
    stream = ledger.key("outbox", service)
    entries = int(await ledger.redis.xlen(stream))
    if not entries:
        return 0, 0.0
    first: Any = await ledger.redis.xrange(stream, count=1)
    seconds, micros = await ledger.redis.time()
    if not first:
        return entries, 0.0
    raw = first[0][0]
    added_ms = int((raw.decode() if isinstance(raw, bytes) else str(raw)).split("-")[0])
    return entries, max(int(seconds) * 1000 + int(micros) // 1000 - added_ms, 0) / 1000


def usage_of(lease: LeaseRecord) -> dict[str, float]:
    """Device-seconds of an ended lease by device model (granted to ended, per device held)."""
    if lease.granted_ms is None or lease.ended_ms is None:
        return {}
    seconds = max(lease.ended_ms - lease.granted_ms, 0) / 1000
    by_model: dict[str, float] = {}
    for s in lease.slices:
        model = s.meta.model if s.meta is not None else UNKNOWN_MODEL
        by_model[model] = by_model.get(model, 0.0) + seconds
    return by_model


class LeaseManagerMetrics:
    """Every series the lease-manager exports."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        # The cyclic collector's passes by generation (python_gc_collections_total): its full
        # passes stall every request in flight (``xpupool.bus.lifecycle.freeze_heap``).
        GCCollector(registry=self.registry)
        r = self.registry
        self.leases = Gauge(
            "xpupool_leases", "Live leases and reservations by state", ("state",), registry=r
        )
        self.lease_ends = Counter(
            "xpupool_lease_ends", "Leases ended, by end reason", ("reason",), registry=r
        )
        self.usage = Counter(
            "xpupool_usage_device_seconds",
            "Device time of ended leases (granted to ended, per device held)",
            ("tenant", "queue", "model"),
            registry=r,
        )
        self.outbox_entries = Gauge(
            "xpupool_outbox_entries",
            "Outbox entries not yet relayed to NATS",
            ("outbox",),
            registry=r,
        )
        self.outbox_age = Gauge(
            "xpupool_outbox_oldest_age_seconds",
            "Age of the oldest outbox entry not yet relayed (0 when empty)",
            ("outbox",),
            registry=r,
        )
        self.grant_waits = Counter(
            "xpupool_grant_waits",
            "Later lease events that waited for their lease's grant to be seen stored",
            registry=r,
        )
        self.grant_copies = Counter(
            "xpupool_grant_copies",
            "Grants published again ahead of a later event of their lease: none seen stored "
            "in time, or the grant watch down",
            registry=r,
        )
        # Every reason exists from the start, so a rate over it is 0 rather than no data.
        for reason in EndReason:
            self.lease_ends.labels(reason.value)
        self._states: set[str] = set()

    def observe_lease_states(self, counts: Mapping[str, int]) -> None:
        """Set the lease gauge from the live leases counted by state; a state now empty reads
        0."""
        for state in self._states | set(counts):
            self.leases.labels(state).set(counts.get(state, 0))
        self._states |= set(counts)

    def observe_outbox(self, outbox: str, entries: int, oldest_age_s: float) -> None:
        """Set one outbox's lag gauges."""
        self.outbox_entries.labels(outbox).set(entries)
        self.outbox_age.labels(outbox).set(oldest_age_s)

    def observe_events(self, events: Sequence[msgspec.Struct], lease: LeaseRecord | None) -> None:
        """Count the ends among the events relayed for one outbox entry."""
        for event in events:
            if not isinstance(event, LeaseEnded):
                continue
            self.lease_ends.labels(event.reason.value).inc()
            if lease is not None:
                for model, seconds in usage_of(lease).items():
                    self.usage.labels(lease.tenant, lease.queue, model).inc(seconds)
