"""The subject registry: every NATS subject and JetStream stream of xpupool, declared once.

Services, tests and the AsyncAPI generator all read this module; no subject literal appears
anywhere else. Subjects are lowercase dot tokens with a version: ``xpupool.<family>.v1.<event>``.

Two spaces:

- the **tenant space** ``xpupool.tenant.v1.<tenant>.…``: everything a tenant sends (job requests,
  lease commands) and receives (its outcomes and lease events, grants with their lease secret).
  The tenant token is the authenticated identity: NATS permissions pin each tenant to its own
  token, so services take the tenant from the subject, never from the payload alone;
- the **operator space** (every other family): internal commands between services, telemetry,
  and an operator copy of every tenant event with its secrets removed.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from typing import Final

import msgspec

from xpupool.contracts import payloads as p


@dataclass(frozen=True)
class Stream:
    """A JetStream stream and the subjects it captures."""

    name: str
    subjects: tuple[str, ...]
    work_queue: bool
    description: str
    max_age_s: float = 7 * 24 * 3600.0
    duplicate_window_s: float = 600.0


@dataclass(frozen=True)
class Channel:
    """One subject (template), the payload types it carries, who sends and who receives."""

    address: str
    payloads: tuple[type, ...]
    description: str
    sender: str
    receivers: tuple[str, ...]
    stream: Stream | None = None
    reply: type | None = None
    parameters: dict[str, str] = field(default_factory=dict)

    @property
    def pattern(self) -> str:
        """The address with every ``{param}`` token a NATS wildcard, for subscribing to all."""
        return ".".join("*" if t.startswith("{") else t for t in self.address.split("."))

    @property
    def tenant_scoped(self) -> bool:
        """Whether the subject carries the (authenticated) tenant token."""
        return "{tenant}" in self.address.split(".")

    def params_of(self, subject: str) -> dict[str, str] | None:
        """The ``{param}`` values of a concrete subject of this channel, or None if it is not one
        (wrong shape, or a tenant token that is not a valid tenant name)."""
        template, tokens = self.address.split("."), subject.split(".")
        if len(template) != len(tokens):
            return None
        params: dict[str, str] = {}
        for expected, token in zip(template, tokens, strict=True):
            if expected.startswith("{"):
                params[expected[1:-1]] = token
            elif expected != token:
                return None
        tenant = params.get("tenant")
        if tenant is not None and not TENANT_NAME.fullmatch(tenant):
            return None
        return params

    def subject(self, **params: str) -> str:
        """The concrete subject, with ``{param}`` tokens filled in."""
        return self.address.format(**params) if params else self.address


TENANT_NAME: Final = re.compile(p.TENANT_NAME_PATTERN)
TENANT_SPACE: Final = "xpupool.tenant.v1"

JOBS_STREAM: Final = Stream(
    name="XPUPOOL_JOBS",
    subjects=(f"{TENANT_SPACE}.*.jobs.requested",),
    work_queue=True,
    description="Accepted job requests until a scheduler has handled them (work queue).",
    # The ledger's job record (kept while the job lives and XPUPOOL_JOB_RETENTION_S after, 7
    # days by default) is the idempotency key, not Nats-Msg-Id: any tenant may set that header,
    # and one that took another's id within the window would have that tenant's request
    # dropped by the stream, unanswered. Every copy reaches the scheduler, which answers a retry
    # with nothing new and another request under a used id with duplicate_job. (NATS cannot
    # switch the window off, and 0 asks for its default, two minutes: the least it takes.)
    duplicate_window_s=0.1,
)
SCHED_STREAM: Final = Stream(
    name="XPUPOOL_SCHED",
    subjects=("xpupool.sched.v1.>",),
    work_queue=True,
    description="Scheduler-to-lease-manager commands: reservations to grant, leases to end.",
)
EVENTS_STREAM: Final = Stream(
    name="XPUPOOL_EVENTS",
    subjects=(
        "xpupool.jobs.v1.rejected",
        "xpupool.jobs.v1.pending",
        "xpupool.jobs.v1.timed_out",
        "xpupool.jobs.v1.cancelled",
        "xpupool.alloc.v1.>",
        "xpupool.nodes.v1.registered",
        "xpupool.nodes.v1.lost",
        "xpupool.devices.v1.>",
        "xpupool.scale.v1.>",
    ),
    work_queue=False,
    description="Public outcome events, kept for a week for any number of subscribers.",
)
TENANT_EVENTS_STREAM: Final = Stream(
    name="XPUPOOL_TENANT_EVENTS",
    subjects=(f"{TENANT_SPACE}.*.events.>",),
    work_queue=False,
    description=(
        "Each tenant's own outcome and lease events (grants with their lease secret): readable "
        "only by that tenant and the services, kept for a day."
    ),
    max_age_s=24 * 3600.0,
)
STREAMS: Final = (JOBS_STREAM, SCHED_STREAM, EVENTS_STREAM, TENANT_EVENTS_STREAM)

MAX_REQUEST_BYTES: Final = 65536
"""The largest payload (body) a service reads; a bigger one is answered ``payload_too_large``
unread (the bus's default ``MAX_MESSAGE_BYTES``), published in proto/ for foreign clients."""
SERVICE_ERROR_HEADERS: Final = ("Nats-Service-Error", "Nats-Service-Error-Code")
"""The headers of a reply that carries no body, only a service's error (the NATS micro
convention): the bus answers so when a handler fails or a reply would not fit."""

# The events that are no once-only transition: a later copy has a ce-id of its own.
REPEATABLE: Final = (
    "A JobPending (where a waiting job stands now) and a `duplicate_job` JobRejected (the answer "
    "to one other request under a used job id; the same request again gets none) are not "
    "once-only: each report has a ce-id of its own, and one may come again after a fault."
)

DELIVERY: Final = (
    "Every event is stored at least once; after a fault (a service or server restarted "
    "mid-publish) a core NATS subscriber may get it twice, each copy with the same ce-id (its "
    "Nats-Msg-Id: the streams keep one), so deduplicate by ce-id. "
    + REPEATABLE
    + " Per lease, a stream and a "
    "subscriber of its subjects get the AllocationGranted before any later event of that lease "
    "(LeaseRenewed, LeaseEnding, LeaseEnded), whichever service or replica published each, also "
    "when the holder renews or releases on the grant's submit reply. Events of different leases "
    "come in no promised order. A tenant reads its events on a plain subscription (it has no "
    "JetStream API): what it missed while disconnected it finds with jobs.list and leases.get, "
    "or by submitting the same job again (outcome `known`, with the live grant)."
)

REQUESTS: Final = (
    "A request is a core NATS publish with a reply subject (the reply-to of PUB or HPUB, not a "
    "header) under _INBOX. (every NATS client's own inboxes; on the secure server "
    "_INBOX.t.<tenant>.), answered there once with the operation's reply message. One that names "
    "another reply subject is handled, its events published, and not answered. A payload over "
    f"{MAX_REQUEST_BYTES:,} bytes is not read: it is refused with the code payload_too_large "
    "(a job request: rejected, its job named by the Nats-Msg-Id header), as a payload that does "
    "not decode is with invalid_request and the field to blame; a message over the server's "
    "max_payload (its INFO) is refused by the server itself, which closes the connection. A "
    "service that failed to handle a request, or whose reply would not fit max_payload, answers "
    f"with an empty body and the headers {SERVICE_ERROR_HEADERS[0]} (a description) and "
    f"{SERVICE_ERROR_HEADERS[1]} (500) (message ServiceError): the command may or may not have "
    "taken effect; query, or send it again (a job request is deduplicated by job_id). A request "
    "that no service subscribes to is answered by the server, when the client's CONNECT sets "
    "headers and no_responders, with an empty body and the status line `NATS/1.0 503`: nothing "
    "was done; send it again later."
)

TENANT_PARAM: Final = {
    "tenant": (
        f"the tenant's name ({p.TENANT_NAME_PATTERN}), pinned to its credentials by the server"
    )
}

JOB_REQUESTED: Final = Channel(
    TENANT_SPACE + ".{tenant}.jobs.requested",
    (p.JobRequested,),
    "Submit a job request as {tenant}. The job_id is the idempotency key: the same request "
    "sent again (a retry, here or by `jobs.submit`) gets no second outcome, another request "
    "under a used job_id is rejected `duplicate_job`. Job ids are one space for every tenant "
    "(one another tenant used is `duplicate_job` too): use UUIDs or a prefix of your own. Set"
    " header Nats-Msg-Id = job_id (it names the job in the rejection of a payload that does "
    "not decode); a payload `tenant` other than {tenant} is rejected. A publish with a reply "
    "subject is answered by the server with JetStream's PubAck (`stream`, `seq`); the job's "
    "outcome comes as events.",
    sender="upstream",
    receivers=("scheduler",),
    stream=JOBS_STREAM,
    parameters=TENANT_PARAM,
)
JOB_REJECTED: Final = Channel(
    "xpupool.jobs.v1.rejected",
    (p.JobRejected,),
    "Operator copy. Terminal: the request is invalid or can never be placed.",
    sender="scheduler",
    receivers=("operators",),
    stream=EVENTS_STREAM,
)
JOB_PENDING: Final = Channel(
    "xpupool.jobs.v1.pending",
    (p.JobPending,),
    "Operator copy. The request waits for capacity; the reason says why.",
    sender="scheduler",
    receivers=("operators",),
    stream=EVENTS_STREAM,
)
JOB_TIMED_OUT: Final = Channel(
    "xpupool.jobs.v1.timed_out",
    (p.JobTimedOut,),
    "Operator copy. Terminal: the request waited longer than its max_wait_s.",
    sender="scheduler",
    receivers=("operators",),
    stream=EVENTS_STREAM,
)
JOB_CANCELLED: Final = Channel(
    "xpupool.jobs.v1.cancelled",
    (p.JobCancelled,),
    "Operator copy. Terminal: a waiting request was cancelled by its tenant.",
    sender="scheduler",
    receivers=("operators",),
    stream=EVENTS_STREAM,
)
JOB_RESERVED: Final = Channel(
    "xpupool.sched.v1.reserved",
    (p.JobReserved,),
    "Internal: slices reserved in the ledger, to be turned into a lease.",
    sender="scheduler",
    receivers=("lease-manager",),
    stream=SCHED_STREAM,
)
LEASE_END: Final = Channel(
    "xpupool.sched.v1.end_lease",
    (p.EndLease,),
    "Internal: end a lease (a preemption by the scheduler, or by the autoscaler draining a node).",
    sender="scheduler",
    receivers=("lease-manager",),
    stream=SCHED_STREAM,
)
ALLOC_GRANTED: Final = Channel(
    "xpupool.alloc.v1.granted",
    (p.AllocationGranted,),
    "Operator copy of a grant: the slices and environment, never the lease secret.",
    # The scheduler publishes the grants it makes on admission; the lease-manager the rest.
    sender="scheduler or lease-manager",
    receivers=("operators", "scheduler"),
    stream=EVENTS_STREAM,
)
ALLOC_RENEWED: Final = Channel(
    "xpupool.alloc.v1.renewed",
    (p.LeaseRenewed,),
    "Operator copy. A lease's term was extended.",
    sender="lease-manager",
    receivers=("operators",),
    stream=EVENTS_STREAM,
)
ALLOC_ENDING: Final = Channel(
    "xpupool.alloc.v1.ending",
    (p.LeaseEnding,),
    "Operator copy. A lease will end at its deadline (max_runtime, preempted with grace, idle).",
    sender="lease-manager",
    receivers=("operators",),
    stream=EVENTS_STREAM,
)
ALLOC_ENDED: Final = Channel(
    "xpupool.alloc.v1.ended.{reason}",
    (p.LeaseEnded,),
    "Operator copy. Terminal: a lease ended (its reason is the subject's last token); its "
    "slices are free again.",
    sender="lease-manager",
    receivers=("operators", "scheduler"),
    stream=EVENTS_STREAM,
    parameters={"reason": "released | expired | preempted | lost | max_runtime | idle"},
)
LEASE_RENEW: Final = Channel(
    TENANT_SPACE + ".{tenant}.leases.renew",
    (p.RenewLease,),
    "Renew one of {tenant}'s leases (its lease_secret and fencing_token). Send as a request to "
    "get a LeaseReply, or publish to fire and forget.",
    sender="upstream",
    receivers=("lease-manager",),
    reply=p.LeaseReply,
    parameters=TENANT_PARAM,
)
LEASE_RELEASE: Final = Channel(
    TENANT_SPACE + ".{tenant}.leases.release",
    (p.ReleaseLease,),
    "Release one of {tenant}'s leases (its lease_secret and fencing_token). Send as a request "
    "to get a LeaseReply, or publish to fire and forget.",
    sender="upstream",
    receivers=("lease-manager",),
    reply=p.LeaseReply,
    parameters=TENANT_PARAM,
)

JOB_CANCEL: Final = Channel(
    TENANT_SPACE + ".{tenant}.jobs.cancel",
    (p.CancelJob,),
    "Cancel one of {tenant}'s jobs by id (request/reply, CancelReply): a waiting job ends with "
    "JobCancelled, a granted one's lease ends `released`.",
    sender="upstream",
    receivers=("scheduler",),
    reply=p.CancelReply,
    parameters=TENANT_PARAM,
)

JOB_SUBMIT: Final = Channel(
    TENANT_SPACE + ".{tenant}.jobs.submit",
    (p.JobRequested,),
    "Submit a job request as {tenant} and get its admission's outcome as the reply "
    "(SubmitReply): the grant when it was placed on arrival, the rejection, or that it waits. "
    "The same events are published as for jobs.requested. Not stored: a request that gets no "
    "reply may be sent again with the same job_id (the ledger deduplicates by job id), or "
    "published on jobs.requested instead; a payload `tenant` other than {tenant} is rejected.",
    sender="upstream",
    receivers=("scheduler",),
    reply=p.SubmitReply,
    parameters=TENANT_PARAM,
)
JOB_LIST: Final = Channel(
    TENANT_SPACE + ".{tenant}.jobs.list",
    (p.ListJobs,),
    "{tenant}'s jobs, newest first, with their state and why they wait (request/reply, JobList).",
    sender="upstream",
    receivers=("scheduler",),
    reply=p.JobList,
    parameters=TENANT_PARAM,
)
LEASE_GET: Final = Channel(
    TENANT_SPACE + ".{tenant}.leases.get",
    (p.GetLease,),
    "One of {tenant}'s leases by id, without its secret (request/reply, LeaseList).",
    sender="upstream",
    receivers=("lease-manager",),
    reply=p.LeaseList,
    parameters=TENANT_PARAM,
)
LEASE_LIST: Final = Channel(
    TENANT_SPACE + ".{tenant}.leases.list",
    (p.ListLeases,),
    "{tenant}'s live leases, newest first, without secrets (request/reply, LeaseList).",
    sender="upstream",
    receivers=("lease-manager",),
    reply=p.LeaseList,
    parameters=TENANT_PARAM,
)

# ---- what each tenant receives: its own events, in the tenant space ----------------------

TENANT_JOB_REJECTED: Final = Channel(
    TENANT_SPACE + ".{tenant}.events.rejected",
    (p.JobRejected,),
    "Terminal: the request is invalid, not allowed, or can never be placed; `reason` is a code.",
    sender="scheduler",
    receivers=("upstream",),
    stream=TENANT_EVENTS_STREAM,
    parameters=TENANT_PARAM,
)
TENANT_JOB_PENDING: Final = Channel(
    TENANT_SPACE + ".{tenant}.events.pending",
    (p.JobPending,),
    "The request waits for capacity; the reason says why.",
    sender="scheduler",
    receivers=("upstream",),
    stream=TENANT_EVENTS_STREAM,
    parameters=TENANT_PARAM,
)
TENANT_JOB_TIMED_OUT: Final = Channel(
    TENANT_SPACE + ".{tenant}.events.timed_out",
    (p.JobTimedOut,),
    "Terminal: the request waited longer than its max_wait_s.",
    sender="scheduler",
    receivers=("upstream",),
    stream=TENANT_EVENTS_STREAM,
    parameters=TENANT_PARAM,
)
TENANT_JOB_CANCELLED: Final = Channel(
    TENANT_SPACE + ".{tenant}.events.cancelled",
    (p.JobCancelled,),
    "Terminal: the waiting request was cancelled (xpupool.tenant.v1.{tenant}.jobs.cancel).",
    sender="scheduler",
    receivers=("upstream",),
    stream=TENANT_EVENTS_STREAM,
    parameters=TENANT_PARAM,
)
TENANT_ALLOC_GRANTED: Final = Channel(
    TENANT_SPACE + ".{tenant}.events.granted",
    (p.AllocationGranted,),
    "The job holds a lease: slices, environment, fencing token and the lease secret that "
    "renew and release must present. Delivered to the owning tenant only.",
    sender="scheduler or lease-manager",
    receivers=("upstream",),
    stream=TENANT_EVENTS_STREAM,
    parameters=TENANT_PARAM,
)
TENANT_ALLOC_RENEWED: Final = Channel(
    TENANT_SPACE + ".{tenant}.events.renewed",
    (p.LeaseRenewed,),
    "A lease's term was extended.",
    sender="lease-manager",
    receivers=("upstream",),
    stream=TENANT_EVENTS_STREAM,
    parameters=TENANT_PARAM,
)
TENANT_ALLOC_ENDING: Final = Channel(
    TENANT_SPACE + ".{tenant}.events.ending",
    (p.LeaseEnding,),
    "Warning: the lease ends at `deadline` (max_runtime, preempted with a grace period, or "
    "idle) whatever the renewals; save your work or release.",
    sender="lease-manager",
    receivers=("upstream",),
    stream=TENANT_EVENTS_STREAM,
    parameters=TENANT_PARAM,
)
TENANT_ALLOC_ENDED: Final = Channel(
    TENANT_SPACE + ".{tenant}.events.ended.{reason}",
    (p.LeaseEnded,),
    "Terminal: a lease ended; its slices are free again.",
    sender="lease-manager",
    receivers=("upstream",),
    stream=TENANT_EVENTS_STREAM,
    parameters={
        **TENANT_PARAM,
        "reason": "released | expired | preempted | lost | max_runtime | idle",
    },
)
NODE_REGISTERED: Final = Channel(
    "xpupool.nodes.v1.registered",
    (p.NodeRegistered,),
    "A node and its devices joined (or re-joined) the ledger.",
    sender="telemetry-collector",
    receivers=("scheduler", "autoscaler"),
    stream=EVENTS_STREAM,
)
NODE_HEARTBEAT: Final = Channel(
    "xpupool.nodes.v1.heartbeat.{node_id}",
    (p.NodeHeartbeat,),
    "A collector is alive (core NATS).",
    sender="telemetry-collector",
    receivers=("lease-manager",),
    parameters={"node_id": "the node's id"},
)
NODE_LOST: Final = Channel(
    "xpupool.nodes.v1.lost",
    (p.NodeLost,),
    "A node missed its heartbeats past the grace period.",
    sender="lease-manager",
    receivers=("upstream", "scheduler", "autoscaler"),
    stream=EVENTS_STREAM,
)
TELEMETRY: Final = Channel(
    "xpupool.telemetry.v1.{node_id}",
    (p.TelemetrySampled,),
    "Live device samples of one node (core NATS, latest value wins).",
    sender="telemetry-collector",
    receivers=("operators",),
    parameters={"node_id": "the node's id"},
)
DEVICE_HEALTH: Final = Channel(
    "xpupool.devices.v1.health",
    (p.DeviceHealthChanged,),
    "A device changed health state.",
    sender="telemetry-collector",
    receivers=("scheduler", "operators"),
    stream=EVENTS_STREAM,
)

LEASE_OVERUSED: Final = Channel(
    "xpupool.devices.v1.overused",
    (p.LeaseOverused,),
    "A lease uses more device memory than it was granted (over-use detection).",
    sender="telemetry-collector",
    receivers=("operators", "lease-manager"),
    stream=EVENTS_STREAM,
)
SCALE_DECISION: Final = Channel(
    "xpupool.scale.v1.decision",
    (p.ScaleDecision,),
    "An autoscaler decision about one pool (scale up, drain, undrain, preempt, remove), with its "
    "reason and the demand it answers (job ids, devices, capacity units, forecast).",
    sender="autoscaler",
    receivers=("operators",),
    stream=EVENTS_STREAM,
)
SCALE_PROVISIONING: Final = Channel(
    "xpupool.scale.v1.provisioning",
    (p.NodeProvisioning,),
    "Nodes were requested from a pool's provider: capacity incoming for the listed jobs.",
    sender="autoscaler",
    receivers=("scheduler", "operators"),
    stream=EVENTS_STREAM,
)
SCALE_READY: Final = Channel(
    "xpupool.scale.v1.ready",
    (p.NodeReady,),
    "A provisioned node sent its first telemetry; its devices are schedulable.",
    sender="autoscaler",
    receivers=("scheduler", "operators"),
    stream=EVENTS_STREAM,
)
SCALE_DRAINING: Final = Channel(
    "xpupool.scale.v1.draining",
    (p.NodeDraining,),
    "A node takes no new grants until it is removed or undrained.",
    sender="autoscaler",
    receivers=("scheduler", "lease-manager", "operators"),
    stream=EVENTS_STREAM,
)
SCALE_REMOVED: Final = Channel(
    "xpupool.scale.v1.removed",
    (p.NodeRemoved,),
    "A drained node was given back to its provider.",
    sender="autoscaler",
    receivers=("scheduler", "operators"),
    stream=EVENTS_STREAM,
)
SCALE_FAILED: Final = Channel(
    "xpupool.scale.v1.failed",
    (p.ScaleFailed,),
    "A provider request failed; it is retried with the same request id.",
    sender="autoscaler",
    receivers=("operators",),
    stream=EVENTS_STREAM,
)
SIM_FAULT: Final = Channel(
    "xpupool.sim.v1.fault.{node_id}",
    (p.InjectFault,),
    "Test and demo control: inject a fault into a simulated node (real backends ignore it).",
    sender="operators",
    receivers=("telemetry-collector",),
    parameters={"node_id": "the node's id"},
)

# Operator channel -> the tenant channel that carries the owner's copy of the same event.
TENANT_COPIES: Final[dict[str, Channel]] = {
    JOB_REJECTED.address: TENANT_JOB_REJECTED,
    JOB_PENDING.address: TENANT_JOB_PENDING,
    JOB_TIMED_OUT.address: TENANT_JOB_TIMED_OUT,
    JOB_CANCELLED.address: TENANT_JOB_CANCELLED,
    ALLOC_GRANTED.address: TENANT_ALLOC_GRANTED,
    ALLOC_RENEWED.address: TENANT_ALLOC_RENEWED,
    ALLOC_ENDING.address: TENANT_ALLOC_ENDING,
    ALLOC_ENDED.address: TENANT_ALLOC_ENDED,
}

CHANNELS: Final[tuple[Channel, ...]] = (
    JOB_REQUESTED,
    JOB_REJECTED,
    JOB_PENDING,
    JOB_TIMED_OUT,
    JOB_CANCELLED,
    JOB_RESERVED,
    LEASE_END,
    ALLOC_GRANTED,
    ALLOC_RENEWED,
    ALLOC_ENDING,
    ALLOC_ENDED,
    LEASE_RENEW,
    LEASE_RELEASE,
    JOB_SUBMIT,
    JOB_CANCEL,
    JOB_LIST,
    LEASE_GET,
    LEASE_LIST,
    NODE_REGISTERED,
    NODE_HEARTBEAT,
    NODE_LOST,
    TELEMETRY,
    DEVICE_HEALTH,
    LEASE_OVERUSED,
    SCALE_DECISION,
    SCALE_PROVISIONING,
    SCALE_READY,
    SCALE_DRAINING,
    SCALE_REMOVED,
    SCALE_FAILED,
    SIM_FAULT,
    TENANT_JOB_REJECTED,
    TENANT_JOB_PENDING,
    TENANT_JOB_TIMED_OUT,
    TENANT_JOB_CANCELLED,
    TENANT_ALLOC_GRANTED,
    TENANT_ALLOC_RENEWED,
    TENANT_ALLOC_ENDING,
    TENANT_ALLOC_ENDED,
)


@dataclass(frozen=True)
class Durable:
    """A durable JetStream consumer a service pulls one channel's stream with (replicas share it).

    Its ``num_waiting`` pull requests are the readiness signal tools wait for: a service that is
    pulling is ready to take the channel's messages.
    """

    name: str
    channel: Channel
    service: str

    def __post_init__(self) -> None:
        if self.channel.stream is None:
            raise ValueError(f"{self.channel.address} is not on a stream")

    @property
    def stream(self) -> Stream:
        """The stream the consumer reads."""
        stream = self.channel.stream
        assert stream is not None  # checked at construction
        return stream


SCHEDULER_JOBS: Final = Durable("scheduler-jobs", JOB_REQUESTED, "scheduler")
LEASE_MANAGER_GRANTS: Final = Durable("lease-manager-grants", JOB_RESERVED, "lease-manager")
LEASE_MANAGER_ENDS: Final = Durable("lease-manager-ends", LEASE_END, "lease-manager")

DURABLES: Final[tuple[Durable, ...]] = (SCHEDULER_JOBS, LEASE_MANAGER_GRANTS, LEASE_MANAGER_ENDS)


def channel_of(event: object) -> Channel:
    """The channel a payload type is published on (the operator copy for tenant events; the
    tenant's own command channel for job requests and lease commands)."""
    for channel in CHANNELS:
        if type(event) in channel.payloads:
            return channel
    raise KeyError(f"no channel carries {type(event).__name__}")


def _subject_on(channel: Channel, event: object) -> str:
    params: dict[str, str] = {}
    if channel.tenant_scoped:
        params["tenant"] = str(getattr(event, "tenant", "") or "")
    if isinstance(event, p.LeaseEnded):
        params["reason"] = event.reason.value
    if isinstance(event, p.NodeHeartbeat | p.TelemetrySampled | p.InjectFault):
        params["node_id"] = event.node_id
    return channel.subject(**params)


def subject_of(event: object) -> str:
    """The concrete subject an event is published on, parameters taken from the event."""
    return _subject_on(channel_of(event), event)


def redacted(event: msgspec.Struct) -> msgspec.Struct:
    """The event without anything only its owner may see (the lease secret)."""
    if isinstance(event, p.AllocationGranted) and event.lease_secret is not None:
        return msgspec.structs.replace(event, lease_secret=None)
    return event


def deliveries(event: msgspec.Struct) -> list[tuple[Channel, str, msgspec.Struct]]:
    """Where one event goes, and in what form: for an event of a known tenant, that tenant's
    own copy in the tenant space first (the one a job waits on), then its channel (operator
    copies with secrets removed)."""
    channel = channel_of(event)
    tenant_channel = TENANT_COPIES.get(channel.address)
    tenant = getattr(event, "tenant", None)
    if tenant_channel is None:
        return [(channel, _subject_on(channel, event), event)]
    out: list[tuple[Channel, str, msgspec.Struct]] = []
    if tenant and TENANT_NAME.fullmatch(tenant):
        out.append((tenant_channel, _subject_on(tenant_channel, event), event))
    out.append((channel, _subject_on(channel, event), redacted(event)))
    return out


def dedup_id(event: object) -> str | None:
    """A deterministic event id for once-only transitions, so a republish after a crash is
    deduplicated by JetStream (``Nats-Msg-Id``) and recognised by consumers (``ce-id``)."""
    match event:
        case p.JobRequested(job_id=job_id):
            return job_id
        case p.JobRejected(reason=p.JobReason.DUPLICATE_JOB):
            # Each resubmission gets its own answer: not a once-only transition.
            return None
        case p.JobRejected(job_id=job_id) if job_id:
            # Two different rejections of one job id (a corrected resubmission refused again for
            # another reason) are two events; the same rejection redelivered is one.
            what = f"{event.reason}|{event.field_name}|{event.detail}".encode()
            return f"{job_id}:rejected:{hashlib.sha256(what).hexdigest()[:16]}"
        case p.JobTimedOut(job_id=job_id):
            return f"{job_id}:timed_out"
        case p.JobCancelled(job_id=job_id):
            return f"{job_id}:cancelled"
        case p.JobReserved(job_id=job_id):
            return f"{job_id}:reserved"
        case p.AllocationGranted(lease_id=lease_id):
            return f"{lease_id}:granted"
        case p.LeaseRenewed(lease_id=lease_id, expires_at=expires_at):
            return f"{lease_id}:renewed:{expires_at.timestamp():.3f}"
        case p.LeaseEnding(lease_id=lease_id, reason=reason):
            return f"{lease_id}:ending:{reason.value}"
        case p.LeaseEnded(lease_id=lease_id):
            return f"{lease_id}:ended"
        case p.EndLease(lease_id=lease_id, reason=reason):
            return f"{lease_id}:end:{reason.value}"
        case p.ScaleDecision(decision_id=decision_id):
            return f"scale:{decision_id}"
        case p.NodeProvisioning(request_id=request_id):
            # A replica that takes over re-announces in-flight requests: one event per request.
            return f"scale:{request_id}:provisioning"
        case p.NodeReady(node_id=node_id, request_id=request_id) if request_id:
            return f"scale:{node_id}:ready:{request_id}"
        case p.NodeDraining(node_id=node_id, decision_id=decision_id):
            return f"scale:{node_id}:draining:{decision_id}"
        case p.NodeRemoved(node_id=node_id, request_id=request_id):
            return f"scale:{node_id}:removed:{request_id}"
    return None
