"""What a scheduling decision says about one job, as span attributes operators search by.

Attributes, never span names: every decision span is ``schedule decision``, and a search for a
tenant's refused jobs filters on ``xpupool.tenant`` and ``xpupool.outcome``.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry.util.types import AttributeValue

from xpupool.contracts import JobRequested
from xpupool.ledger import ScriptResult
from xpupool.obs import continue_trace, spans_recorded
from xpupool.scheduler.domain.decide import Preempt, Reject, Reserve, TimedOut, Wait

DECISION_SPAN = "schedule decision"
CYCLE_SPAN = "schedule cycle"
ADMISSION_SPAN = "schedule admission"
GRANT_SPAN = "publish granted"
"""A grant made on admission, published by the scheduler (the lease-manager relays the rest)."""


def decision_attributes(
    request: JobRequested,
    tenant: str,
    decision: object,
    committed: ScriptResult | None,
) -> dict[str, AttributeValue]:
    """The attributes of one job's decision in a cycle; ``committed`` is the ledger's answer to
    a reservation (None for every other decision)."""
    attributes: dict[str, AttributeValue] = {
        "xpupool.job_id": request.job_id,
        "xpupool.tenant": tenant,
        "xpupool.queue": request.queue,
        "xpupool.outcome": type(decision).__name__.lower(),
    }
    match decision:
        case Reserve(slices=slices, policy=policy):
            attributes["xpupool.policy"] = policy
            models = sorted({s.model for s in slices if s.model})
            if models:
                attributes["xpupool.device_model"] = ",".join(models)
            if committed is not None and committed.ok:
                attributes["xpupool.lease_id"] = committed.lease_id
            elif committed is not None:
                attributes["xpupool.outcome"] = "commit_refused"
                attributes["xpupool.reason"] = committed.reason
        case Preempt(victims=victims):
            attributes["xpupool.reason"] = "preemption_in_progress"
            attributes["xpupool.victims"] = list(victims)
        case Wait(reason=reason) | Reject(reason=reason) | TimedOut(reason=reason):
            attributes["xpupool.reason"] = reason.value
    return attributes


def record_decision(
    request: JobRequested,
    decision: object,
    committed: ScriptResult | None,
    trace: Mapping[str, str],
    decided_in: str,
) -> None:
    """The decision span of one job, in its ``trace``, recording a decision already made and
    committed (``decided_in`` an admission or a cycle); nothing where spans are not recorded."""
    if not spans_recorded():
        return
    attributes = decision_attributes(request, request.tenant or "", decision, committed)
    attributes["xpupool.decided_in"] = decided_in
    with continue_trace(DECISION_SPAN, trace, attributes):
        pass


__all__ = [
    "ADMISSION_SPAN",
    "CYCLE_SPAN",
    "DECISION_SPAN",
    "GRANT_SPAN",
    "decision_attributes",
    "record_decision",
]
