"""A lease's lifetime as one span of its job's trace, recorded when the lease has ended.

A lease outlives any process that touched it (the grant, renewals and the end may each be on
another replica), so no process can hold its span open: the span is written once, at the end,
with the ledger's own grant and end times, in the job's trace the lease keeps (as a child of the
span that publishes its ``LeaseEnded``: the holder's release, or the relay's for any other end).
"""

from __future__ import annotations

from opentelemetry import propagate, trace
from opentelemetry.util.types import AttributeValue

from xpupool.ledger import LeaseRecord
from xpupool.obs import spans_recorded

LIFETIME_SPAN = "lease lifetime"


def lifetime_attributes(lease: LeaseRecord) -> dict[str, AttributeValue]:
    """What operators search a lease by: tenant, queue, job, lease, device model, end reason."""
    attributes: dict[str, AttributeValue] = {
        "xpupool.lease_id": lease.lease_id,
        "xpupool.job_id": lease.job_id,
        "xpupool.tenant": lease.tenant,
        "xpupool.queue": lease.queue,
        "xpupool.outcome": "ended",
        "xpupool.reason": lease.end_reason or "",
    }
    models = sorted({s.meta.model for s in lease.slices if s.meta is not None and s.meta.model})
    if models:
        attributes["xpupool.device_model"] = ",".join(models)
    return attributes


def record_lifetime(lease: LeaseRecord) -> None:
    """Write the ended lease's lifetime span (from its grant, or its reservation if it was never
    granted, to its end) in its job's trace (the current one if the lease keeps none)."""
    start_ms = lease.granted_ms or lease.created_ms
    end_ms = lease.ended_ms
    if not start_ms or not end_ms or not spans_recorded():
        return
    span = trace.get_tracer("xpupool.lease_manager").start_span(
        LIFETIME_SPAN,
        context=propagate.extract(lease.trace) if lease.trace else None,
        start_time=start_ms * 1_000_000,
        attributes=lifetime_attributes(lease) | {"xpupool.granted": lease.granted_ms is not None},
    )
    span.end(end_time=max(end_ms, start_ms) * 1_000_000)


__all__ = ["LIFETIME_SPAN", "lifetime_attributes", "record_lifetime"]
