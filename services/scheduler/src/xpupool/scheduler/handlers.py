"""Scheduler handlers: plain async functions of (message, dependencies).

A job request is admitted into the ledger's persistent pending queue; scheduling cycles then
decide every pending request at once with the pure domain (``xpupool.scheduler.domain``) and
commit each reservation with one Lua script that re-checks capacity, health and quota. A decision
made on stale state fails its commit and is decided again in the next cycle, never applied.

Placement on admission: while no job waits, the requests arriving together are decided at once,
on the snapshot the cycles keep, and each is admitted and granted in one script (``pend.lua``
with its placement). The ledger grants it only if that placement still holds and no other job
waits; otherwise the job waits in the queue like any other and a cycle decides it.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Final, NamedTuple

import msgspec
from opentelemetry import trace

from xpupool.bus import (
    EarlyReply,
    InvalidMessage,
    TenantRateLimit,
    delivered_message,
    early_reply,
)
from xpupool.contracts import (
    IDENTIFIER_PATTERN,
    AllocationGranted,
    CancelError,
    CancelJob,
    CancelOutcome,
    CancelReply,
    EndLease,
    EndReason,
    Identifier,
    JobCancelled,
    JobInfo,
    JobList,
    JobPending,
    JobReason,
    JobRejected,
    JobRequested,
    JobReserved,
    JobState,
    JobTimedOut,
    LeaseState,
    ListJobs,
    NodeProvisioning,
    NodeReady,
    PoolShape,
    QueryError,
    SubmitOutcome,
    SubmitReply,
    decoder_for,
)
from xpupool.ledger import (
    VIEW_CHANGED,
    Admission,
    AdmissionLimits,
    ChangeCursor,
    DirectOutbox,
    Growth,
    HostClaim,
    JobRecord,
    Ledger,
    LedgerChanges,
    NodeRecord,
    Reservation,
    ScriptResult,
    SliceClaim,
    SliceMeta,
    UsageClaim,
    new_lease_secret,
)
from xpupool.ledger.events import granted_event
from xpupool.ledger.group_commit import GroupCommit
from xpupool.obs import (
    continue_trace,
    get_logger,
    links_to,
    start_current_span,
    trace_carrier,
)
from xpupool.obs.failpoints import Failpoints
from xpupool.placement.default import DefaultPolicy
from xpupool.scheduler.config_source import ConfigSource
from xpupool.scheduler.domain import (
    Decision,
    FairShareHistory,
    NodeState,
    PendingRequest,
    PlacementPolicy,
    PoolSnapshot,
    Preempt,
    Reject,
    Reserve,
    SchedulerConfig,
    Wait,
    WorkingPool,
    current_usage,
    decide_batch,
    update_history,
)
from xpupool.scheduler.incoming import IncomingCapacity
from xpupool.scheduler.metrics import SchedulerMetrics, queue_rows
from xpupool.scheduler.settings import SchedulerSettings
from xpupool.scheduler.snapshot import UNITS_FIELD, devices_field, growable_nodes
from xpupool.scheduler.snapshot_cache import SnapshotCache
from xpupool.scheduler.tracing import (
    ADMISSION_SPAN,
    CYCLE_SPAN,
    GRANT_SPAN,
    record_decision,
)

ADMITTED = JobReason.QUEUED.value
# pend.lua's answer to a resubmission of a job that was granted (``job_`` and its state).
LEASED = "job_leased"
# pend.lua's answer to a job of this id that went further ('job_' and the job's state): a
# duplicate of a reserved or leased job, or the same request again after the job ended.
_KNOWN_STATES = {f"job_{state.value}": state for state in JobState}
_REQUEST_DECODER = decoder_for((JobRequested,))
_JOB_REASONS = {r.value: r for r in JobReason}


class _JobIdOnly(msgspec.Struct):
    """What a rejection may still take from a request that does not decode: its job id."""

    job_id: Identifier = ""


_VALID_JOB_ID = re.compile(IDENTIFIER_PATTERN)


def job_reason(value: str | None) -> JobReason | None:
    """The contract's reason for a code stored in the ledger (None for none or unknown)."""
    return _JOB_REASONS.get(value or "")


def _new_lease_id() -> str:
    return f"lease-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Arrival:
    """A new request on its way into the ledger: its tenant (the subject's) is set, and the
    trace it came with kept for the steps that continue it."""

    request: JobRequested
    priority: int
    limits: AdmissionLimits
    trace: dict[str, str]
    # A request sent by request/reply: its grant is answered as soon as the batch hands it to
    # the connection (``publish_grants``), in the same write.
    answer: EarlyReply | None = None
    # The stream message it came in (``delivered_message``; '' by request/reply).
    source: str = ""


@dataclass
class SchedulerDeps:
    """What the scheduler's handlers need."""

    ledger: Ledger
    settings: SchedulerSettings
    config: ConfigSource
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    history: FairShareHistory | None = None
    new_lease_id: Callable[[], str] = field(default=_new_lease_id)
    # The default placement policy: kept across cycles because it learns the request shapes.
    default_policy: DefaultPolicy = field(default_factory=DefaultPolicy.create)
    # Policies added to the built-in ones (the trace policies, when configured).
    extra_policies: Sequence[PlacementPolicy] = ()
    # The ledger as of the last cycle, re-read only where the ledger's change log says it changed.
    snapshots: SnapshotCache = field(default_factory=SnapshotCache)
    # Nodes the autoscaler is provisioning and the jobs they are for.
    incoming: IncomingCapacity = field(default_factory=IncomingCapacity)
    # The autoscaler's pool shapes as last read, and the nodes they could add.
    growable: tuple[list[PoolShape], tuple[NodeState, ...]] = ([], ())
    metrics: SchedulerMetrics = field(default_factory=SchedulerMetrics)
    # How many requests the last cycle found pending (the cycle lock is kept while there are;
    # placement on admission waits until a cycle finds none).
    last_pending: int = 0
    # Arrivals admitted in batches (``admit_arrivals``).
    admissions: GroupCommit[Arrival, ScriptResult] = field(init=False)
    # Grants made on admission, published by the scheduler itself (``publish_grants``).
    direct: DirectOutbox = field(init=False)
    # Each tenant's job lists this replica answers (``list_jobs``).
    query_limit: TenantRateLimit = field(init=False)
    # The places where a test makes this process fail on purpose (none armed but in tests).
    failpoints: Failpoints = field(init=False)

    def __post_init__(self) -> None:
        self.admissions = GroupCommit(lambda batch: admit_arrivals(batch, self))
        self.direct = DirectOutbox(self.ledger)
        self.query_limit = TenantRateLimit(
            self.settings.query_rate_per_s, self.settings.query_burst
        )
        self.failpoints = Failpoints.parse(self.settings.failpoints)


def _growable(deps: SchedulerDeps, shapes: list[PoolShape]) -> tuple[NodeState, ...]:
    """The nodes the autoscaler's pools could add (rebuilt only when the shapes change)."""
    if shapes != deps.growable[0]:
        deps.growable = (shapes, growable_nodes(shapes))
    return deps.growable[1]


def _rejected(
    request: JobRequested,
    tenant: str,
    reason: JobReason,
    field: str | None,
    detail: str,
    deps: SchedulerDeps,
) -> JobRejected:
    get_logger().info("request_refused", reason=reason, field=field, tenant=tenant)
    deps.metrics.rejections.labels(reason.value).inc()
    return JobRejected(
        job_id=request.job_id, tenant=tenant, field_name=field, reason=reason, detail=detail
    )


async def admit_job(
    request: JobRequested, deps: SchedulerDeps, *, tenant: str
) -> Sequence[msgspec.Struct]:
    """Put a new request of ``tenant`` (the subject's, authenticated) in the persistent pending
    queue and wake a scheduling cycle (``_admit``); the events to publish are its rejection,
    if it was refused (a grant on arrival is published by the admission batch itself)."""
    rejection, _ = await _admit(request, deps, tenant)
    return [] if rejection is None else [rejection]


async def submit_job(
    request: JobRequested, deps: SchedulerDeps, *, tenant: str
) -> Sequence[msgspec.Struct]:
    """``admit_job`` for a request sent by request/reply (``JOB_SUBMIT``): the same admission,
    answered with where the job stands once the ledger has it (``SubmitReply``).

    A grant is answered by the admission batch itself, a turn of the loop ahead of the grant's
    events (the reply is then not returned here; ``publish_grants``)."""
    answer = early_reply()
    rejection, admitted = await _admit(request, deps, tenant, answer)
    if answer is not None and answer.sent:
        return []
    job_id = request.job_id
    if rejection is not None:
        return [
            rejection,
            SubmitReply(job_id=job_id, outcome=SubmitOutcome.REJECTED, rejected=rejection),
        ]
    assert admitted is not None
    lease = deps.ledger.granted_lease(admitted)
    if lease is not None:
        reply = _granted_reply(granted_event(lease))
    elif admitted.ok:
        reply = SubmitReply(job_id=job_id, outcome=SubmitOutcome.WAITING)
    else:
        reply = SubmitReply(
            job_id=job_id,
            outcome=SubmitOutcome.KNOWN,
            state=_KNOWN_STATES.get(admitted.reason),
            detail=admitted.detail or admitted.reason,
            granted=await _live_grant(job_id, tenant, deps) if admitted.reason == LEASED else None,
        )
    return [reply]


async def _live_grant(job_id: str, tenant: str, deps: SchedulerDeps) -> AllocationGranted | None:
    """The grant of ``tenant``'s job as its lease stands now, while it is live: the owner
    asking again is one that may have missed it (its connection was down when the grant went
    out, and a core NATS subscriber gets nothing of that time), and has no other way to it."""
    job = await deps.ledger.get_job(job_id)
    lease = await deps.ledger.get_lease(job.lease_id) if job and job.lease_id else None
    if lease is None or lease.state != LeaseState.ACTIVE.value or lease.tenant != tenant:
        return None
    return granted_event(lease)


def _granted_reply(grant: AllocationGranted) -> SubmitReply:
    return SubmitReply(job_id=grant.job_id, outcome=SubmitOutcome.GRANTED, granted=grant)


def reject_invalid_submit(invalid: InvalidMessage) -> Sequence[msgspec.Struct]:
    """A submitted request that does not decode: the rejection ``reject_invalid_request`` gives,
    published, and the same as the reply."""
    rejections = reject_invalid_request(invalid)
    return [
        *rejections,
        *(
            SubmitReply(job_id=r.job_id, outcome=SubmitOutcome.REJECTED, rejected=r)
            for r in rejections
            if isinstance(r, JobRejected)
        ),
    ]


async def _admit(
    request: JobRequested, deps: SchedulerDeps, tenant: str, answer: EarlyReply | None = None
) -> tuple[JobRejected | None, ScriptResult | None]:
    """Admit a new request of ``tenant``: its rejection if it was refused, else the ledger's
    answer (granted on arrival, waiting, or a duplicate of a job that went further).

    Refused at once: a payload naming another tenant, a queue the tenant may not charge, and a
    tenant over its rate or pending limits (checked atomically in the ledger, across replicas).
    The job id is the idempotency key, whatever the transport did: the same request again (a
    retry) is ignored while its job waits and gets nothing new once it went further (its one
    outcome is on its way or out; by request/reply it is answered ``known``, with where the job
    stands); another request under a used id (a job's that waits, runs or has ended, or another
    tenant's) is rejected ``duplicate_job``, saying where that job stands or how it ended.
    """
    if request.tenant is not None and request.tenant != tenant:
        return _rejected(
            request,
            tenant,
            JobReason.TENANT_MISMATCH,
            "tenant",
            f"sent on tenant {tenant!r}'s subject but names another tenant",
            deps,
        ), None
    config = deps.config.current()
    if not config.may_charge(tenant, request.queue):
        return _rejected(
            request,
            tenant,
            JobReason.QUEUE_NOT_ALLOWED,
            "queue",
            f"tenant {tenant!r} may not charge queue {request.queue!r}",
            deps,
        ), None
    request = msgspec.structs.replace(request, tenant=tenant)
    limits = config.limits_for(tenant)
    arrival = Arrival(
        request,
        config.priority_value(request.priority) or 0,
        AdmissionLimits(limits.rate_per_s, limits.burst, limits.max_pending),
        trace_carrier(),
        answer,
        delivered_message(),
    )
    admitted = await deps.admissions.submit(arrival)
    if not admitted.ok:
        refused = job_reason(admitted.reason)
        if refused in (
            JobReason.RATE_LIMITED,
            JobReason.TOO_MANY_PENDING,
            JobReason.DUPLICATE_JOB,
        ):
            return _rejected(request, tenant, refused, None, admitted.detail, deps), admitted
    # Not ok otherwise: a duplicate of a job that went further, whose outcome is already out.
    return None, admitted


async def admit_arrivals(arrivals: Sequence[Arrival], deps: SchedulerDeps) -> list[ScriptResult]:
    """Admit a batch of new requests in one ledger round trip, placing those that fit at once
    (``place_on_arrival``); a cycle is woken for any that wait.

    The batch is one span: in the job's trace when it holds one job, else a trace of its own
    that links each job's (as a cycle's span does)."""
    attributes = {"xpupool.arrivals": len(arrivals)}
    if len(arrivals) == 1:
        span = continue_trace(ADMISSION_SPAN, arrivals[0].trace, attributes)
    else:
        span = start_current_span(
            trace.get_tracer("xpupool.scheduler"),
            ADMISSION_SPAN,
            links=lambda: links_to([a.trace for a in arrivals]),
            attributes=attributes,
        )
    with span:
        return await _admit_arrivals(arrivals, deps)


def _admissions(
    arrivals: Sequence[Arrival],
    placements: Mapping[str, tuple[Reserve, Reservation]],
    view: ChangeCursor | None,
    follows_feed: bool,
) -> list[Admission]:
    admissions = []
    offered: set[str] = set()
    for a in arrivals:
        job_id = a.request.job_id
        # A placement was decided for the first request of its job id in the batch
        # (``place_on_arrival``) and goes with that one only: a duplicate of the id (a
        # resubmission, or another tenant's request with the same id) is admitted after it
        # like any duplicate, and is never offered a placement made for another request.
        placed = placements.get(job_id) if job_id not in offered else None
        offered.add(job_id)
        admissions.append(
            Admission(
                job_id,
                a.priority,
                # Dicts (labels) in sorted order: the ledger fingerprints this encoding to tell
                # a retry of the same request from another request under a used job id.
                msgspec.json.encode(a.request, order="deterministic"),
                None if a.request.max_wait_s is None else int(a.request.max_wait_s * 1000),
                ADMITTED,
                tenant=a.request.tenant or "",
                limits=a.limits,
                trace=a.trace,
                placement=None if placed is None else placed[1],
                placement_view=None if placed is None else view,
                caller_follows_feed=follows_feed,
                source=a.source,
            )
        )
    return admissions


async def _admit_arrivals(arrivals: Sequence[Arrival], deps: SchedulerDeps) -> list[ScriptResult]:
    placements, view = await place_on_arrival(arrivals, deps)
    follows_feed = deps.snapshots.follows_feed
    results = await _commit(arrivals, _admissions(arrivals, placements, view, follows_feed), deps)
    if view is not None:
        changed = any(r.reason == VIEW_CHANGED for r in results)
        deps.metrics.admission_view("changed" if changed else "kept")
        if changed:
            # Decided on a copy the ledger has moved past; nothing was written (not even the
            # admission): decided again, on a read, as any batch is.
            placements, _ = await place_on_arrival(arrivals, deps, kept=False)
            admissions = _admissions(arrivals, placements, None, follows_feed)
            results = await _commit(arrivals, admissions, deps)
    waiting = False
    for arrival, result in zip(arrivals, results, strict=True):
        placed = placements.pop(arrival.request.job_id, None)
        granted = result.ok and result.outcome == "granted"
        if placed is not None:
            decision = placed[0]
            if granted:
                deps.metrics.granted(decision.queue, 0.0)
            # A placement the ledger did not take is a refused commit: the job waits instead.
            committed = result if granted else ScriptResult(ok=False, reason=result.reason)
            record_decision(arrival.request, decision, committed, arrival.trace, "admission")
        waiting = waiting or (result.ok and not granted)
    if waiting:
        deps.last_pending = max(deps.last_pending, 1)
        deps.wake.set()
    return results


async def _commit(
    arrivals: Sequence[Arrival], admissions: Sequence[Admission], deps: SchedulerDeps
) -> list[ScriptResult]:
    """Commit a batch's admissions and publish the grants they made.

    Under load (more requests arrived meanwhile, or this batch followed another at once: the
    next batch, which will place on arrival too, is on its way), the change log is read in the
    same round trip, right after the admissions (``SnapshotCache.read_along``). That batch then
    decides on it (``recent_pool``) instead of reading first: a round trip less on the way of
    every batch under load. The read is applied after the grants are out."""

    async def settle(results: list[ScriptResult]) -> None:
        deps.failpoints.reached("scheduler.admission_committed")
        for result in results:
            if result.change_seq:
                deps.snapshots.own_change(result.change_seq)
        await publish_grants(arrivals, results, deps)
        # One turn of the loop: the connection's flusher writes the grants (and the replies to
        # their requests) now, not after this batch's bookkeeping and whatever else is ready.
        await asyncio.sleep(0)

    if not _reads_along(deps):
        results = await deps.ledger.admit_many(admissions)
        await settle(results)
        return results

    async def commit(
        cursor: ChangeCursor | None, max_records: int, known: Mapping[str, NodeRecord]
    ) -> tuple[list[ScriptResult], LedgerChanges | None]:
        return await deps.ledger.admit_and_read(admissions, cursor, max_records, known)

    deps.metrics.carried_read("carried")
    return await deps.snapshots.read_along(deps.ledger, deps.config.current(), commit, settle)


def _reads_along(deps: SchedulerDeps) -> bool:
    """Whether this batch's commit reads the change log for the next one: requests wait for it,
    or this batch itself followed another at once (under load the next one comes within a
    millisecond or two), and it will place them on arrival (on the kept copy's cache)."""
    admissions = deps.admissions
    return (
        (admissions.waiting > 0 or admissions.following)
        and deps.settings.decide_on_kept_copy
        and _places_on_arrival(deps)
    )


def _places_on_arrival(deps: SchedulerDeps) -> bool:
    """Whether new requests are placed as they are admitted: it is on, and no job waits (the
    ledger would queue them behind it anyway)."""
    settings = deps.settings
    return settings.place_on_admission and settings.grant_at_reserve and not deps.last_pending


async def publish_grants(
    arrivals: Sequence[Arrival], results: Sequence[ScriptResult], deps: SchedulerDeps
) -> None:
    """Publish the grants this batch's admissions made, straight from their scripts' answers
    (``DirectOutbox``), each in its job's trace: the lease-manager's relay is not in the way.

    The grants submitted by request/reply are answered first, and the answers written (a
    turn of the loop, for the connection's flusher) before the events are encoded and sent:
    the answer carries the whole grant, which the ledger holds already, and it no longer waits
    behind the events' encoding and JetStream's storing of them (bench/e2e/PROFILE.md). A
    holder acting on it at once cannot have a later event of its lease stored ahead of the
    grant: until this outbox confirms the grant's entry, the lease-manager publishes such an
    event only once JetStream holds the grant (``StoredGrants``), or after a copy of it.
    """
    granted: list[tuple[Arrival, str, AllocationGranted]] = []
    for arrival, result in zip(arrivals, results, strict=True):
        lease = deps.ledger.granted_lease(result)
        if lease is None:
            continue
        event = granted_event(lease)
        granted.append((arrival, result.entry, event))
        if arrival.answer is None:
            continue
        try:
            await arrival.answer.send(_granted_reply(event))
        except Exception as error:  # noqa: BLE001  (the grant stands; its event is published)
            get_logger().warning("submit_reply_failed", job=event.job_id, error=repr(error))
    if any(arrival.answer is not None for arrival, _, _ in granted):
        await asyncio.sleep(0)  # the connection's flusher writes the answers now
    for arrival, entry, event in granted:
        with continue_trace(GRANT_SPAN, arrival.trace, {"xpupool.lease_id": event.lease_id}):
            await deps.direct.publish(entry, [event])
    if granted:
        deps.failpoints.reached("scheduler.grants_published")


async def place_on_arrival(
    arrivals: Sequence[Arrival], deps: SchedulerDeps, *, kept: bool = True
) -> tuple[dict[str, tuple[Reserve, Reservation]], ChangeCursor | None]:
    """Where each new request would go now, by job id, for those that fit: decided together
    on the cycles' snapshot by the same ``decide_batch`` a cycle runs, as if they were all that
    waits. Nothing is decided while jobs wait (the ledger would queue these behind them anyway)
    or when placement on admission is off; a failure here only leaves the requests to a cycle.

    A lone arrival is decided on the kept copy without reading the ledger first when the change
    feed announced nothing since the last read (``SnapshotCache.kept_pool``; not with
    ``kept=False``); the view it was decided on is returned with the placements, and the ledger
    refuses the admission, writing nothing, if anything changed since (``VIEW_CHANGED``), so a
    placement taken is the one a read would have given. (A batch of several is read for: each
    admission of the batch changes the view the next one would be checked on.) Under load a
    batch decides on the read the previous batch's commit carried, before all else, when there
    is one from the last few milliseconds (``SnapshotCache.recent_pool``; as on a read of its
    own, without a view to check: at that rate a release between the read and the commit is
    likely, and the check would refuse the placement); a batch reads for itself when there is
    neither.
    """
    settings = deps.settings
    if not _places_on_arrival(deps):
        return {}, None
    view = None
    try:
        config = deps.config.current()
        # The first request of each job id is the one placed: it is admitted first, and the
        # ledger treats the ones after it as its duplicates (``_admissions``).
        unique: dict[str, JobRequested] = {}
        for a in arrivals:
            unique.setdefault(a.request.job_id, a.request)
        # Under load, the read the last commit carried (a view check would refuse what a
        # release meanwhile made stale); else, for a lone arrival, the kept copy; else a read.
        recent = (
            await deps.snapshots.recent_pool(config)
            if kept and settings.decide_on_kept_copy
            else None
        )
        copy = (
            await deps.snapshots.kept_pool(config)
            if recent is None and kept and len(unique) == 1 and settings.decide_on_kept_copy
            else None
        )
        if recent is not None:
            _, now_ms, pool = recent
            deps.metrics.carried_read("used")
        elif copy is not None:
            _, now_ms, pool, view = copy
        else:
            _, now_ms, pool = await deps.snapshots.read_pool(deps.ledger, config)
        pending = [PendingRequest(request, now_ms / 1000) for request in unique.values()]
        decisions = _decide(deps, pending, pool, config, growable=deps.growable[1])
        memory_total = device_memory(pool, (d for _, d in decisions))
    except Exception as error:  # noqa: BLE001  (the cycle decides them instead)
        get_logger().warning("placement_on_admission_failed", error=repr(error))
        return {}, None
    placements = {
        job_id: (
            decision,
            reservation_of(
                decision,
                deps.new_lease_id(),
                memory_total,
                config,
                settings.reservation_hold_s,
                new_lease_secret(),
            ),
        )
        for job_id, decision in decisions
        if isinstance(decision, Reserve)
    }
    return placements, view


_CANCEL_ERRORS: Final = {e.value: e for e in CancelError}


async def cancel_job(
    command: CancelJob, deps: SchedulerDeps, *, tenant: str
) -> Sequence[msgspec.Struct]:
    """Cancel one of ``tenant``'s jobs (the subject's, authenticated): the ledger takes a
    waiting job out of the queue, or asks the lease-manager to end a granted one's lease, and
    queues the resulting event or command in the outbox in the same step."""
    result = await deps.ledger.cancel_job(command.job_id, tenant)
    if result.ok:
        deps.wake.set()  # a cancelled job may have been what others waited behind
        return [CancelReply(ok=True, job_id=command.job_id, outcome=CancelOutcome(result.outcome))]
    error = _CANCEL_ERRORS.get(result.reason, CancelError.INTERNAL_ERROR)
    detail = "" if error is CancelError.UNKNOWN_JOB else result.detail
    return [CancelReply(ok=False, job_id=command.job_id, error=error, detail=detail)]


_JOB_STATES: Final = {s.value: s for s in JobState}


async def list_jobs(
    command: ListJobs, deps: SchedulerDeps, *, tenant: str
) -> Sequence[msgspec.Struct]:
    """``tenant``'s latest jobs (the subject's, authenticated), newest first, each with its
    state and, while it waits, why."""
    if (refusal := deps.query_limit.refusal(tenant)) is not None:
        return [JobList(ok=False, error=QueryError.RATE_LIMITED, detail=refusal)]
    records = await deps.ledger.tenant_jobs(tenant, command.limit)
    jobs = [
        JobInfo(
            job_id=r.job_id,
            state=_JOB_STATES.get(r.state, JobState.ENDED),
            reason=job_reason(r.reason) if r.state != "leased" else None,
            detail=r.detail[:256] if r.state != "leased" else "",
            since=datetime.fromtimestamp(r.since_ms / 1000, tz=UTC) if r.since_ms else None,
            lease_id=r.lease_id,
        )
        for r in records
    ]
    return [JobList(ok=True, jobs=jobs)]


def reject_invalid_list(invalid: InvalidMessage) -> Sequence[msgspec.Struct]:
    """A job query that does not decode gets an error reply naming the field (the bus's
    ``invalid_request`` / ``payload_too_large`` codes are the contract's error values)."""
    return [JobList(ok=False, error=QueryError(invalid.code), detail=invalid.explained)]


def list_reply_too_large(reply: msgspec.Struct) -> JobList:
    """What a requester gets instead of a list that would not fit its server's max_payload."""
    return JobList(ok=False, error=QueryError.INTERNAL_ERROR, detail="reply too large")


def reject_invalid_cancel(invalid: InvalidMessage) -> Sequence[msgspec.Struct]:
    """A cancel that does not decode gets an error reply naming the field."""
    return [
        CancelReply(ok=False, job_id="", error=CancelError(invalid.code), detail=invalid.explained)
    ]


def cancel_reply_too_large(reply: msgspec.Struct) -> CancelReply:
    """What a requester gets instead of a reply that would not fit its server's max_payload."""
    return CancelReply(ok=False, job_id="", error=CancelError.INTERNAL_ERROR, detail="too large")


def submit_reply_too_large(reply: msgspec.Struct) -> SubmitReply | None:
    """A submit reply that would not fit the requester's max_payload, without the event it
    carries (which is published as well)."""
    if not isinstance(reply, SubmitReply):
        return None
    return SubmitReply(
        job_id=reply.job_id,
        outcome=reply.outcome,
        detail="too large for a reply: the event on the tenant's subjects has it",
    )


def reject_invalid_request(invalid: InvalidMessage) -> Sequence[msgspec.Struct]:
    """A request that does not decode is rejected to the tenant whose subject sent it, naming the
    field, and acknowledged. Nothing of the payload is echoed beyond a valid job id."""
    job_id = ""
    if invalid.code != "payload_too_large":
        with contextlib.suppress(msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            job_id = msgspec.json.decode(invalid.data, type=_JobIdOnly).job_id
    if not job_id and len(invalid.msg_id) <= 128 and _VALID_JOB_ID.fullmatch(invalid.msg_id):
        job_id = invalid.msg_id  # clients publish with Nats-Msg-Id = job_id
    reason = (
        JobReason.PAYLOAD_TOO_LARGE
        if invalid.code == "payload_too_large"
        else JobReason.INVALID_REQUEST
    )
    return [
        JobRejected(
            job_id=job_id,
            tenant=invalid.params.get("tenant"),
            field_name=invalid.field,
            reason=reason,
            detail=invalid.detail,
        )
    ]


def give_up_request(request: JobRequested, error: BaseException) -> Sequence[msgspec.Struct]:
    """A request whose admission kept failing ends with a rejection rather than silence."""
    return [
        JobRejected(
            job_id=request.job_id,
            tenant=request.tenant,
            reason=JobReason.INTERNAL_ERROR,
            detail=f"admission failed repeatedly: {type(error).__name__}",
        )
    ]


# ---- the scheduling cycle -------------------------------------------------------------------


def device_memory(pool: WorkingPool, decisions: Iterable[Decision]) -> dict[str, int]:
    """The visible memory of each device the reservations among ``decisions`` take, for their
    quota claims."""
    return {
        s.device_id: pool.devices[pool.dev_index[s.device_id]].memory_total_mib
        for d in decisions
        if isinstance(d, Reserve)
        for s in d.slices
        if s.device_id in pool.dev_index
    }


def _usage_claims(
    reserve: Reserve, memory_total: Mapping[str, int], config: SchedulerConfig
) -> list[UsageClaim]:
    """Quota counters the reservation adds to, for the queue and each ancestor, with limits.

    A host-only reservation (no slices) uses no quota, so it adds to no counter.
    """
    if not reserve.slices:
        return []
    per_model: dict[str, float] = {}
    for s in reserve.slices:
        total = max(memory_total.get(s.device_id, 0), 1)
        fraction = 1.0 if s.whole else max(s.compute_pct / 100, s.memory_mib / total)
        per_model[s.model] = per_model.get(s.model, 0.0) + fraction
    claims = []
    for name in config.path(reserve.queue):
        queue = config.queue(name)
        limit_units = queue.limit_units if queue and queue.limit_units is not None else None
        limits = {model: queue.limit_devices.get(model) if queue else None for model in per_model}
        if queue is not None and not queue.over_quota:
            # A queue that may not borrow stops at its guarantee (``quota._within_guarantee``:
            # a model's device guarantee where it has one, else the units guarantee). The
            # ledger checks it with the limits, in the grant's step: a decision on a stale
            # snapshot (a peer replica's, or a placement on arrival) must not pass it either.
            for model in per_model:
                guaranteed = queue.guaranteed_devices.get(model)
                if guaranteed is not None:
                    limits[model] = _lower(limits[model], guaranteed)
                else:
                    limit_units = _lower(limit_units, queue.guaranteed_units)
        claims.append(
            UsageClaim(
                name,
                UNITS_FIELD,
                reserve.capacity_units,
                -1.0 if limit_units is None else limit_units,
            )
        )
        for model, count in per_model.items():
            limit = limits[model]
            claims.append(
                UsageClaim(name, devices_field(model), count, -1.0 if limit is None else limit)
            )
    return claims


def _lower(limit: float | None, ceiling: float) -> float:
    """The lower of a limit (None: none) and a ceiling."""
    return ceiling if limit is None else min(limit, ceiling)


def reservation_of(
    reserve: Reserve,
    lease_id: str,
    memory_total: Mapping[str, int],
    config: SchedulerConfig,
    hold_s: float,
    secret: str = "",
) -> Reservation:
    """The ledger reservation for a domain decision (granted at once with ``secret``)."""
    return Reservation(
        secret=secret,
        job_id=reserve.job_id,
        lease_id=lease_id,
        tenant=reserve.tenant,
        queue=reserve.queue,
        priority=reserve.priority,
        owner=reserve.owner,
        ttl_ms=int(reserve.lease_ttl_s * 1000),
        hold_ms=int(hold_s * 1000),
        max_runtime_ms=0 if reserve.max_runtime_s is None else int(reserve.max_runtime_s * 1000),
        idle_after_ms=0 if reserve.idle_reclaim_s is None else int(reserve.idle_reclaim_s * 1000),
        slices=[
            SliceClaim(
                device_id=s.device_id,
                memory_mib=s.memory_mib,
                compute_pct=s.compute_pct,
                whole=s.whole,
                meta=SliceMeta(
                    vendor=s.vendor.value,
                    model=s.model,
                    index=s.index,
                    uuid=s.uuid,
                    enforced=s.enforced,
                ),
            )
            for s in reserve.slices
        ],
        host={
            h.node_id: HostClaim(h.cpu_milli, h.memory_mib)
            for h in reserve.host
            if h.cpu_milli or h.memory_mib
        },
        usage=_usage_claims(reserve, memory_total, config),
    )


async def _waiting(
    job: JobRecord,
    request: JobRequested,
    reason: JobReason,
    detail: str,
    deps: SchedulerDeps,
    nominated: bool | None = None,
) -> list[msgspec.Struct]:
    """Record a wait; publish JobPending only when the reason changed (not every cycle), and
    never for a job that ended since the cycle listed it (its terminal event is out)."""
    if reason == job.reason and detail == job.detail and nominated is None:
        return []
    noted = await deps.ledger.note_pending(job.job_id, reason, detail, nominated)
    if not noted or reason == job.reason:
        return []
    since = (job.since_ms or 0) / 1000
    return [
        JobPending(
            job_id=job.job_id,
            tenant=request.tenant or "",
            reason=reason,
            detail=detail,
            since=datetime.fromtimestamp(since, tz=UTC),
        )
    ]


def _decide(
    deps: SchedulerDeps,
    pending: Sequence[PendingRequest],
    pool: WorkingPool,
    config: SchedulerConfig,
    *,
    incoming: frozenset[str] = frozenset(),
    growable: Sequence[NodeState] = (),
) -> list[tuple[str, Decision]]:
    """``decide_batch`` with the scheduler's policies on the pool the snapshot cache keeps, the
    batch's decisions taken back out of it afterwards (``SnapshotCache.deciding``); the last
    one is never put in (``apply_last``), since nothing is decided after it."""
    # The learned default (kept across cycles) takes the classic ``xpupool`` policy's place.
    registry = deps.default_policy.cycle_registry(config.placement, deps.extra_policies)
    with deps.snapshots.deciding(pool) as settle:
        return settle(
            decide_batch(
                pending,
                pool,
                config,
                history=deps.history,
                policies=registry,
                incoming=incoming,
                growable=growable,
                apply_last=False,
            )
        )


async def schedule_cycle(deps: SchedulerDeps) -> Sequence[msgspec.Struct]:
    """Decide every pending request against one ledger snapshot and commit the outcomes."""
    ledger = deps.ledger
    started = time.perf_counter()
    config = deps.config.current()
    # The waiting jobs, the pool and what the autoscaler could add are read side by side (each
    # on a connection of its own): a cycle waits for the longest of the three round trips, not
    # for each in turn. With no job waiting the pool read only brought the kept copy up to date.
    jobs, (snapshot, now_ms, pool), growth = await asyncio.gather(
        ledger.pending_jobs(deps.settings.batch_limit, time_out_first=True),
        deps.snapshots.read_pool(ledger, config),
        ledger.growth(),
    )
    deps.last_pending = len(jobs)
    if not jobs:
        deps.metrics.observe_queues(())
        return []
    # One cycle serves many jobs: its span links each job's trace rather than joining one, and
    # each job's decision span is a child of that job's trace.
    with start_current_span(
        trace.get_tracer("xpupool.scheduler"),
        CYCLE_SPAN,
        links=lambda: links_to([job.trace for _, job in jobs]),
        attributes={"xpupool.pending": len(jobs)},
    ):
        return await _decide_and_commit(
            deps, jobs, config, _Read(snapshot, now_ms, pool, growth), started
        )


class _Read(NamedTuple):
    """What a cycle decides on besides the waiting jobs."""

    snapshot: PoolSnapshot
    now_ms: int
    pool: WorkingPool
    """The working pool, kept across cycles and admission batches (``SnapshotCache``)."""
    growth: Growth


async def _decide_and_commit(
    deps: SchedulerDeps,
    jobs: list[tuple[bytes | str, JobRecord]],
    config: SchedulerConfig,
    inputs: _Read,
    started: float,
) -> Sequence[msgspec.Struct]:
    ledger, log = deps.ledger, get_logger()
    snapshot, now_ms, pool, growth = inputs
    # What the autoscaler could add, and the jobs its in-flight scale-ups are for.
    shapes, incoming = growth.shapes, growth.incoming(snapshot.now_s)

    records: dict[str, tuple[JobRecord, JobRequested]] = {}
    pending = []
    # Its tenant may charge the queue was checked on arrival; a reload of the queue file may
    # have taken the queue away since, and a waiting job is decided under the file in force.
    withdrawn: list[tuple[str, Decision]] = []
    for body, job in jobs:
        request = _REQUEST_DECODER.decode(body)
        records[job.job_id] = (job, request)
        tenant = request.tenant or ""
        if not config.may_charge(tenant, request.queue):
            detail = f"tenant {tenant!r} may no longer charge queue {request.queue!r}"
            withdrawn.append(
                (job.job_id, Reject(job.job_id, JobReason.QUEUE_NOT_ALLOWED, "queue", detail))
            )
            continue
        pending.append(
            PendingRequest(
                request,
                (job.since_ms or now_ms) / 1000,
                job.nominated,
                job.reason if job.reason != ADMITTED else "",
            )
        )
    read = time.perf_counter()
    deps.metrics.observe_queues(
        queue_rows(
            (
                config.resolve_queue(p.request.tenant or "", p.request.queue) or "unresolved",
                snapshot.now_s - p.enqueued_at_s,
            )
            for p in pending
        )
    )
    # The usage the pool starts with (before decide_batch applies the cycle's decisions) is
    # what the fair-share history folds in.
    usage = current_usage(pool)
    decisions = (
        _decide(
            deps,
            pending,
            pool,
            config,
            incoming=deps.incoming.jobs(snapshot.now_s) | incoming,
            growable=_growable(deps, shapes),
        )
        + withdrawn
    )
    memory_total = device_memory(pool, (d for _, d in decisions))
    deps.history = update_history(
        deps.history, usage, snapshot.now_s, config.fair_share.half_life_s
    )
    deps.metrics.observe_fair_share({q: u.units for q, u in deps.history.usage.items()})

    decided = time.perf_counter()

    # Commit what changes the ledger first, in decision order (the order the domain applied
    # them in); the bookkeeping of waiting jobs can follow without holding up any grant.
    # Reservations go in one round trip (each still its own script, in decision order).
    reserves = [(job_id, d) for job_id, d in decisions if isinstance(d, Reserve)]
    results = await ledger.reserve_many(
        [
            reservation_of(
                d,
                deps.new_lease_id(),
                memory_total,
                config,
                deps.settings.reservation_hold_s,
                new_lease_secret() if deps.settings.grant_at_reserve else "",
            )
            for _, d in reserves
        ]
    )
    deps.failpoints.reached("scheduler.cycle_committed")
    for (job_id, reserve), result in zip(reserves, results, strict=True):
        if result.ok:
            since_ms = records[job_id][0].since_ms
            waited_s = (now_ms - since_ms) / 1000 if since_ms is not None else 0.0
            deps.metrics.granted(reserve.queue, waited_s)
        if not result.ok and result.reason != "job_finished":
            log.info("commit_refused", job_id=job_id, reason=result.reason, detail=result.detail)
            deps.wake.set()  # decide again on fresh state
    committed = {job_id: result for (job_id, _), result in zip(reserves, results, strict=True)}
    for job_id, decision in decisions:
        job, request = records[job_id]
        record_decision(request, decision, committed.get(job_id), job.trace, "cycle")
    decisions.sort(key=lambda item: not isinstance(item[1], Reserve | Preempt))
    events: list[msgspec.Struct] = []
    for job_id, decision in decisions:
        job, request = records[job_id]
        match decision:
            case Reserve():
                pass  # committed above
            case Preempt(victims=victims, detail=detail):
                deps.metrics.preemptions.labels(decision.reserve.queue).inc(len(victims))
                for lease_id in victims:
                    # The EndLease command leaves through the outbox, atomically with the mark.
                    await ledger.request_preemption(
                        lease_id, job_id, int(config.preemption.grace_s * 1000)
                    )
                events.extend(
                    await _waiting(
                        job,
                        request,
                        JobReason.PREEMPTION_IN_PROGRESS,
                        detail,
                        deps,
                        nominated=True,
                    )
                )
            case Wait(reason=reason, detail=detail):
                events.extend(await _waiting(job, request, reason, detail, deps))
            case Reject(reason=reason, field=field, detail=detail):
                await ledger.drop_pending(job_id, reason.value, field, detail)
                deps.metrics.rejections.labels(reason.value).inc()
            case _:
                pass  # TimedOut: the ledger's own deadline ends it atomically (time_out_pending)
    read_s, decide_s, commit_s = read - started, decided - read, time.perf_counter() - decided
    log.info(
        "scheduling_cycle",
        pending=len(pending),
        outcomes=dict(Counter(type(d).__name__ for _, d in decisions)),
        read_s=round(read_s, 4),
        decide_s=round(decide_s, 4),
        commit_s=round(commit_s, 4),
    )
    deps.metrics.observe_cycle(read_s, decide_s, commit_s)
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
    request = msgspec.json.decode(fields.get("request") or "{}")
    tenant = request.get("tenant", "") if isinstance(request, dict) else ""
    if kind == "end_lease":
        if fields.get("reason") == EndReason.RELEASED.value:  # a cancel by the lease's tenant
            return [
                EndLease(
                    lease_id=fields["lease_id"],
                    reason=EndReason.RELEASED,
                    detail=fields.get("detail", "")[:256],
                    requested_by=f"tenant/cancel/{fields.get('job_id', '')}",
                )
            ]
        return [
            EndLease(
                lease_id=fields["lease_id"],
                reason=EndReason.PREEMPTED,
                detail=f"preempted for {fields.get('job_id', '')}",
                grace_s=int(fields.get("grace_ms") or 0) / 1000,
                requested_by=f"scheduler/{fields.get('job_id', '')}",
            )
        ]
    if kind == "cancelled":
        return [
            JobCancelled(
                job_id=fields["job_id"],
                tenant=tenant,
                waited_s=int(fields.get("waited_ms") or 0) / 1000,
            )
        ]
    if kind == "timed_out":
        job = await ledger.get_job(fields["job_id"])
        return [
            JobTimedOut(
                job_id=fields["job_id"],
                tenant=tenant,
                waited_s=int(fields.get("waited_ms") or 0) / 1000,
                last_reason=job_reason(job.reason) if job else None,
            )
        ]
    if kind == "rejected":
        return [
            JobRejected(
                job_id=fields["job_id"],
                tenant=tenant or None,
                field_name=fields.get("field") or None,
                reason=job_reason(fields.get("reason")) or JobReason.INTERNAL_ERROR,
                detail=fields.get("detail", "")[:1024],
            )
        ]
    get_logger().error("outbox_entry_unknown", entry=fields)
    return []


def wake_for_capacity(deps: SchedulerDeps) -> None:
    """Capacity freed or arrived (a lease ended, a node registered, a device's health changed):
    a cycle is woken only while this replica knows of jobs that wait. Otherwise nothing is
    (no cycle, no read of the queue per lease end): a peer wakes for the jobs it found waiting,
    and ``cycle_loop``'s periodic wake finds any that nobody looks after."""
    if deps.last_pending:
        deps.wake.set()


async def on_scale_event(event: NodeProvisioning | NodeReady, deps: SchedulerDeps) -> None:
    """The autoscaler's provisioning and readiness events: incoming capacity, then a cycle."""
    if isinstance(event, NodeProvisioning):
        deps.incoming.provisioning(event)
    else:
        deps.incoming.ready(event)
    deps.wake.set()
