"""Lease-manager handlers: plain async functions of (message, dependencies).

State changes happen in ledger scripts, which also queue the resulting events in an outbox. A
holder's renewal or release publishes its own event from its script's answer (the direct
outbox, ``_announce``); for the rest the relay turns a batch of outbox entries into the public
events (``build_events``), and its sweep publishes what a direct publish left behind.

Either way a later event of a lease granted on admission, while the scheduler has not yet
confirmed the grant stored (it answers the grant before it publishes the grant's event), goes
out only once JetStream has the grant (``StoredGrants``), or after a copy of it: no subscriber
ever reads a lease's renewal or end ahead of its grant.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Final

import msgspec
from opentelemetry.trace import Span

from xpupool.bus import InvalidMessage, TenantRateLimit
from xpupool.contracts import (
    EndLease,
    EndReason,
    GetLease,
    HostShare,
    JobReserved,
    LeaseEnded,
    LeaseEnding,
    LeaseError,
    LeaseInfo,
    LeaseList,
    LeaseRenewed,
    LeaseReply,
    LeaseState,
    ListLeases,
    NodeLost,
    QueryError,
    ReleaseLease,
    RenewLease,
)
from xpupool.lease_manager.grant_watch import StoredGrants
from xpupool.lease_manager.metrics import LeaseManagerMetrics
from xpupool.lease_manager.tracing import record_lifetime
from xpupool.ledger import DirectOutbox, Holder, LeaseRecord, Ledger, ScriptResult
from xpupool.ledger.events import event_time, granted_event
from xpupool.obs import continue_trace, get_logger, spans_exported
from xpupool.obs.failpoints import Failpoints

_LEASE_ERRORS = {e.value: e for e in LeaseError}


_ENDING_DETAIL: Final = {
    EndReason.PREEMPTED.value: "preempted: release before the deadline, or the slices go then",
    EndReason.IDLE.value: "its devices did no work for the queue's idle_reclaim_s: reclaimed then",
}


async def grant_reservation(event: JobReserved, ledger: Ledger) -> Sequence[msgspec.Struct]:
    """Turn the scheduler's reservation into a fenced lease (the outbox announces it)."""
    attributes = {"xpupool.lease_id": event.lease_id, "xpupool.job_id": event.job_id}
    with continue_trace("lease grant", {}, attributes) as span:
        result = await ledger.grant(event.lease_id)
        span.set_attribute("xpupool.outcome", "granted" if result.ok else result.reason)
    if not result.ok:
        # Already ended (e.g. the reservation expired unclaimed): its terminal event is out.
        get_logger().warning("grant_refused", reason=result.reason, lease_id=event.lease_id)
    return []


async def end_lease(command: EndLease, ledger: Ledger) -> Sequence[msgspec.Struct]:
    """End a lease on the scheduler's request (preemption, a cancel); idempotent. With a grace
    period the holder is warned first and the lease ends at its deadline (or when released)."""
    attributes = {"xpupool.lease_id": command.lease_id, "xpupool.reason": command.reason.value}
    trace = await ledger.trace_of("lease", command.lease_id) if spans_exported() else {}
    with continue_trace("lease end", trace, attributes):
        if command.grace_s > 0:
            grace_ms = int(command.grace_s * 1000)
            await ledger.end_after(command.lease_id, command.reason.value, grace_ms)
        else:
            await ledger.end(command.lease_id, command.reason.value, command.detail)
    return []


def _refusal(lease_id: str, tenant: str, result: ScriptResult) -> LeaseReply:
    error = _LEASE_ERRORS.get(result.reason, LeaseError.INTERNAL_ERROR)
    get_logger().warning("lease_command_refused", lease_id=lease_id, tenant=tenant, error=error)
    # A foreign tenant learns nothing beyond the refusal itself.
    detail = "" if error in (LeaseError.NOT_OWNER, LeaseError.BAD_SECRET) else result.detail
    return LeaseReply(ok=False, lease_id=lease_id, error=error, detail=detail[:200])


async def _trace(ledger: Ledger, command: RenewLease | ReleaseLease) -> dict[str, str]:
    """The job trace a holder's command joins (its own trace, if another, is linked); not read
    when spans go nowhere, since it would only parent a span (a round trip per command)."""
    if not spans_exported():
        return {}
    return await ledger.trace_of("lease", command.lease_id)


def _holder_span(
    name: str, lease_id: str, tenant: str, trace: dict[str, str]
) -> AbstractContextManager[Span]:
    return continue_trace(name, trace, {"xpupool.lease_id": lease_id, "xpupool.tenant": tenant})


async def renew_lease(
    command: RenewLease,
    ledger: Ledger,
    *,
    tenant: str,
    outbox: DirectOutbox | None = None,
    metrics: LeaseManagerMetrics | None = None,
    grants: StoredGrants | None = None,
    failpoints: Failpoints | None = None,
) -> Sequence[msgspec.Struct]:
    """Extend a lease for its holder: the tenant whose subject sent the command, with the grant's
    secret and current fencing token; anything else is refused and changes nothing.

    With ``outbox`` the ``LeaseRenewed`` is published here, before the reply, rather than by
    the relay (``_announce``)."""
    ttl_ms = None if command.ttl_s is None else int(command.ttl_s * 1000)
    holder = Holder(tenant, command.lease_secret, command.fencing_token)
    trace = await _trace(ledger, command)
    with _holder_span("lease renew", command.lease_id, tenant, trace) as span:
        result = await ledger.renew(command.lease_id, holder, ttl_ms, direct=outbox is not None)
        if failpoints is not None and result.ok:
            failpoints.reached("lease_manager.lease_renewed")
        span.set_attribute("xpupool.outcome", "renewed" if result.ok else result.reason)
        if outbox is not None:
            await _announce("renewed", result, ledger, outbox, metrics, grants)
    if not result.ok:
        return [_refusal(command.lease_id, tenant, result)]
    return [
        LeaseReply(ok=True, lease_id=command.lease_id, expires_at=event_time(result.expires_ms))
    ]


async def release_lease(
    command: ReleaseLease,
    ledger: Ledger,
    *,
    tenant: str,
    outbox: DirectOutbox | None = None,
    metrics: LeaseManagerMetrics | None = None,
    grants: StoredGrants | None = None,
    failpoints: Failpoints | None = None,
) -> Sequence[msgspec.Struct]:
    """Give a lease back, on the same checks as a renewal: a stale, replayed or foreign release
    is refused (``lease_ended``, ``stale_token``, ``not_owner``, ``bad_secret``), never ``ok``.

    With ``outbox`` the ``LeaseEnded`` is published here, before the reply (``_announce``)."""
    holder = Holder(tenant, command.lease_secret, command.fencing_token)
    trace = await _trace(ledger, command)
    with _holder_span("lease release", command.lease_id, tenant, trace) as span:
        result = await ledger.release(command.lease_id, holder, direct=outbox is not None)
        if failpoints is not None and result.ok:
            failpoints.reached("lease_manager.lease_ended")
        span.set_attribute("xpupool.outcome", "released" if result.ok else result.reason)
        if outbox is not None:
            await _announce("ended", result, ledger, outbox, metrics, grants)
    if not result.ok:
        return [_refusal(command.lease_id, tenant, result)]
    return [LeaseReply(ok=True, lease_id=command.lease_id)]


async def _announce(
    kind: str,
    result: ScriptResult,
    ledger: Ledger,
    outbox: DirectOutbox,
    metrics: LeaseManagerMetrics | None,
    grants: StoredGrants | None,
) -> None:
    """Publish the event a holder's command queued in the direct outbox, from the lease its
    script answered with: no relay wake, no read of the lease, and its subscribers have it before
    the holder has the reply. Should the publish fail, the entry stays and the relay's sweep
    publishes the same event (``DIRECT_STALE_MS``) from the same entry. A grant the script found
    unconfirmed is waited for (``_grants_to_copy``)."""
    lease = ledger.announced_lease(result)
    if lease is None:
        return  # refused: nothing was queued
    fields = {"kind": kind, "lease_id": lease.lease_id}
    if kind == "renewed":
        fields["expires_ms"] = str(result.expires_ms)
    copy: Sequence[msgspec.Struct] = []
    grant = ledger.unconfirmed_grant(result)
    if grant is not None and await _grants_to_copy({lease.lease_id: grant}, grants):
        copy = entry_events(grant, lease)
    events = entry_events(fields, lease, metrics)
    with continue_trace(f"publish {kind}", {}, {"xpupool.lease_id": lease.lease_id}):
        if copy and not lease.grant_outbox:
            # On the grant's own entry in the direct outbox (the script read it with the
            # lease), confirmed once stored: the relay's sweep then leaves it be.
            await outbox.publish(lease.grant_entry, copy)
        elif copy:
            # A relay holds the grant's entry (a stalled or dead replica): it stays that
            # relay's, published again later and dropped by JetStream as a duplicate.
            events = [*copy, *events]
        await outbox.publish(result.entry, events)


async def _grants_to_copy(
    unconfirmed: dict[str, dict[str, str]], grants: StoredGrants | None
) -> dict[str, dict[str, str]]:
    """Of the grants the ledger found unconfirmed (by lease id, their entries' fields), those
    JetStream is not seen to hold within the watch's wait (all waited for together): a later
    event of such a lease goes after a copy of its grant."""
    if grants is None or not unconfirmed:
        return unconfirmed
    # Nearly always seen already: no task to wait in, and no turn of the loop.
    lease_ids = [lease_id for lease_id in unconfirmed if not grants.seen(lease_id)]
    if not lease_ids:
        return {}
    stored = await asyncio.gather(*(grants.stored(lease_id) for lease_id in lease_ids))
    return {i: unconfirmed[i] for i, seen in zip(lease_ids, stored, strict=True) if not seen}


def lease_info(lease: LeaseRecord) -> LeaseInfo:
    """A lease as its tenant may see it: everything but the secret."""
    states = {s.value: s for s in LeaseState}
    reasons = {r.value: r for r in EndReason}
    active = lease.state == LeaseState.ACTIVE.value
    return LeaseInfo(
        lease_id=lease.lease_id,
        job_id=lease.job_id,
        state=states.get(lease.state, LeaseState.ENDED),
        fencing_token=lease.token,
        slices=[s.to_contract() for s in lease.slices],
        host=[
            HostShare(node_id=node_id, cpu_milli=h.cpu_milli, memory_mib=h.memory_mib)
            for node_id, h in sorted(lease.host.items())
        ],
        granted_at=event_time(lease.granted_ms) if lease.granted_ms else None,
        expires_at=event_time(lease.expires_ms) if active and lease.expires_ms else None,
        end_reason=reasons.get(lease.end_reason or ""),
        ended_at=event_time(lease.ended_ms) if lease.ended_ms else None,
    )


def _over_query_rate(limit: TenantRateLimit, tenant: str) -> LeaseList | None:
    refusal = limit.refusal(tenant)
    return (
        None
        if refusal is None
        else LeaseList(ok=False, error=QueryError.RATE_LIMITED, detail=refusal)
    )


async def get_lease(
    command: GetLease, ledger: Ledger, *, tenant: str, limit: TenantRateLimit
) -> Sequence[msgspec.Struct]:
    """One of ``tenant``'s leases (the subject's, authenticated); another tenant's is as unknown
    as one that never existed. A tenant over its query rate (``limit``) is refused first."""
    if refused := _over_query_rate(limit, tenant):
        return [refused]
    lease = await ledger.get_lease(command.lease_id)
    if lease is None or lease.tenant != tenant:
        return [LeaseList(ok=False, error=QueryError.UNKNOWN_LEASE)]
    return [LeaseList(ok=True, leases=[lease_info(lease)])]


async def list_leases(
    command: ListLeases, ledger: Ledger, *, tenant: str, limit: TenantRateLimit
) -> Sequence[msgspec.Struct]:
    """``tenant``'s live leases, newest first (``get_lease``'s query rate)."""
    if refused := _over_query_rate(limit, tenant):
        return [refused]
    leases = await ledger.tenant_leases(tenant, command.limit)
    return [LeaseList(ok=True, leases=[lease_info(lease) for lease in leases])]


def reject_invalid_query(invalid: InvalidMessage) -> Sequence[msgspec.Struct]:
    """A lease query that does not decode gets an error reply naming the field (the bus's
    ``invalid_request`` / ``payload_too_large`` codes are the contract's error values)."""
    return [LeaseList(ok=False, error=QueryError(invalid.code), detail=invalid.explained)]


def query_reply_too_large(reply: msgspec.Struct) -> LeaseList:
    """What a requester gets instead of a list that would not fit its server's max_payload."""
    return LeaseList(ok=False, error=QueryError.INTERNAL_ERROR, detail="reply too large")


def reject_invalid_command(invalid: InvalidMessage) -> Sequence[msgspec.Struct]:
    """A renew/release that does not decode gets an error reply naming the field."""
    return [
        LeaseReply(ok=False, lease_id="", error=LeaseError(invalid.code), detail=invalid.explained)
    ]


def reply_too_large(reply: msgspec.Struct) -> LeaseReply:
    """What a requester gets instead of a reply that would not fit its server's max_payload."""
    return LeaseReply(
        ok=False, lease_id="", error=LeaseError.INTERNAL_ERROR, detail="reply too large"
    )


async def build_events(
    entries: Sequence[dict[str, str]],
    ledger: Ledger,
    metrics: LeaseManagerMetrics | None = None,
    grants: StoredGrants | None = None,
) -> list[Sequence[msgspec.Struct]]:
    """The public events for a batch of lease-manager outbox entries, the leases they are about
    read in one round trip (ends counted in ``metrics``). A lease's first later event in the
    batch waits for its grant while that is unconfirmed (``unconfirmed_grants``, one more round
    trip for a batch that names a lease granted on admission; ``_grants_to_copy``). A grant
    entry whose grant ``grants`` saw stored gets no events: its writer published it and died
    (or lingered) before deleting the entry, and a copy would only reach core NATS subscribers
    a second time."""
    lease_ids = sorted({f["lease_id"] for f in entries if f.get("lease_id")})
    leases = dict(zip(lease_ids, await ledger.get_leases(lease_ids), strict=True))
    # A grant entry of the batch itself (the direct outbox's sweep) goes out first anyway.
    granting = {f.get("lease_id") for f in entries if f.get("kind") == "granted"}
    later = [lease for i, lease in leases.items() if lease is not None and i not in granting]
    copies = await _grants_to_copy(await ledger.unconfirmed_grants(later), grants)
    built: list[Sequence[msgspec.Struct]] = []
    for fields in entries:
        if _stored_already(fields, grants):
            built.append([])
            continue
        lease = leases.get(fields.get("lease_id", ""))
        events = entry_events(fields, lease, metrics)
        grant = copies.pop(lease.lease_id, None) if lease is not None else None
        built.append(events if grant is None else [*entry_events(grant, lease), *events])
    return built


def _stored_already(fields: dict[str, str], grants: StoredGrants | None) -> bool:
    """Whether the entry is a grant that JetStream was seen to store (``StoredGrants``: the
    operator's copy, sent after the tenant's on the same connection)."""
    lease_id = fields.get("lease_id", "")
    if fields.get("kind") != "granted" or grants is None or not grants.seen(lease_id):
        return False
    get_logger().info("outbox_grant_stored_already", lease_id=lease_id)
    return True


def entry_events(
    fields: dict[str, str], lease: LeaseRecord | None, metrics: LeaseManagerMetrics | None = None
) -> Sequence[msgspec.Struct]:
    """The public event for one lease-manager outbox entry, given the lease it names."""
    kind = fields.get("kind")
    if kind == "node_lost":
        last_seen = int(fields.get("last_seen_ms") or 0)
        return [
            NodeLost(
                node_id=fields["node_id"], last_seen=event_time(last_seen) if last_seen else None
            )
        ]
    if lease is None:
        get_logger().error("outbox_entry_without_lease", entry=fields)
        return []
    if kind == "granted":
        return [granted_event(lease, int(fields.get("expires_ms") or 0) or None)]
    if kind == "renewed":
        expires_ms = int(fields.get("expires_ms") or lease.expires_ms)
        return [
            LeaseRenewed(
                job_id=lease.job_id,
                lease_id=lease.lease_id,
                tenant=lease.tenant,
                fencing_token=lease.token,
                expires_at=event_time(expires_ms),
            )
        ]
    if kind == "ending":
        deadline_ms = int(fields.get("deadline_ms") or lease.deadline_ms or lease.expires_ms)
        return [
            LeaseEnding(
                job_id=lease.job_id,
                lease_id=lease.lease_id,
                tenant=lease.tenant,
                reason=EndReason(fields.get("reason") or EndReason.MAX_RUNTIME.value),
                deadline=event_time(deadline_ms),
                fencing_token=lease.token,
                detail=_ENDING_DETAIL.get(
                    fields.get("reason") or "",
                    "the lease ends at its maximum run time, renewed or not",
                ),
            )
        ]
    if kind == "ended":
        ended = [
            LeaseEnded(
                job_id=lease.job_id,
                lease_id=lease.lease_id,
                tenant=lease.tenant,
                reason=EndReason(lease.end_reason or "released"),
                fencing_token=lease.token,
                ended_at=event_time(lease.ended_ms or lease.expires_ms),
                detail=lease.end_detail,
            )
        ]
        record_lifetime(lease)
        if metrics is not None:
            metrics.observe_events(ended, lease)
        return ended
    get_logger().error("outbox_entry_unknown", entry=fields)
    return []
