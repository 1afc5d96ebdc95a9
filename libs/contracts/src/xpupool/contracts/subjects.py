"""The subject registry: every NATS subject and JetStream stream of xpupool, declared once.

Services, tests and the AsyncAPI generator all read this module; no subject literal appears
anywhere else. Subjects are lowercase dot tokens with a version: ``xpupool.<family>.v1.<event>``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

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

    def subject(self, **params: str) -> str:
        """The concrete subject, with ``{param}`` tokens filled in."""
        return self.address.format(**params) if params else self.address


JOBS_STREAM: Final = Stream(
    name="XPUPOOL_JOBS",
    subjects=("xpupool.jobs.v1.requested",),
    work_queue=True,
    description="Accepted job requests until a scheduler has handled them (work queue).",
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
        "xpupool.alloc.v1.>",
        "xpupool.nodes.v1.registered",
        "xpupool.nodes.v1.lost",
        "xpupool.devices.v1.>",
    ),
    work_queue=False,
    description="Public outcome events, kept for a week for any number of subscribers.",
)
STREAMS: Final = (JOBS_STREAM, SCHED_STREAM, EVENTS_STREAM)

JOB_REQUESTED: Final = Channel(
    "xpupool.jobs.v1.requested",
    (p.JobRequested,),
    "Submit a job request. Publish with header Nats-Msg-Id = job_id so retries deduplicate.",
    sender="upstream",
    receivers=("scheduler",),
    stream=JOBS_STREAM,
)
JOB_REJECTED: Final = Channel(
    "xpupool.jobs.v1.rejected",
    (p.JobRejected,),
    "Terminal: the request is invalid or can never be placed.",
    sender="scheduler",
    receivers=("upstream",),
    stream=EVENTS_STREAM,
)
JOB_PENDING: Final = Channel(
    "xpupool.jobs.v1.pending",
    (p.JobPending,),
    "The request waits for capacity; the reason says why.",
    sender="scheduler",
    receivers=("upstream",),
    stream=EVENTS_STREAM,
)
JOB_TIMED_OUT: Final = Channel(
    "xpupool.jobs.v1.timed_out",
    (p.JobTimedOut,),
    "Terminal: the request waited longer than its max_wait_s.",
    sender="scheduler",
    receivers=("upstream",),
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
    "Internal: end a lease (preemption).",
    sender="scheduler",
    receivers=("lease-manager",),
    stream=SCHED_STREAM,
)
ALLOC_GRANTED: Final = Channel(
    "xpupool.alloc.v1.granted",
    (p.AllocationGranted,),
    "The job holds a lease; the payload carries the slices and the environment to run with.",
    sender="lease-manager",
    receivers=("upstream", "scheduler"),
    stream=EVENTS_STREAM,
)
ALLOC_RENEWED: Final = Channel(
    "xpupool.alloc.v1.renewed",
    (p.LeaseRenewed,),
    "A lease's term was extended.",
    sender="lease-manager",
    receivers=("upstream",),
    stream=EVENTS_STREAM,
)
ALLOC_ENDED: Final = Channel(
    "xpupool.alloc.v1.ended.{reason}",
    (p.LeaseEnded,),
    "Terminal: a lease ended (released, expired, preempted or lost); its slices are free again.",
    sender="lease-manager",
    receivers=("upstream", "scheduler"),
    stream=EVENTS_STREAM,
    parameters={"reason": "released | expired | preempted | lost"},
)
LEASE_RENEW: Final = Channel(
    "xpupool.leases.v1.renew",
    (p.RenewLease,),
    "Renew a lease. Send as a request to get a LeaseReply, or publish to fire and forget.",
    sender="upstream",
    receivers=("lease-manager",),
    reply=p.LeaseReply,
)
LEASE_RELEASE: Final = Channel(
    "xpupool.leases.v1.release",
    (p.ReleaseLease,),
    "Release a lease. Send as a request to get a LeaseReply, or publish to fire and forget.",
    sender="upstream",
    receivers=("lease-manager",),
    reply=p.LeaseReply,
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
SIM_FAULT: Final = Channel(
    "xpupool.sim.v1.fault.{node_id}",
    (p.InjectFault,),
    "Test and demo control: inject a fault into a simulated node (real backends ignore it).",
    sender="operators",
    receivers=("telemetry-collector",),
    parameters={"node_id": "the node's id"},
)

CHANNELS: Final[tuple[Channel, ...]] = (
    JOB_REQUESTED,
    JOB_REJECTED,
    JOB_PENDING,
    JOB_TIMED_OUT,
    JOB_RESERVED,
    LEASE_END,
    ALLOC_GRANTED,
    ALLOC_RENEWED,
    ALLOC_ENDED,
    LEASE_RENEW,
    LEASE_RELEASE,
    NODE_REGISTERED,
    NODE_HEARTBEAT,
    NODE_LOST,
    TELEMETRY,
    DEVICE_HEALTH,
    LEASE_OVERUSED,
    SIM_FAULT,
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
    """The channel a payload type is published on."""
    for channel in CHANNELS:
        if type(event) in channel.payloads:
            return channel
    raise KeyError(f"no channel carries {type(event).__name__}")


def subject_of(event: object) -> str:
    """The concrete subject an event is published on, parameters taken from the event."""
    channel = channel_of(event)
    if isinstance(event, p.LeaseEnded):
        return channel.subject(reason=event.reason.value)
    if isinstance(event, p.NodeHeartbeat | p.TelemetrySampled | p.InjectFault):
        return channel.subject(node_id=event.node_id)
    return channel.subject()


def dedup_id(event: object) -> str | None:
    """A deterministic event id for once-only transitions, so a republish after a crash is
    deduplicated by JetStream (``Nats-Msg-Id``) and recognised by consumers (``ce-id``)."""
    match event:
        case p.JobRequested(job_id=job_id):
            return job_id
        case p.JobRejected(job_id=job_id) if job_id:
            return f"{job_id}:rejected"
        case p.JobTimedOut(job_id=job_id):
            return f"{job_id}:timed_out"
        case p.JobReserved(job_id=job_id):
            return f"{job_id}:reserved"
        case p.AllocationGranted(lease_id=lease_id):
            return f"{lease_id}:granted"
        case p.LeaseRenewed(lease_id=lease_id, expires_at=expires_at):
            return f"{lease_id}:renewed:{expires_at.timestamp():.3f}"
        case p.LeaseEnded(lease_id=lease_id):
            return f"{lease_id}:ended"
        case p.EndLease(lease_id=lease_id, reason=reason):
            return f"{lease_id}:end:{reason.value}"
    return None
