"""Scheduler handlers: plain async functions of (message, dependencies)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime

import msgspec

from xpupool.contracts import (
    JobPending,
    JobRejected,
    JobRequested,
    JobReserved,
    JobTimedOut,
    decoder_for,
)
from xpupool.ledger import Ledger, Reservation, SliceClaim, SliceMeta
from xpupool.obs import get_logger
from xpupool.scheduler.firstfit import Place, Reject, Wait, first_fit
from xpupool.scheduler.settings import SchedulerSettings

PRIORITY_CLASSES = {"low": 100, "normal": 500, "high": 900, "critical": 1000}


def _new_lease_id() -> str:
    return f"lease-{uuid.uuid4().hex}"


@dataclass
class SchedulerDeps:
    """What the scheduler's handlers need."""

    ledger: Ledger
    settings: SchedulerSettings
    new_lease_id: Callable[[], str] = field(default=_new_lease_id)


def _now() -> datetime:
    return datetime.now(UTC)


def pending_score(priority: int, arrival_ms: int) -> float:
    """Lower scores are retried first: higher priority, then earlier arrival."""
    return float(-priority * 10**13 + arrival_ms)


def _reservation(request: JobRequested, place: Place, deps: SchedulerDeps) -> Reservation:
    return Reservation(
        job_id=request.job_id,
        lease_id=deps.new_lease_id(),
        tenant=request.tenant,
        queue=request.queue or request.tenant,
        priority=PRIORITY_CLASSES.get(request.priority, 500),
        owner=request.owner or request.tenant,
        ttl_ms=int(request.lease_ttl_s * 1000),
        hold_ms=int(deps.settings.reservation_hold_s * 1000),
        slices=[
            SliceClaim(
                device_id=c.device.spec.device_id,
                memory_mib=c.memory_mib,
                compute_pct=c.compute_pct,
                whole=c.whole,
                meta=SliceMeta(
                    vendor=c.device.spec.vendor.value,
                    model=c.device.spec.model,
                    index=c.device.spec.index,
                    uuid=c.device.spec.uuid,
                ),
            )
            for c in place.slices
        ],
    )


async def place_job(
    request: JobRequested, deps: SchedulerDeps, from_pending: bool = False
) -> Sequence[msgspec.Struct]:
    """Decide and commit. A commit refused because the snapshot went stale is decided again on
    fresh state; the ledger script, not this function, is what guarantees capacity."""
    log = get_logger()
    last_reason, last_detail = "contention", ""
    for _ in range(deps.settings.commit_attempts):
        decision = first_fit(request, await deps.ledger.nodes())
        if isinstance(decision, Reject):
            if from_pending:
                # The pool shrank under a waiting job: it keeps waiting (max_wait_s bounds it).
                last_reason, last_detail = decision.reason, decision.detail
                break
            return [
                JobRejected(
                    job_id=request.job_id,
                    tenant=request.tenant,
                    field_name=decision.field_name,
                    reason=decision.reason,
                    detail=decision.detail,
                )
            ]
        if isinstance(decision, Wait):
            last_reason, last_detail = decision.reason, decision.detail
            break
        result = await deps.ledger.reserve(_reservation(request, decision, deps))
        if result.ok or result.reason == "job_finished":
            return []
        log.info("commit_refused", reason=result.reason, detail=result.detail)
        last_reason, last_detail = result.reason, result.detail
    if from_pending:
        return []
    return await _park(request, deps, last_reason, last_detail)


async def _park(
    request: JobRequested, deps: SchedulerDeps, reason: str, detail: str
) -> Sequence[msgspec.Struct]:
    priority = PRIORITY_CLASSES.get(request.priority, 500)
    now_ms = await deps.ledger.now_ms()
    result = await deps.ledger.pend(
        request.job_id,
        pending_score(priority, now_ms),
        msgspec.json.encode(request),
        None if request.max_wait_s is None else int(request.max_wait_s * 1000),
        reason,
        detail,
    )
    if not result.ok:
        return []
    since = datetime.fromtimestamp(result.since_ms / 1000, tz=UTC)
    return [
        JobPending(
            job_id=request.job_id, tenant=request.tenant, reason=reason, detail=detail, since=since
        )
    ]


async def schedule_job(request: JobRequested, deps: SchedulerDeps) -> Sequence[msgspec.Struct]:
    """Handle a new job request: ignore a duplicate of a known job, else place or park it."""
    known = await deps.ledger.get_job(request.job_id)
    if known is not None and known.state != "pending":
        return []
    if request.priority not in PRIORITY_CLASSES:
        return [
            JobRejected(
                job_id=request.job_id,
                tenant=request.tenant,
                field_name="priority",
                reason="invalid_request",
                detail=f"unknown priority class; known: {', '.join(PRIORITY_CLASSES)}",
            )
        ]
    return await place_job(request, deps)


def reject_invalid_request(data: bytes, field: str | None, reason: str) -> Sequence[msgspec.Struct]:
    """A request that does not decode is rejected, naming the field, and acknowledged."""
    job_id, tenant = "", None
    try:
        raw = msgspec.json.decode(data)
        if isinstance(raw, dict):
            job_id = str(raw.get("job_id") or "")[:128]
            tenant = str(raw["tenant"])[:128] if raw.get("tenant") else None
    except msgspec.DecodeError:
        reason = f"not JSON: {reason}"
    return [
        JobRejected(
            job_id=job_id, tenant=tenant, field_name=field, reason="invalid_request", detail=reason
        )
    ]


def give_up_request(request: JobRequested, error: BaseException) -> Sequence[msgspec.Struct]:
    """A request whose handling kept failing ends with a rejection rather than silence."""
    return [
        JobRejected(
            job_id=request.job_id,
            tenant=request.tenant,
            reason="internal_error",
            detail=f"scheduling failed repeatedly: {type(error).__name__}",
        )
    ]


_REQUEST_DECODER = decoder_for((JobRequested,))


async def retry_pending(deps: SchedulerDeps) -> Sequence[msgspec.Struct]:
    """One pass over the pending queue: time out the overdue, try the rest in score order."""
    await deps.ledger.time_out_pending()
    events: list[msgspec.Struct] = []
    for _, body in await deps.ledger.pending():
        request = _REQUEST_DECODER.decode(body)
        events.extend(await place_job(request, deps, from_pending=True))
    return events


async def build_events(fields: dict[str, str], ledger: Ledger) -> Sequence[msgspec.Struct]:
    """The event for one scheduler outbox entry."""
    kind = fields.get("kind")
    if kind == "reserved":
        lease = await ledger.get_lease(fields["lease_id"])
        if lease is None:
            return []
        return [
            JobReserved(
                job_id=lease.job_id,
                lease_id=lease.lease_id,
                tenant=lease.tenant,
                owner=lease.owner,
                queue=lease.queue,
                priority=lease.priority,
                lease_ttl_s=lease.ttl_ms / 1000,
                slices=[s.to_contract() for s in lease.slices],
            )
        ]
    if kind == "timed_out":
        request = msgspec.json.decode(fields.get("request") or "{}")
        tenant = request.get("tenant", "") if isinstance(request, dict) else ""
        job = await ledger.get_job(fields["job_id"])
        return [
            JobTimedOut(
                job_id=fields["job_id"],
                tenant=tenant,
                waited_s=int(fields.get("waited_ms") or 0) / 1000,
                last_reason=job.reason if job else "",
            )
        ]
    get_logger().error("outbox_entry_unknown", entry=fields)
    return []
