"""Capacity the autoscaler is provisioning, and the pending jobs it was bought for.

The autoscaler publishes ``NodeProvisioning`` (``xpupool.scale.v1.provisioning``) with the job
ids a request answers; each ``NodeReady`` of that request counts one node in, and the entry ends
when all are ready, or once the expected ready time is long past (a provider that never
delivers must not keep jobs waiting as "incoming" forever). While a job is listed here the
scheduler says ``capacity_incoming`` instead of ``insufficient_capacity`` and does not preempt
for it: the hardware on its way will serve it. The events wake a cycle at once; a scheduler
replica that starts after them learns the same from the ledger, where the acting autoscaler
writes the jobs its in-flight scale-ups are for each cycle (``Ledger.incoming_jobs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xpupool.contracts import NodeProvisioning, NodeReady
from xpupool.ledger.ledger import INCOMING_OVERDUE_S

__all__ = ["IncomingCapacity"]


@dataclass(slots=True)
class _Request:
    job_ids: frozenset[str]
    pending_nodes: int
    until: float


@dataclass(slots=True)
class IncomingCapacity:
    """Provisioning requests in flight, by request id (one per scheduler replica)."""

    overdue_s: float = INCOMING_OVERDUE_S
    _requests: dict[str, _Request] = field(default_factory=dict)

    def provisioning(self, event: NodeProvisioning) -> None:
        """A provider was asked for nodes (a replayed event replaces its first copy)."""
        start = event.expected_ready_at or event.at
        self._requests[event.request_id] = _Request(
            frozenset(event.job_ids),
            max(event.count, 1),
            start.timestamp() + self.overdue_s,
        )

    def ready(self, event: NodeReady) -> None:
        """One node of a request is schedulable now."""
        request = self._requests.get(event.request_id or "")
        if request is None:
            return
        request.pending_nodes -= 1
        if request.pending_nodes <= 0:
            del self._requests[event.request_id or ""]

    def jobs(self, now_s: float) -> frozenset[str]:
        """The pending jobs incoming nodes will serve (overdue requests dropped)."""
        for request_id in [r for r, q in self._requests.items() if q.until < now_s]:
            del self._requests[request_id]
        return frozenset(j for q in self._requests.values() for j in q.job_ids)
