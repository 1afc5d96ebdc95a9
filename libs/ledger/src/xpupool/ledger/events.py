"""Public events built from ledger records, the same whichever service publishes them.

A grant is published by the lease-manager's outbox relay, or by the scheduler at once when it
granted the job on admission (``pend.lua``'s direct outbox). Both build it here from the lease's
record, so a subscriber cannot tell who sent it and JetStream deduplicates the two by their
``Nats-Msg-Id`` should both ever send it.
"""

from __future__ import annotations

from datetime import UTC, datetime

from xpupool.contracts import AllocationGranted, HostShare
from xpupool.devices.environment import job_environment
from xpupool.ledger.ledger import LeaseRecord


def event_time(ms: int) -> datetime:
    """A ledger clock value (ms since the epoch) as an event's timestamp."""
    return datetime.fromtimestamp(ms / 1000, tz=UTC)


def granted_event(lease: LeaseRecord, expires_ms: int | None = None) -> AllocationGranted:
    """The public grant, with the environment the job must run with; ``expires_ms``: the term
    it was granted with, where the lease has been renewed since (its grant entry keeps it)."""
    slices = [s.to_contract() for s in lease.slices]
    return AllocationGranted(
        job_id=lease.job_id,
        lease_id=lease.lease_id,
        tenant=lease.tenant,
        owner=lease.owner,
        fencing_token=lease.token,
        granted_at=event_time(lease.granted_ms or lease.created_ms),
        expires_at=event_time(expires_ms or lease.expires_ms),
        slices=slices,
        env=job_environment(slices, lease.job_id, lease.lease_id, lease.token),
        host=[
            HostShare(node_id=node_id, cpu_milli=h.cpu_milli, memory_mib=h.memory_mib)
            for node_id, h in sorted(lease.host.items())
        ],
        # The publisher strips it from the operator copy; only the owner's copy carries it.
        lease_secret=lease.secret or None,
    )
