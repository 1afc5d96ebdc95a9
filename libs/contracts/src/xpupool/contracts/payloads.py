"""Every payload that crosses NATS, as msgspec Structs: the public API of xpupool.

Rules (see the style guide): Structs are frozen and keyword-only; fields are only ever added with
defaults; a breaking change mints a ``…V2`` type. Each event carries a ``type`` tag equal to its
CloudEvents ``ce-type``, so a subject that carries several types decodes into a tagged union.
Units live in field names (``_mib``, ``_pct``, ``_s``).

What clients send (job requests, lease commands) is **strict**: unknown fields are refused, naming
the field, so a typo never silently changes a job. Every string, list and map has a maximum
length and every number a range, so no input can grow a record or an answer without bound.
Messages between services stay lenient (unknown fields ignored), so services can be upgraded one
at a time. Every reason and error code is an enum: add members, never rename them.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Literal

from msgspec import Meta, Struct, field

Timestamp = Annotated[datetime, Meta(tz=True, description="RFC 3339 timestamp with a time zone")]
IDENTIFIER_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:@/-]*$"
Identifier = Annotated[
    str,
    Meta(
        min_length=1,
        max_length=128,
        pattern=IDENTIFIER_PATTERN,
        description="Letters, digits and . _ : @ / - ; starts with a letter or digit",
    ),
]
Percent = Annotated[int, Meta(ge=1, le=100)]
Name = Annotated[str, Meta(max_length=128)]
ModelName = Annotated[str, Meta(min_length=1, max_length=64)]
Detail = Annotated[
    str, Meta(max_length=1024, description="Human-readable; at most 1,024 characters")
]
LabelKey = Annotated[str, Meta(min_length=1, max_length=63)]
LabelValue = Annotated[str, Meta(max_length=256)]
MAX_MIB = 64 * 1024 * 1024  # 64 TiB: beyond any device or host
MAX_SECONDS = 365 * 24 * 3600.0
TENANT_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$"
TenantName = Annotated[
    str,
    Meta(
        min_length=1,
        max_length=64,
        pattern=TENANT_NAME_PATTERN,
        description="A tenant: one subject token of letters, digits, _ and -",
    ),
]
LeaseSecret = Annotated[
    str,
    Meta(
        min_length=1,
        max_length=128,
        description="The lease's bearer secret (192 random bits as hex; opaque: compare it whole)",
    ),
]

__all__ = [
    "GetLease",
    "JobInfo",
    "JobList",
    "JobState",
    "LeaseInfo",
    "LeaseList",
    "LeaseState",
    "ListJobs",
    "ListLeases",
    "QueryError",
    "MAX_QUERY_LIMIT",
    "AllocationGranted",
    "CancelError",
    "CancelJob",
    "CancelOutcome",
    "CancelReply",
    "SubmitOutcome",
    "SubmitReply",
    "DeviceDemand",
    "DeviceHealthChanged",
    "DeviceSample",
    "DeviceSelector",
    "DeviceSlice",
    "DeviceSpec",
    "EndLease",
    "EndReason",
    "GangSpec",
    "Health",
    "HostDemand",
    "HostShare",
    "InjectFault",
    "IDENTIFIER_PATTERN",
    "Identifier",
    "Intent",
    "Isolation",
    "JobCancelled",
    "JobPending",
    "JobRejected",
    "JobRequested",
    "JobReserved",
    "JobTimedOut",
    "LeaseEnded",
    "LeaseEnding",
    "LeaseOverused",
    "LeaseRenewed",
    "LeaseReply",
    "NodeHeartbeat",
    "NodeLost",
    "NodeRegistered",
    "PartitionSpec",
    "PoolShape",
    "JobReason",
    "LeaseError",
    "Percent",
    "Priority",
    "TENANT_NAME_PATTERN",
    "TenantName",
    "LeaseSecret",
    "ReleaseLease",
    "RenewLease",
    "DrainPolicy",
    "NodeDraining",
    "NodeProvisioning",
    "NodeReady",
    "NodeRemoved",
    "ScaleAction",
    "ScaleDecision",
    "ScaleDemand",
    "ScaleFailed",
    "ScaleReason",
    "TelemetrySampled",
    "Timestamp",
    "UsageRecord",
    "UsageSlice",
    "Vendor",
]


class Vendor(StrEnum):
    """Accelerator vendors xpupool knows how to hand out."""

    NVIDIA = "nvidia"
    ASCEND = "ascend"
    CAMBRICON = "cambricon"
    AMD = "amd"
    HYGON = "hygon"
    SIMULATED = "simulated"


class Health(StrEnum):
    """Health of one device as the collector sees it; only ``healthy`` devices take new grants."""

    HEALTHY = "healthy"
    DEGRADED = "degraded"
    UNHEALTHY = "unhealthy"
    LOST = "lost"


class Intent(StrEnum):
    """What a job optimises for when several device classes would do."""

    CHEAPEST = "cheapest"
    FASTEST = "fastest"
    BALANCED = "balanced"
    # No preference between classes: the pool's efficiency (least fragmentation) decides.
    ANY = "any"


class Isolation(StrEnum):
    """How strictly a shared slice must be isolated from its neighbours."""

    ANY = "any"
    HARD = "hard"


class Priority(StrEnum):
    """Priority classes a job may ask for; the queue file gives each its numeric value."""

    LOW = "low"
    NORMAL = "normal"
    HIGH = "high"
    CRITICAL = "critical"


class JobReason(StrEnum):
    """Why a job waits, was rejected or timed out (``JobPending``, ``JobRejected``,
    ``JobTimedOut``). Public API: add, never rename."""

    # --- pending ------------------------------------------------------------------------
    NO_MATCHING_DEVICE = "no_matching_device"
    """No healthy device matches the selectors right now (or, when rejecting, none at all)."""
    INSUFFICIENT_CAPACITY = "insufficient_capacity"
    """Matching devices exist but not enough of them are free."""
    QUOTA_EXHAUSTED = "quota_exhausted"
    """It would fit, but the queue (or an ancestor) is at its limit, or at its guarantee with
    borrowing disabled."""
    WAITING_FOR_GANG = "waiting_for_gang"
    """Some of the gang's devices could be placed now, but not all of them together."""
    PREEMPTION_IN_PROGRESS = "preemption_in_progress"
    """Leases were preempted for this job and are still ending."""
    WAITING_FOR_MIN_RUNTIME = "waiting_for_min_runtime"
    """It may preempt leases, but not before they have run ``preemption.min_runtime_s``."""
    CAPACITY_INCOMING = "capacity_incoming"
    """It will fit once leases that are already ending give their slices back."""
    CAPACITY_RESERVED = "capacity_reserved"
    """It fits only on nodes held for a job that has waited too long (anti-starvation)."""
    QUEUED = "queued"
    """Admitted; no scheduling cycle has considered it yet."""

    # --- rejected, terminal -------------------------------------------------------------
    INVALID_REQUEST = "invalid_request"
    """The request does not match the schema; ``field_name`` names the offending field."""
    PAYLOAD_TOO_LARGE = "payload_too_large"
    """The message is larger than the service accepts."""
    TENANT_MISMATCH = "tenant_mismatch"
    """The payload names another tenant than the one whose subject (credentials) sent it."""
    QUEUE_NOT_ALLOWED = "queue_not_allowed"
    """The queue file does not let this tenant charge the named queue."""
    RATE_LIMITED = "rate_limited"
    """The tenant sends requests faster than its rate limit; resubmit later with a new job id."""
    TOO_MANY_PENDING = "too_many_pending"
    """The tenant already has its maximum number of pending requests."""
    UNKNOWN_MODEL = "unknown_model"
    UNKNOWN_DEVICE = "unknown_device"
    UNKNOWN_QUEUE = "unknown_queue"
    UNKNOWN_PRIORITY = "unknown_priority"
    SHARE_TOO_LARGE = "share_too_large"
    EXCEEDS_NODE_CAPACITY = "exceeds_node_capacity"
    EXCEEDS_DOMAIN_CAPACITY = "exceeds_domain_capacity"
    EXCEEDS_POOL_CAPACITY = "exceeds_pool_capacity"
    EXCEEDS_QUOTA_LIMIT = "exceeds_quota_limit"
    INTERNAL_ERROR = "internal_error"
    """The service failed to handle the request repeatedly; the detail says how."""
    DUPLICATE_JOB = "duplicate_job"
    """The job id belongs to another job (one that waits, runs or has ended, or another tenant's),
    and this request is not that job's request again; ``detail`` says where that job stands or
    how it ended. Only this request is refused (the earlier job goes on, its events stand):
    submit with a new job id. The same
    request sent again (a retry, by any subject) is no new job and gets no second outcome: by
    request/reply it is answered ``known`` (``SubmitReply.state``)."""

    # --- timed out, terminal ------------------------------------------------------------
    MAX_WAIT_EXCEEDED = "max_wait_exceeded"


class LeaseError(StrEnum):
    """Why a renew or release was refused (``LeaseReply.error``). The lease is never touched."""

    UNKNOWN_LEASE = "unknown_lease"
    NOT_OWNER = "not_owner"
    """The lease belongs to another tenant."""
    BAD_SECRET = "bad_secret"
    """The lease secret does not match."""
    STALE_TOKEN = "stale_token"
    """The fencing token is not the lease's current one."""
    LEASE_ENDED = "lease_ended"
    """The lease has ended (released, expired, preempted, lost): it is no longer yours."""
    LEASE_NOT_GRANTED = "lease_not_granted"
    """The lease is reserved but not granted yet."""
    INVALID_REQUEST = "invalid_request"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    INTERNAL_ERROR = "internal_error"


class CancelError(StrEnum):
    """Why a cancel was refused (``CancelReply.error``). Nothing is changed."""

    UNKNOWN_JOB = "unknown_job"
    """No job of this tenant has this id (the ids of other tenants' jobs are not revealed)."""
    JOB_ENDED = "job_ended"
    """The job has already ended; ``detail`` says how."""
    INVALID_REQUEST = "invalid_request"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    INTERNAL_ERROR = "internal_error"


class CancelOutcome(StrEnum):
    """What an accepted cancel did (``CancelReply.outcome``)."""

    CANCELLED = "cancelled"
    """The job was waiting: it left the pending queue and ended with ``JobCancelled``."""
    RELEASING = "releasing"
    """The job holds (or was about to hold) a lease: the lease ends ``released``."""


class SubmitOutcome(StrEnum):
    """Where a job submitted by request stands once the ledger admitted it (``SubmitReply``)."""

    GRANTED = "granted"
    """Placed on arrival: ``SubmitReply.granted`` is the grant, published as well."""
    WAITING = "waiting"
    """Admitted and waiting: its outcome comes later as an event on the tenant's subjects."""
    REJECTED = "rejected"
    """Refused: ``SubmitReply.rejected`` says why; the rejection is published as well."""
    KNOWN = "known"
    """A job of this id was admitted before and has gone further (reserved, leased, or over and
    this is its request again): its one outcome was published, or is on its way, on the
    tenant's subjects; ``SubmitReply.state`` says where it stands and, once over, ``detail``
    how it ended. While its lease is live, ``SubmitReply.granted`` is its grant as the lease
    stands now (no new grant: a requester that missed the event, its connection down when it
    went out, has it again)."""


class QueryError(StrEnum):
    """Why a query was refused (``JobList.error``, ``LeaseList.error``)."""

    UNKNOWN_LEASE = "unknown_lease"
    """No lease of this tenant has this id (other tenants' leases are not revealed)."""
    INVALID_REQUEST = "invalid_request"
    PAYLOAD_TOO_LARGE = "payload_too_large"
    INTERNAL_ERROR = "internal_error"
    RATE_LIMITED = "rate_limited"
    """The tenant queries faster than the service answers one tenant
    (``XPUPOOL_QUERY_RATE_PER_S``, ``XPUPOOL_QUERY_BURST``); ``detail`` says when to retry."""


class JobState(StrEnum):
    """Where a job stands (``JobInfo.state``)."""

    PENDING = "pending"
    RESERVED = "reserved"
    """Slices are held for it; the lease is being granted."""
    LEASED = "leased"
    ENDED = "ended"
    """Its lease ended (``LeaseInfo.end_reason`` says why)."""
    REJECTED = "rejected"
    TIMED_OUT = "timed_out"
    CANCELLED = "cancelled"


class LeaseState(StrEnum):
    """Where a lease stands (``LeaseInfo.state``)."""

    RESERVED = "reserved"
    ACTIVE = "active"
    ENDED = "ended"


class EndReason(StrEnum):
    """Why a lease ended. Each reason is also the last token of its event's subject."""

    RELEASED = "released"
    EXPIRED = "expired"
    PREEMPTED = "preempted"
    LOST = "lost"
    MAX_RUNTIME = "max_runtime"
    """It reached the request's or the queue's maximum run time."""
    IDLE = "idle"
    """Its devices showed no utilisation for the queue's ``idle_reclaim_s`` (opt-in)."""


# --------------------------------------------------------------------------------------------
# The job request (upstream -> scheduler)
# --------------------------------------------------------------------------------------------


class DeviceDemand(
    Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """What a job needs of each device. No share fields at all means a whole device.

    A share gives ``memory_mib`` or ``memory_pct`` (not both) and/or ``compute_pct``. A share with
    only ``compute_pct`` gets device memory in the same proportion.
    """

    memory_mib: Annotated[int, Meta(ge=1, le=MAX_MIB)] | None = None
    memory_pct: Percent | None = None
    compute_pct: Percent | None = None

    @property
    def is_whole(self) -> bool:
        """True when the job asks for the whole device."""
        return self.memory_mib is None and self.memory_pct is None and self.compute_pct is None


class DeviceSelector(
    Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True
):
    """Constraints on which devices may serve a request."""

    vendor: Vendor | None = None
    models: Annotated[list[ModelName], Meta(max_length=64)] = field(default_factory=list)
    avoid_models: Annotated[list[ModelName], Meta(max_length=64)] = field(default_factory=list)
    device_ids: Annotated[list[Identifier], Meta(max_length=1024)] = field(default_factory=list)
    avoid_device_ids: Annotated[list[Identifier], Meta(max_length=1024)] = field(
        default_factory=list
    )
    min_memory_mib: Annotated[int, Meta(ge=0, le=MAX_MIB)] = 0
    min_capacity: Annotated[float, Meta(ge=0, le=1e6)] = 0.0
    capabilities: Annotated[list[ModelName], Meta(max_length=32)] = field(default_factory=list)
    isolation: Isolation = Isolation.ANY


class HostDemand(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """Host resources a job needs on the node that carries its devices."""

    cpu_milli: Annotated[int, Meta(ge=0, le=1_000_000_000)] = 0
    memory_mib: Annotated[int, Meta(ge=0, le=MAX_MIB)] = 0


class GangSpec(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """All devices of the request are placed together or not at all."""

    same_node: bool = True
    same_domain: bool = False


class JobRequested(
    Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    # Encoded without the fields left at their defaults: the request's fingerprint (the ledger
    # tells a retry from another request under the same job id by it) stays the same after an
    # upgrade that adds a field with a default, and the request is a quarter of its size.
    omit_defaults=True,
    tag_field="type",
    tag="xpupool.job.requested.v1",
):
    """An upstream system asks for accelerators. ``job_id`` is the idempotency key, in one space
    shared by every tenant: an id another tenant used is refused ``duplicate_job`` ("this job id
    is taken"), so make ids unique beyond your own (a UUID, or your tenant's name as a prefix).

    The tenant is the one whose subject the request arrives on; ``tenant`` may be left out, and
    a request that names another tenant is rejected (``tenant_mismatch``).

    ``count`` is the number of distinct devices, all or nothing. ``count: 0`` is a host-only job:
    it reserves ``host.cpu_milli`` and ``host.memory_mib`` on one node and no device, so it must
    ask for some host resource and carries neither a device share nor a gang.
    """

    job_id: Identifier
    tenant: TenantName | None = None
    count: Annotated[
        int,
        Meta(
            ge=0,
            le=1024,
            description=(
                "Number of distinct devices, all or nothing. 0: a host-only job, which reserves "
                "host.cpu_milli and host.memory_mib on one node and no device (it must ask for "
                "some host resource, and give no device share and no gang)"
            ),
        ),
    ] = 1
    device: DeviceDemand = field(default_factory=DeviceDemand)
    selector: DeviceSelector = field(default_factory=DeviceSelector)
    host: HostDemand = field(default_factory=HostDemand)
    gang: GangSpec | None = None
    lease_ttl_s: Annotated[float, Meta(ge=1, le=7 * 24 * 3600)] = 300.0
    owner: Identifier | None = None
    queue: Identifier | None = None
    priority: Priority = Priority.NORMAL
    max_wait_s: Annotated[float, Meta(gt=0, le=30 * 24 * 3600)] | None = None
    max_runtime_s: Annotated[float, Meta(gt=0, le=MAX_SECONDS)] | None = None
    """The longest the lease may live, renewals included (the queue's limit, if smaller, wins):
    a ``LeaseEnding`` warning comes first, then the lease ends ``max_runtime``."""
    expected_duration_s: Annotated[float, Meta(gt=0, le=MAX_SECONDS)] | None = None
    intent: Intent = Intent.CHEAPEST
    labels: Annotated[dict[LabelKey, LabelValue], Meta(max_length=32)] = field(default_factory=dict)


# --------------------------------------------------------------------------------------------
# Scheduler outcomes
# --------------------------------------------------------------------------------------------


class DeviceSlice(Struct, frozen=True, kw_only=True):
    """One device, or a share of it, reserved for a job.

    ``enforced`` says whether something on the node holds the job to ``memory_mib`` and
    ``compute_pct``: always for a whole device or a whole hardware partition (a MIG instance's
    ``uuid`` is its ``MIG-…`` UUID), and for a share only where the device lists a mechanism the
    job's environment sets limits for (MPS or HAMi-core on NVIDIA, HAMi-core on Ascend). A share
    that is not enforced is a promise between jobs: nothing stops a neighbour from taking more.
    It defaults to ``False`` because a slice from before this field never said, and a claim of
    enforcement that nobody made is the dishonest reading; readers treat ``whole`` as enforced.
    """

    device_id: str
    node_id: str
    vendor: Vendor
    model: str
    index: int
    uuid: str
    memory_mib: int
    compute_pct: int
    whole: bool
    enforced: bool = False


class JobRejected(
    Struct, frozen=True, kw_only=True, tag_field="type", tag="xpupool.job.rejected.v1"
):
    """A request that will never be placed: terminal. ``field_name`` names the offending input
    (a dotted path such as ``device.memory_mib``) when one input is to blame."""

    job_id: Name
    tenant: Name | None = None
    field_name: Name | None = None
    reason: JobReason
    detail: Detail = ""


class JobPending(Struct, frozen=True, kw_only=True, tag_field="type", tag="xpupool.job.pending.v1"):
    """A request that cannot be placed now and waits; ``reason`` explains why."""

    job_id: Name
    tenant: Name
    reason: JobReason
    detail: Detail = ""
    since: Timestamp


class JobTimedOut(
    Struct, frozen=True, kw_only=True, tag_field="type", tag="xpupool.job.timed_out.v1"
):
    """A pending request waited past its ``max_wait_s``: terminal."""

    job_id: Name
    tenant: Name
    waited_s: float
    last_reason: JobReason | None = None


class JobCancelled(
    Struct, frozen=True, kw_only=True, tag_field="type", tag="xpupool.job.cancelled.v1"
):
    """A waiting request was cancelled by its tenant: terminal."""

    job_id: Name
    tenant: Name
    waited_s: float


class CancelJob(
    Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    tag_field="type",
    tag="xpupool.job.cancel.v1",
):
    """Cancel one of the tenant's jobs: a waiting one ends ``JobCancelled``, a granted one's
    lease ends ``released``. Idempotent: cancelling again while the lease ends is accepted."""

    job_id: Identifier


class CancelReply(
    Struct, frozen=True, kw_only=True, tag_field="type", tag="xpupool.job.cancel_reply.v1"
):
    """Answer to a cancel request."""

    ok: bool
    job_id: Name
    outcome: CancelOutcome | None = None
    error: CancelError | None = None
    detail: Detail = ""


#: Most entries one query answers (a reply must fit the server's max_payload).
MAX_QUERY_LIMIT = 100


class ListJobs(
    Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    tag_field="type",
    tag="xpupool.job.list.v1",
):
    """The tenant's jobs, newest first: waiting (with why), running, and recently ended, among
    those it submitted within the deployment's job retention (7 days by default), the latest
    1,000 at most, and every job that holds a lease, however old."""

    limit: Annotated[int, Meta(ge=1, le=MAX_QUERY_LIMIT)] = 50


class JobInfo(Struct, frozen=True, kw_only=True):
    """One job as the ledger knows it."""

    job_id: str
    state: JobState
    reason: JobReason | None = None
    """Why it waits (pending), or why it was rejected or timed out."""
    detail: str = ""
    since: Timestamp | None = None
    """When it was admitted."""
    lease_id: str | None = None


class JobList(Struct, frozen=True, kw_only=True, tag_field="type", tag="xpupool.job.list_reply.v1"):
    """Answer to ``ListJobs``."""

    ok: bool
    jobs: list[JobInfo] = field(default_factory=list)
    error: QueryError | None = None
    detail: Detail = ""


class GetLease(
    Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    tag_field="type",
    tag="xpupool.lease.get.v1",
):
    """One of the tenant's leases by id: a live one, or an ended one for the deployment's lease
    retention after its end (7 days by default); after that it is ``unknown_lease``."""

    lease_id: Identifier


class ListLeases(
    Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    tag_field="type",
    tag="xpupool.lease.list.v1",
):
    """The tenant's live leases (reserved or active), newest first."""

    limit: Annotated[int, Meta(ge=1, le=MAX_QUERY_LIMIT)] = 50


class LeaseInfo(Struct, frozen=True, kw_only=True):
    """One lease, without its secret."""

    lease_id: str
    job_id: str
    state: LeaseState
    fencing_token: int
    slices: list[DeviceSlice] = field(default_factory=list)
    host: list[HostShare] = field(default_factory=list)
    granted_at: Timestamp | None = None
    expires_at: Timestamp | None = None
    end_reason: EndReason | None = None
    ended_at: Timestamp | None = None


class LeaseList(
    Struct, frozen=True, kw_only=True, tag_field="type", tag="xpupool.lease.list_reply.v1"
):
    """Answer to ``GetLease`` (one entry) and ``ListLeases``."""

    ok: bool
    leases: list[LeaseInfo] = field(default_factory=list)
    error: QueryError | None = None
    detail: Detail = ""


class JobReserved(
    Struct, frozen=True, kw_only=True, tag_field="type", tag="xpupool.job.reserved.v1"
):
    """Internal: the scheduler holds these slices for the job in the ledger until the lease-manager
    turns the reservation into a lease."""

    job_id: str
    lease_id: str
    tenant: str
    owner: str
    queue: str
    priority: int
    lease_ttl_s: float
    slices: list[DeviceSlice]


class EndLease(Struct, frozen=True, kw_only=True, tag_field="type", tag="xpupool.lease.end.v1"):
    """Internal command: the scheduler asks the lease-manager to end a lease (preemption, a
    cancel). With ``grace_s`` the holder is warned (``LeaseEnding``) and keeps the slices until
    the deadline."""

    lease_id: str
    reason: EndReason
    detail: Detail = ""
    grace_s: Annotated[float, Meta(ge=0)] = 0.0
    requested_by: str = ""


# --------------------------------------------------------------------------------------------
# Lease lifecycle (lease-manager -> everyone)
# --------------------------------------------------------------------------------------------


class HostShare(Struct, frozen=True, kw_only=True):
    """Host CPU and memory a lease holds on one node."""

    node_id: str
    cpu_milli: int = 0
    memory_mib: int = 0


class AllocationGranted(
    Struct, frozen=True, kw_only=True, tag_field="type", tag="xpupool.alloc.granted.v1"
):
    """The job holds a lease on these slices until ``expires_at`` unless it renews.

    ``env`` is what the job must run with: the vendors' visible-device variables and limits
    (a host-only job, with no slices, gets every vendor's visible-device variable empty: no
    device). ``host`` is the host CPU and memory held per node; it is where a host-only job runs.
    ``lease_secret`` and ``fencing_token`` must accompany every renew and release. The secret
    is only in the owner's copy (the tenant space); operator copies carry ``null``.
    """

    job_id: str
    lease_id: str
    tenant: str
    owner: str
    fencing_token: int
    granted_at: Timestamp
    expires_at: Timestamp
    slices: list[DeviceSlice]
    env: dict[str, str]
    host: list[HostShare] = field(default_factory=list)
    lease_secret: LeaseSecret | None = None


class SubmitReply(
    Struct, frozen=True, kw_only=True, tag_field="type", tag="xpupool.job.submit_reply.v1"
):
    """Answer to a job submitted by request (``xpupool.tenant.v1.{tenant}.jobs.submit``), sent
    once the ledger has admitted, granted or refused it.

    Every outcome it carries is also published as the event it is (``AllocationGranted``,
    ``JobRejected``), so a subscriber to the tenant's events sees the same as a request/reply
    client, and a requester that lost its reply still gets the event. A reply that would not fit
    the server's max_payload carries neither ``granted`` nor ``rejected`` (``detail`` says so):
    the event has it.
    """

    job_id: str
    outcome: SubmitOutcome
    granted: AllocationGranted | None = None
    rejected: JobRejected | None = None
    state: JobState | None = None
    """With ``known``: where the job of this id stands (``reserved``, ``leased``, or, over,
    ``ended``, ``rejected``, ``timed_out``, ``cancelled``)."""
    detail: Detail = ""


class LeaseRenewed(
    Struct, frozen=True, kw_only=True, tag_field="type", tag="xpupool.alloc.renewed.v1"
):
    """A lease's term was extended."""

    job_id: str
    lease_id: str
    fencing_token: int
    expires_at: Timestamp
    tenant: str = ""


class LeaseEnding(
    Struct, frozen=True, kw_only=True, tag_field="type", tag="xpupool.alloc.ending.v1"
):
    """Warning: the lease will end at ``deadline`` for ``reason``, renewed or not: ``max_runtime``
    (its maximum run time), ``preempted`` (a preemption with the queue file's
    ``preemption.grace_s``) or ``idle`` (its devices did no work for the queue's
    ``idle_reclaim_s``). Save your work; a release before then ends it ``released``."""

    job_id: str
    lease_id: str
    tenant: str
    reason: EndReason
    deadline: Timestamp
    fencing_token: int
    detail: Detail = ""


class LeaseEnded(Struct, frozen=True, kw_only=True, tag_field="type", tag="xpupool.alloc.ended.v1"):
    """Terminal: the lease is over and its slices are back in the pool."""

    job_id: str
    lease_id: str
    tenant: str
    reason: EndReason
    fencing_token: int
    ended_at: Timestamp
    detail: Detail = ""


# --------------------------------------------------------------------------------------------
# Lease commands (holder -> lease-manager), by event or request/reply
# --------------------------------------------------------------------------------------------


FencingToken = Annotated[int, Meta(ge=0, le=2**53)]


class RenewLease(
    Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    tag_field="type",
    tag="xpupool.lease.renew.v1",
):
    """Extend a lease by ``ttl_s`` (default: its original term) from the ledger's clock.

    Only the owning tenant, presenting the grant's ``lease_secret`` and current
    ``fencing_token``, can renew; anything else is refused and leaves the lease as it was.
    """

    lease_id: Identifier
    lease_secret: LeaseSecret
    fencing_token: FencingToken
    ttl_s: Annotated[float, Meta(ge=1, le=7 * 24 * 3600)] | None = None


class ReleaseLease(
    Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    tag_field="type",
    tag="xpupool.lease.release.v1",
):
    """Give a lease back before its term (owner only, with its secret and current token)."""

    lease_id: Identifier
    lease_secret: LeaseSecret
    fencing_token: FencingToken


class LeaseReply(Struct, frozen=True, kw_only=True, tag_field="type", tag="xpupool.lease.reply.v1"):
    """Answer to a renew or release request."""

    ok: bool
    lease_id: Name
    error: LeaseError | None = None
    detail: Detail = ""
    expires_at: Timestamp | None = None


# --------------------------------------------------------------------------------------------
# Inventory and telemetry (collector -> everyone)
# --------------------------------------------------------------------------------------------


class PartitionSpec(Struct, frozen=True, kw_only=True):
    """How a hardware partition is cut from its parent device.

    ``kind`` is the isolation mechanism (``mig``, ``vnpu``); ``profile`` the vendor's name for
    the cut (``3g.40gb``, ``1c.3g.40gb``, ``vir05_1c_16g``; empty when the tool did not say).
    For MIG, ``gpu_slices`` are the GPU-instance slices (the ``3g``: memory and engines),
    ``compute_slices`` the compute-instance slices (the ``1c``; equal to ``gpu_slices`` when the
    instance is not split further), both out of ``slices_total`` (7 on A100/H100/H200).
    ``None`` means the backend could not read that number.
    """

    kind: str
    profile: str = ""
    gpu_slices: int | None = None
    compute_slices: int | None = None
    slices_total: int | None = None
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


class DeviceSpec(Struct, frozen=True, kw_only=True):
    """One leasable unit found on a node: a whole device or a hardware partition (MIG, vNPU).

    A partition carries its parent's UUID in ``parent_uuid`` and its cut in ``partition``; its
    own ``uuid`` is what the vendor runtime takes (``MIG-…`` for a MIG instance). A MIG-enabled
    GPU is listed only through its instances: a CUDA process cannot use it whole.
    """

    device_id: str
    vendor: Vendor
    model: str
    index: int
    uuid: str
    memory_mib: int
    capacity_units: float = 1.0
    capabilities: list[str] = field(default_factory=list)
    isolation: list[str] = field(default_factory=list)
    interconnect: str = "pcie"
    domain: str = ""
    cost_per_hour: float = 0.0
    parent_uuid: str | None = None
    partition: PartitionSpec | None = None


class PoolShape(Struct, frozen=True, kw_only=True):
    """A node an autoscaler pool could add (a ledger record, not an event): its devices as a
    collector would register them, its host CPU and memory, and the pool's maximum size. The
    scheduler keeps pending, instead of rejecting, a request only such nodes could hold, so the
    autoscaler sees the demand."""

    pool: Name
    devices: list[DeviceSpec]
    cpu_milli: int = 0
    memory_mib: int = 0
    max_size: int = 0


class NodeRegistered(
    Struct, frozen=True, kw_only=True, tag_field="type", tag="xpupool.node.registered.v1"
):
    """A collector put its node and devices into the ledger (idempotent on restart)."""

    node_id: str
    devices: list[DeviceSpec]
    cpu_milli: int = 0
    memory_mib: int = 0
    labels: dict[str, str] = field(default_factory=dict)


class NodeHeartbeat(
    Struct, frozen=True, kw_only=True, tag_field="type", tag="xpupool.node.heartbeat.v1"
):
    """A collector is alive; published on core NATS."""

    node_id: str
    at: Timestamp
    device_count: int


class NodeLost(Struct, frozen=True, kw_only=True, tag_field="type", tag="xpupool.node.lost.v1"):
    """A node stopped heartbeating past its grace period; its leases end as ``lost``."""

    node_id: str
    last_seen: Timestamp | None = None


class DeviceSample(Struct, frozen=True, kw_only=True):
    """One device's live load; unknown values are ``None``, never a made-up zero."""

    device_id: str
    memory_used_mib: int | None = None
    util_pct: float | None = None
    temperature_c: float | None = None
    power_w: float | None = None
    health: Health = Health.HEALTHY
    xid: int | None = None


class TelemetrySampled(
    Struct, frozen=True, kw_only=True, tag_field="type", tag="xpupool.telemetry.sampled.v1"
):
    """A batch of device samples from one node; core NATS, the latest value wins."""

    node_id: str
    at: Timestamp
    samples: list[DeviceSample]


class DeviceHealthChanged(
    Struct, frozen=True, kw_only=True, tag_field="type", tag="xpupool.device.health.v1"
):
    """A device moved between health states."""

    node_id: str
    device_id: str
    previous: Health
    current: Health
    reason: Detail = ""
    at: Timestamp


class LeaseOverused(
    Struct, frozen=True, kw_only=True, tag_field="type", tag="xpupool.lease.overused.v1"
):
    """A lease's processes use more device memory than it was granted on one device."""

    node_id: str
    device_id: str
    lease_id: str
    job_id: str
    granted_memory_mib: int
    used_memory_mib: int
    at: Timestamp


# --------------------------------------------------------------------------------------------
# Autoscaling (autoscaler -> operators, scheduler): every decision says why and for what demand
# --------------------------------------------------------------------------------------------


class ScaleAction(StrEnum):
    """What a scale decision does to a pool. Public API: add, never rename."""

    SCALE_UP = "scale_up"
    """Nodes are requested from the pool's provider."""
    DRAIN = "drain"
    """Nodes stop taking new grants: the first step of scaling down."""
    UNDRAIN = "undrain"
    """Demand came back before a draining node was removed: it takes grants again."""
    PREEMPT = "preempt"
    """A draining node's leases are ended with the pool's grace period (drain policy preempt)."""
    REMOVE = "remove"
    """Drained nodes (no lease left) are given back to the provider."""


class ScaleReason(StrEnum):
    """Why the autoscaler decided what it did. Public API: add, never rename."""

    PENDING_DEMAND = "pending_demand"
    """Pending requests that the added capacity would let the scheduler place."""
    FORECAST = "forecast"
    """Predictive mode: the demand forecast at the provisioning horizon exceeds capacity."""
    BELOW_MIN_SIZE = "below_min_size"
    """The pool has fewer nodes than its ``min_size``."""
    IDLE = "idle"
    """Idle past the pool's cool-down while recent demand stayed below the low watermark."""
    DEMAND_RETURNED = "demand_returned"
    """Demand the pool could serve came back while the node was draining."""
    DRAINED = "drained"
    """The draining node holds no lease any more."""
    DRAIN_GRACE = "drain_grace"
    """The pool's drain policy preempts the leases left on a draining node, with a grace."""
    LOST = "lost"
    """A node that failed at its provider, or never registered by its scale-up's deadline,
    holding no lease: given back to the provider (its replacement is planned apart)."""


class DrainPolicy(StrEnum):
    """How a pool's nodes are emptied before removal."""

    WAIT = "wait"
    """Wait until every lease on the node has ended by itself."""
    PREEMPT = "preempt"
    """Preempt the remaining leases with the pool's grace period (``LeaseEnding`` first)."""


class ScaleDemand(Struct, frozen=True, kw_only=True):
    """The demand a decision answers: the pending jobs it serves (``job_ids`` lists at most
    1,024 of them, ``jobs`` counts all), their devices and normalised capacity units, and for
    a predictive decision the forecast it acted on."""

    job_ids: Annotated[list[Name], Meta(max_length=1024)] = field(default_factory=list)
    jobs: int = 0
    devices: float = 0.0
    capacity_units: float = 0.0
    forecast_devices: float | None = None


class ScaleDecision(
    Struct, frozen=True, kw_only=True, tag_field="type", tag="xpupool.scale.decision.v1"
):
    """One decision of the autoscaler about one pool, with its reason and the demand it answers.

    ``size_before``/``size_after`` count the pool's nodes that are ready or being provisioned
    and not draining; ``cost_per_hour_delta`` is what the decision adds (negative: saves)."""

    decision_id: Name
    pool: Name
    action: ScaleAction
    reason: ScaleReason
    detail: Detail = ""
    count: int = 0
    node_ids: Annotated[list[Name], Meta(max_length=1024)] = field(default_factory=list)
    size_before: int = 0
    size_after: int = 0
    demand: ScaleDemand = field(default_factory=ScaleDemand)
    cost_per_hour_delta: float = 0.0
    request_id: Name | None = None
    at: Timestamp


class NodeProvisioning(
    Struct, frozen=True, kw_only=True, tag_field="type", tag="xpupool.scale.provisioning.v1"
):
    """A provider was asked for ``count`` nodes of ``pool`` (``request_id`` is its idempotency
    key); the scheduler counts them as incoming capacity until they are ready or failed.
    ``node_ids`` are known only where the provider names nodes up front."""

    request_id: Name
    decision_id: Name
    pool: Name
    provider: Name
    count: int
    node_ids: Annotated[list[Name], Meta(max_length=1024)] = field(default_factory=list)
    job_ids: Annotated[list[Name], Meta(max_length=1024)] = field(default_factory=list)
    expected_ready_at: Timestamp | None = None
    at: Timestamp


class NodeReady(Struct, frozen=True, kw_only=True, tag_field="type", tag="xpupool.scale.ready.v1"):
    """A provisioned node sent its first telemetry: its devices are schedulable now."""

    pool: Name
    node_id: Name
    request_id: Name | None = None
    provisioned_s: float | None = None
    at: Timestamp


class NodeDraining(
    Struct, frozen=True, kw_only=True, tag_field="type", tag="xpupool.scale.draining.v1"
):
    """A node takes no new grants; it is removed once no lease remains on it (or, with
    ``policy`` preempt, its leases are ended with ``grace_s`` first)."""

    pool: Name
    node_id: Name
    decision_id: Name
    policy: DrainPolicy = DrainPolicy.WAIT
    grace_s: float = 0.0
    leases: int = 0
    at: Timestamp


class NodeRemoved(
    Struct, frozen=True, kw_only=True, tag_field="type", tag="xpupool.scale.removed.v1"
):
    """A drained node was given back to its provider."""

    pool: Name
    node_id: Name
    decision_id: Name
    request_id: Name
    at: Timestamp


class ScaleFailed(
    Struct, frozen=True, kw_only=True, tag_field="type", tag="xpupool.scale.failed.v1"
):
    """A provider could not carry out a request; the autoscaler retries with the same
    ``request_id`` (providers are idempotent by it)."""

    pool: Name
    request_id: Name
    action: ScaleAction
    error: Detail
    at: Timestamp


# --------------------------------------------------------------------------------------------
# Simulation control (tests, the demo): only simulated backends obey it
# --------------------------------------------------------------------------------------------


class InjectFault(Struct, frozen=True, kw_only=True, tag_field="type", tag="xpupool.sim.fault.v1"):
    """Make a simulated device misbehave (or recover) so health handling can be exercised."""

    node_id: str
    device_id: str = ""
    fault: Literal["xid", "overheat", "disappear", "clear", "kill_node"]
    xid_code: int = 79


class UsageSlice(Struct, frozen=True, kw_only=True):
    """One device (or share of it) a lease held, with what it was granted and what telemetry
    shows was used over the lease's life: capacity in device-seconds (a share counts its
    fraction ``share``), memory in MiB-seconds."""

    device_id: str
    node_id: str = ""
    vendor: str = "simulated"
    model: str = "unknown"
    whole: bool = False
    share: float = 0.0
    memory_mib: int = 0
    granted_capacity_s: float = 0.0
    used_capacity_s: float = 0.0
    granted_memory_mib_s: float = 0.0
    used_memory_mib_s: float = 0.0


class UsageRecord(Struct, frozen=True, kw_only=True):
    """What one lease used, written by the ledger in the script that ends it (one per lease)
    or computed up to now for a running lease (``running``). ``granted_ms`` is 0 for a
    reservation that was never claimed (it used nothing)."""

    lease_id: str
    job_id: str
    tenant: str
    queue: str
    granted_ms: int
    ended_ms: int
    end_reason: str
    duration_s: float
    slices: list[UsageSlice] = []
    running: bool = False
