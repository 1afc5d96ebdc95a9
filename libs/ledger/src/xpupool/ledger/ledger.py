"""The Redis device ledger behind one typed adapter.

Redis is the only truth about who holds which slice. Every state change that must be atomic is
one Lua script in ``lua/`` (each prefixed with ``_prelude.lua`` and the shared parts it includes,
see ``script_parts``); this class only builds their arguments and decodes their answers. Time
always comes from Redis ``TIME`` inside the scripts.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any, Final

import msgspec
from redis.asyncio import Redis
from redis.exceptions import NoScriptError

from xpupool.contracts import DeviceSample, DeviceSlice, DeviceSpec, Health, PoolShape, Vendor
from xpupool.ledger.group_commit import GroupCommit
from xpupool.ledger.held import HeldConnections, raise_first_error

_SPEC_DECODER = msgspec.json.Decoder(DeviceSpec)

TRACE_FIELDS: Final = ("traceparent", "tracestate")
"""The W3C trace-context fields a job and its lease keep (and the outbox relay reads)."""
AUTOSCALER_SHAPES: Final = "shapes"
"""``{ns}:autoscaler:<this>``: the pools' node shapes (``list[PoolShape]``), written by the acting
autoscaler (``xpupool.autoscaler.state``), read by the scheduler."""
AUTOSCALER_INCOMING: Final = "incoming"
"""``{ns}:autoscaler:<this>``: job id -> until when (epoch s) an in-flight scale-up is for it."""
DIRECT_OUTBOX: Final = "direct"
"""The outbox (``outbox:direct``) of events their writer publishes itself, right after its script
returns, and deletes once stored (``confirm_direct``); ``OutboxRelay``'s sweep publishes what a
writer left there (it died, or NATS did not answer)."""
VIEW_CHANGED: Final = "view_changed"
"""Why an admission was refused with nothing written: its placement was decided on a kept copy
of the ledger (``Admission.placement_view``) and the ledger changed since."""
SCHEDULER_STATE: Final = "scheduler"
"""``{ns}:<this>``: a hash of what the scheduler publishes for operators (field ``fair-share``:
``FairShareView``), written by the scheduler's metrics loop, read by ``xpupool status``."""
LEASE_STATES_CHUNK: Final = 1000
"""Lease ids ``Ledger.lease_states`` scans and reads per round trip (a few milliseconds of the
caller's event loop each)."""
INCOMING_OVERDUE_S: Final = 600.0
"""How long past its expected ready time (or since it was asked for, without one) a scale-up
still counts as incoming capacity: the autoscaler's ledger entries and the scheduler's view of
``NodeProvisioning`` events both give up on it then."""


class FairShareView(msgspec.Struct, frozen=True):
    """Each queue's decayed normalized usage (its subtree included), the quantity fair share
    ranks queues by (lowest first, against its weight), and the whole pool's (``total_units``,
    the implicit root's), as one scheduler replica last computed them at ``at_s``."""

    at_s: float
    units: dict[str, float]
    total_units: float


_FAIR_SHARE_DECODER = msgspec.json.Decoder(FairShareView)


ScriptArg = str | int | float | bytes
"""One argument of a ledger script (ARGV)."""


class ScriptResult(msgspec.Struct, frozen=True):
    """What every ledger script answers: ``ok`` and, on refusal, a reason and its subject."""

    ok: bool
    reason: str = ""
    detail: str = ""
    duplicate: bool = False
    lease_id: str = ""
    token: int = 0
    expires_ms: int = 0
    outcome: str = ""
    previous: str = ""
    since_ms: int = 0
    now_ms: int = 0
    added: list[str] = msgspec.field(default_factory=list)
    removed: list[str] = msgspec.field(default_factory=list)
    lost: list[str] = msgspec.field(default_factory=list)
    ended: list[str] = msgspec.field(default_factory=list)
    entry: str = ""
    """An event queued in the direct outbox for the caller to publish: its entry, for
    ``confirm_direct``."""
    lease: list[str] = msgspec.field(default_factory=list)
    """With ``entry``: the lease's hash as HGETALL answers it (``announced_lease``)."""
    change_seq: int = 0
    """A grant on admission: the change sequence it was logged (and announced) under."""
    grant: list[str] = msgspec.field(default_factory=list)
    """With ``entry``, from a holder's renewal or release: the lease's grant entry (its fields,
    flat) while it is still unconfirmed in the direct outbox (``unconfirmed_grant``)."""
    cursor: str = ""
    """A script that walks a set a chunk per call: where the next call starts ('0': done)."""


_LIST_FIELDS = ("added", "removed", "lost", "ended", "lease", "grant")

#: How long ended jobs' and ended leases' records are kept until a retention is set
#: (``DEFAULT_RETAIN_S`` in _prelude.lua).
DEFAULT_RETENTION_S: Final = 7 * 24 * 3600


class Retention(msgspec.Struct, frozen=True):
    """How long the ledger keeps what is over, in seconds: an ended job's record (its id is
    refused as a duplicate that long; a live job's record never expires) and an ended lease's
    (``lease.get`` answers for it, and an outbox entry about it can still be published, that
    long)."""

    job_s: int
    lease_s: int


class _RetentionSet(msgspec.Struct, frozen=True):
    job_s: str
    lease_s: str


_RETENTION_SET = msgspec.json.Decoder(_RetentionSet)


def _decode_result(raw: bytes | str) -> ScriptResult:
    """Decode a script's answer; Lua's cjson writes an empty list as ``{}``, so mend that."""
    data = msgspec.json.decode(raw)
    for name in _LIST_FIELDS:
        if data.get(name) == {}:
            data[name] = []
    return msgspec.convert(data, ScriptResult)


def new_lease_secret() -> str:
    """A lease's bearer secret: 192 bits from the OS's secure source, as hex (never starting
    with ``-``, which base64url text does one time in 64: a CLI would read it as an option)."""
    return secrets.token_hex(24)


@dataclass(frozen=True)
class Holder:
    """Who claims to hold a lease: the tenant whose subject the command came on (authenticated
    by NATS), the secret from the grant, and the fencing token."""

    tenant: str
    secret: str
    token: int


@dataclass(frozen=True)
class AdmissionLimits:
    """A tenant's admission limits: a token bucket (``rate_per_s`` <= 0: unlimited) and the most
    requests it may have pending at once (< 0: unlimited)."""

    rate_per_s: float = 0.0
    burst: int = 1
    max_pending: int = -1


class SliceMeta(msgspec.Struct, frozen=True):
    """Identity of a sliced device, kept with the lease so its events need no further reads;
    ``enforced`` is the scheduler's word on whether the share's limits hold (see
    ``DeviceSlice``), absent from leases recorded before it."""

    vendor: str
    model: str
    index: int
    uuid: str
    enforced: bool = False


class SliceClaim(msgspec.Struct, frozen=True):
    """One device (or share of it) a reservation asks for; ``whole`` takes the entire device."""

    device_id: str
    memory_mib: int = 0
    compute_pct: int = 0
    whole: bool = False
    meta: SliceMeta | None = None


class HostClaim(msgspec.Struct, frozen=True):
    """Host CPU and memory a reservation takes on one node."""

    cpu_milli: int
    memory_mib: int


class UsageClaim(msgspec.Struct, frozen=True):
    """A quota counter a reservation adds to, checked against ``limit`` (< 0: unlimited)."""

    scope: str
    field: str
    inc: float
    limit: float = -1.0


class Reservation(msgspec.Struct, frozen=True):
    """Everything the reserve script needs; serialised as its single argument."""

    job_id: str
    lease_id: str
    tenant: str
    queue: str
    priority: int
    owner: str
    ttl_ms: int
    hold_ms: int
    slices: list[SliceClaim]
    host: dict[str, HostClaim] = msgspec.field(default_factory=dict)
    usage: list[UsageClaim] = msgspec.field(default_factory=list)
    #: The longest the lease may live from its grant, renewals included (0: unbounded).
    max_runtime_ms: int = 0
    #: Reclaim the lease after its devices did no work this long (0: never; the queue opts in).
    idle_after_ms: int = 0
    #: Grant at once with this holder secret (``new_lease_secret``): the lease is active when
    #: the script returns. Empty: reserved only, for the lease-manager to grant. (A bearer
    #: secret: a Reservation is never logged.)
    secret: str = ""


@dataclass(frozen=True)
class Admission:
    """One request to admit (``pend.lua``): its queue order, its wait limit, its tenant's
    admission limits, its trace and, when the scheduler found room for it on arrival, the
    placement to grant at once (a ``Reservation`` with its secret)."""

    job_id: str
    priority: int
    request_json: bytes
    max_wait_ms: int | None
    reason: str
    detail: str = ""
    tenant: str = ""
    limits: AdmissionLimits = field(default_factory=AdmissionLimits)
    trace: Mapping[str, str] = field(default_factory=dict)
    placement: Reservation | None = None
    placement_view: ChangeCursor | None = None
    """The ledger view the placement was decided on, when the scheduler decided on its kept copy
    without reading the change log first: if anything changed since, the admission is refused
    before anything is written (``VIEW_CHANGED``), for the scheduler to decide again."""
    caller_follows_feed: bool = False
    """The caller follows the change feed and counts this admission's change as its own until it
    reads it (``SnapshotCache.own_change``): while it is the feed's only subscriber, the grant is
    not announced there (one message it would only skip)."""
    source: str = ""
    """The stream message the request came in (``<stream>:<sequence>``; '' by request/reply):
    kept with the job, so a redelivery of that very message after the job ended (its
    acknowledgement lost to a crash) is told apart from a resubmission, and is not rejected
    ``duplicate_job``, a second outcome for the job."""

    def script_args(self) -> list[ScriptArg]:
        return [
            self.job_id,
            self.priority,
            self.request_json,
            "" if self.max_wait_ms is None else self.max_wait_ms,
            self.reason,
            self.detail,
            self.tenant,
            self.limits.rate_per_s,
            self.limits.burst,
            self.limits.max_pending,
            self.trace.get("traceparent", ""),
            self.trace.get("tracestate", ""),
            b"" if self.placement is None else msgspec.json.encode(self.placement),
            "" if self.placement_view is None else self.placement_view.view,
            "1" if self.caller_follows_feed else "",
            self.source,
        ]


class TakenSlice(msgspec.Struct, frozen=True):
    """A slice as the ledger recorded it (whole devices record their full memory and compute)."""

    device_id: str
    node_id: str
    whole: bool
    memory_mib: int
    compute_pct: int
    meta: SliceMeta | None = None

    def to_contract(self) -> DeviceSlice:
        """The public form of this slice."""
        meta = self.meta or SliceMeta(vendor="simulated", model="unknown", index=0, uuid="")
        return DeviceSlice(
            device_id=self.device_id,
            node_id=self.node_id,
            vendor=Vendor(meta.vendor),
            model=meta.model,
            index=meta.index,
            uuid=meta.uuid,
            memory_mib=self.memory_mib,
            compute_pct=self.compute_pct,
            whole=self.whole,
            # A whole device is isolated by construction, whatever an older record said.
            enforced=self.whole or meta.enforced,
        )


@dataclass(frozen=True)
class DeviceRecord:
    """One device as the ledger holds it: its spec plus live free capacity, load and health."""

    spec: DeviceSpec
    node_id: str
    memory_total_mib: int
    memory_free_mib: int
    compute_free_pct: int
    holders: int
    exclusive: bool
    health: Health
    util_pct: float | None
    memory_used_mib: int | None


@dataclass(frozen=True)
class NodeRecord:
    """One node: host capacity, liveness and its devices."""

    node_id: str
    status: str
    cpu_total_milli: int
    cpu_free_milli: int
    memory_total_mib: int
    memory_free_mib: int
    last_seen_ms: int
    labels: dict[str, str]
    devices: list[DeviceRecord] = field(default_factory=list)
    draining: bool = False
    """Drained by the autoscaler: it takes no new grants (``reserve`` refuses them)."""


@dataclass(frozen=True)
class LeaseRecord:
    """One lease or reservation."""

    lease_id: str
    job_id: str
    tenant: str
    owner: str
    queue: str
    priority: int
    state: str
    slices: list[TakenSlice]
    token: int
    ttl_ms: int
    created_ms: int
    granted_ms: int | None
    expires_ms: int
    end_reason: str | None
    end_detail: str
    ended_ms: int | None
    host: dict[str, HostClaim] = field(default_factory=dict)
    usage: list[UsageClaim] = field(default_factory=list)
    preempted_for: str = ""
    secret: str = field(default="", repr=False)
    #: When the lease ends whatever the renewals (its maximum run time; None: unbounded).
    deadline_ms: int | None = None
    #: The trace context of its job (W3C ``traceparent``/``tracestate``; empty: untraced).
    trace: dict[str, str] = field(default_factory=dict, repr=False)
    #: Its grant's outbox entry (``Ledger.unconfirmed_grants``), and that outbox: the direct
    #: outbox for a grant on admission (empty), else the lease-manager's relayed one.
    grant_entry: str = ""
    grant_outbox: str = ""


@dataclass(frozen=True)
class ChangeCursor:
    """Where a reader of the change log stands: the change sequence it read, the log's epoch
    (stamped when the log started) and the redis-server process (its ``run_id``) it read from."""

    seq: int
    epoch: str
    server: str

    @property
    def view(self) -> str:
        """The ledger view this cursor read, as ``pend.lua`` compares it (``Admission``)."""
        return f"{self.epoch}|{self.seq}|{self.server}"


@dataclass(frozen=True)
class LedgerChanges:
    """What ``Ledger.changes_since`` answers: the records changed since the reader's cursor
    (only meaningful when ``complete``), the new cursor and the ledger version read with it."""

    cursor: ChangeCursor
    version: int
    complete: bool
    nodes: frozenset[str] = frozenset()
    devices: frozenset[str] = frozenset()
    leases: frozenset[str] = frozenset()
    now_ms: int = 0
    """The ledger's clock when the log was read."""
    records: ChangedRecords | None = None
    """The records the log names, read with it (when asked for, and not too many)."""


@dataclass(frozen=True)
class ChangedRecords:
    """The nodes and leases a change log names, as they were when it was read: a node as
    ``get_nodes`` reads it and a lease as ``live_leases`` does (None: gone, or not live). The
    nodes are those the log names and those of the devices it names (where they are now)."""

    nodes: Mapping[str, NodeRecord | None]
    leases: Mapping[str, LeaseRecord | None]


@dataclass(frozen=True)
class Growth:
    """What the autoscaler could add to the pool (``shapes``, its pools' node shapes) and the
    pending jobs its in-flight scale-ups are for, each until its deadline (ledger seconds)."""

    shapes: list[PoolShape]
    incoming_until: Mapping[str, float]

    def incoming(self, now_s: float) -> frozenset[str]:
        """The jobs whose scale-up is not overdue at ``now_s``."""
        return frozenset(job for job, until in self.incoming_until.items() if until >= now_s)


@dataclass(frozen=True)
class JobRecord:
    """What the ledger knows of a job id (the idempotency key)."""

    job_id: str
    state: str
    lease_id: str | None
    reason: str
    detail: str
    since_ms: int | None
    nominated: bool = False
    trace: dict[str, str] = field(default_factory=dict)
    """The job's W3C trace context (``traceparent``, ``tracestate``), empty when it has none."""


_GLOB_SPECIAL = re.compile(r"([*?\[\]\\])")


def glob_escaped(text: str) -> str:
    """``text`` with Redis's glob characters escaped, for a key pattern (SCAN MATCH, an ACL)."""
    return _GLOB_SPECIAL.sub(r"\\\1", text)


def _int(value: Any, default: int = 0) -> int:
    return int(float(value)) if value not in (None, b"", "") else default


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value or "")


_LUA = resources.files("xpupool.ledger") / "lua"
_INCLUDE = "-- include: "
SCRIPTS: Final = tuple(
    sorted(
        e.name.removesuffix(".lua")
        for e in _LUA.iterdir()
        if e.name.endswith(".lua") and not e.name.startswith("_")
    )
)
"""The ledger's transitions, by name (``lua/<name>.lua``)."""


def script_parts(name: str, lua: Traversable | None = None) -> list[str]:
    """The files one script is made of, in order: the prelude every script shares, the shared
    parts it names on ``-- include: _part`` lines, then its own file (in ``lua``, by default
    this package's scripts)."""
    own = ((lua or _LUA) / f"{name}.lua").read_text()
    included = [
        line.removeprefix(_INCLUDE).strip()
        for line in own.splitlines()
        if line.startswith(_INCLUDE)
    ]
    return ["_prelude", *included, name]


def script_source(name: str, lua: Traversable | None = None) -> str:
    """The whole source of one script as Redis runs it (see ``script_parts``); ``lua``: another
    version's script directory (a benchmark's baseline)."""
    scripts = lua or _LUA
    return "\n".join((scripts / f"{part}.lua").read_text() for part in script_parts(name, scripts))


class Ledger:
    """Typed access to one ledger namespace in Redis."""

    def __init__(self, redis: Redis, namespace: str = "xpupool") -> None:
        self._redis = redis
        self.prefix = "{" + namespace + "}:"
        # Every lua/*.lua but the shared parts (``_*.lua``) is one transition, registered by its
        # file name.
        self._scripts = {name: redis.register_script(script_source(name)) for name in SCRIPTS}
        self._held = HeldConnections(redis)
        # Per script, the calls made while its last batch was out (``_run_batched``).
        self._batches: dict[str, GroupCommit[Sequence[ScriptArg], ScriptResult]] = {}

    @property
    def redis(self) -> Redis:
        """The underlying client (for the outbox relay and tests)."""
        return self._redis

    def key(self, *parts: str) -> str:
        """A key of this ledger, as the scripts build it."""
        return self.prefix + ":".join(parts)

    def keys_of(self, family: str) -> str:
        """The pattern that matches every key of one family (``job`` for ``job:<id>``)."""
        return glob_escaped(self.key(family, "")) + "*"

    async def _call(self, script: str, args: Sequence[ScriptArg]) -> Any:
        """One script call's raw reply; a refusal is raised."""
        (reply,) = raise_first_error(await self._pipelined([(script, args)]))
        return reply

    async def _run(self, script: str, *args: ScriptArg) -> ScriptResult:
        return _decode_result(await self._call(script, args))

    async def _run_batched(self, script: str, *args: ScriptArg) -> ScriptResult:
        """``_run``, sent with the calls of the same script made while its last batch was out
        (``GroupCommit``): concurrent holder commands share one pipelined round trip, one
        fsync and, replied to together, one socket write of their answers."""
        batch = self._batches.get(script)
        if batch is None:
            batch = self._batches[script] = GroupCommit(functools.partial(self._run_many, script))
        return await batch.submit(args)

    async def _run_many(
        self, script: str, calls: Sequence[Sequence[ScriptArg]]
    ) -> list[ScriptResult]:
        """Run ``script`` once per argument list, in order, in one pipelined round trip
        (``_pipelined``); the first refusal is raised."""
        raw = raise_first_error(await self._pipelined([(script, args) for args in calls]))
        return [_decode_result(r) for r in raw]

    async def _pipelined(
        self, calls: Sequence[tuple[str, Sequence[ScriptArg]]], deciding: int | None = None
    ) -> list[Any]:
        """Run each (script, arguments) in order, in one pipelined round trip; the raw replies,
        a refusal as its exception.

        EVALSHA goes out directly: redis-py's scripts in a pipeline first ask ``SCRIPT EXISTS``
        on every execution, a round trip more. A server without the scripts (restarted, or its
        cache flushed) refuses every call with NOSCRIPT, so none ran: when one of the first
        ``deciding`` replies (all by default) is that refusal, the scripts are loaded and the
        round trip sent again, once."""
        commands = [("EVALSHA", self._scripts[name].sha, 1, self.prefix, *a) for name, a in calls]
        for attempt in range(2):
            replies = await self._held.execute(commands)
            if attempt == 0 and any(isinstance(r, NoScriptError) for r in replies[:deciding]):
                for name in dict.fromkeys(name for name, _ in calls):
                    await self._redis.script_load(self._scripts[name].script)
                continue
            break
        return replies

    # ---- inventory ---------------------------------------------------------------------------

    async def register_node(
        self,
        node_id: str,
        devices: Sequence[DeviceSpec],
        cpu_milli: int = 0,
        memory_mib: int = 0,
        labels: dict[str, str] | None = None,
        health: Mapping[str, tuple[Health, str]] | None = None,
        instance: str = "",
    ) -> ScriptResult:
        """Register or reconcile a node; leases on devices that vanished end as ``lost``, and so
        do those on a device whose UUID changed (another unit under the same id).

        ``health`` (device id -> health and reason, as the node's backend reads them now) is
        written in the same step; a device it leaves out keeps its health (a new one is
        healthy, one the node's loss marked lost is healthy again). ``instance``: the
        registering collector process, which holds the node from now on (``heartbeat``). The
        same process registering again after the node was lost (cut off, not restarted) finds
        the devices of its lost leases quarantined (``reap_nodes``): unhealthy until then,
        with the health given here kept for the quarantine's end; another process ends those
        quarantines.
        """
        readings = health or {}
        payload = {
            "node_id": node_id,
            "instance": instance,
            "cpu_milli": cpu_milli,
            "memory_mib": memory_mib,
            # Passed pre-encoded: cjson would turn an empty map into [].
            "labels_json": msgspec.json.encode(labels or {}).decode(),
            "devices": [
                {
                    "device_id": d.device_id,
                    "spec": msgspec.json.encode(d).decode(),
                    "memory_mib": d.memory_mib,
                    "uuid": d.uuid,
                    **(
                        {
                            "health": readings[d.device_id][0].value,
                            "health_reason": readings[d.device_id][1],
                        }
                        if d.device_id in readings
                        else {}
                    ),
                }
                for d in devices
            ],
        }
        return await self._run("register_node", msgspec.json.encode(payload))

    async def heartbeat(
        self, node_id: str, samples: Iterable[DeviceSample] = (), instance: str = ""
    ) -> ScriptResult:
        """Stamp the node's last-seen time from the ledger's clock, and write the live load of
        ``samples`` (last value wins; a changed utilisation goes into the change log) in the
        same script: a collector's tick costs one round trip and one fsync of the AOF. A node
        not registered and up is refused (it must register again) and its samples are not
        written. So is a collector ``instance`` other than the one that registered the node
        last (``node_claimed``, the holder's instance as the detail): two collectors under one
        node id (a cloned host, a copied configuration) would otherwise keep each other's node
        alive and write each other's load."""
        return await self._run("heartbeat", node_id, instance, *_sample_args(samples))

    async def reap_nodes(self, grace_ms: int, holder_grace_ms: int = 0) -> ScriptResult:
        """Declare lost the nodes silent for longer than ``grace_ms``; ends their leases, and
        quarantines each such lease's devices until its term ends plus ``holder_grace_ms`` (its
        holder, cut off with the node, may run until then): a node back sooner brings them up
        unhealthy. Lifts the quarantines that ran out."""
        return await self._run("reap_nodes", grace_ms, holder_grace_ms)

    async def set_health(self, device_id: str, health: Health, reason: str = "") -> ScriptResult:
        """Set a device's health; ``previous`` in the answer tells whether it changed. A
        quarantined device (``reap_nodes``) stays unhealthy and keeps ``health`` for the
        quarantine's end: ``previous`` is then ``health`` itself (no transition now)."""
        return await self._run("set_health", device_id, health.value, reason)

    async def pool_shapes(self) -> list[PoolShape]:
        """The nodes the autoscaler's pools could add (``{ns}:autoscaler:shapes``, written by
        the acting autoscaler each cycle); empty without an autoscaler or on a bad record."""
        return _pool_shapes(await self._redis.get(self.key("autoscaler", AUTOSCALER_SHAPES)))

    async def incoming_jobs(self, now_s: float) -> frozenset[str]:
        """The pending jobs in-flight scale-ups are for (``{ns}:autoscaler:incoming``, written
        by the acting autoscaler from its journal), until each scale-up is overdue."""
        raw = await self._redis.get(self.key("autoscaler", AUTOSCALER_INCOMING))
        return Growth([], _incoming_until(raw)).incoming(now_s)

    async def growth(self) -> Growth:
        """:meth:`pool_shapes` and the incoming jobs with their deadlines, in one round trip (a
        scheduling cycle reads both beside its read of the pool, whose clock then says which
        scale-ups are overdue: ``Growth.incoming``)."""
        shapes, incoming = await self._redis.mget(
            self.key("autoscaler", AUTOSCALER_SHAPES), self.key("autoscaler", AUTOSCALER_INCOMING)
        )
        return Growth(_pool_shapes(shapes), _incoming_until(incoming))

    async def set_node_draining(
        self, node_id: str, draining: bool, *, hold_unregistered: bool = False
    ) -> ScriptResult:
        """Drain a node (no new grants there; its leases run on) or take it back into service;
        ``previous`` in the answer is ``draining`` or ``in_service``. A node the ledger has
        not seen is refused (``unknown_node``), unless ``hold_unregistered``: the drain is then
        kept for it, and it comes up draining if it registers within a day (the autoscaler
        giving back a node that never registered in time)."""
        return await self._run(
            "set_draining", node_id, "1" if draining else "0", "1" if hold_unregistered else "0"
        )

    # ---- scheduling --------------------------------------------------------------------------

    async def reserve(self, reservation: Reservation) -> ScriptResult:
        """Atomically re-check and reserve; idempotent per job id."""
        return await self._run("reserve", msgspec.json.encode(reservation))

    async def reserve_many(self, reservations: Sequence[Reservation]) -> list[ScriptResult]:
        """:meth:`reserve` each, in order, in one round trip.

        Each is still its own atomic script (a refused one does not stop the next); sent
        together, Redis also makes them durable together instead of once per reservation.
        """
        if not reservations:
            return []
        return await self._run_many("reserve", [[msgspec.json.encode(r)] for r in reservations])

    async def pend(
        self,
        job_id: str,
        priority: int,
        request_json: bytes,
        max_wait_ms: int | None,
        reason: str,
        detail: str = "",
        *,
        tenant: str = "",
        limits: AdmissionLimits | None = None,
        trace: Mapping[str, str] | None = None,
    ) -> ScriptResult:
        """Admit a request into the persistent pending queue (idempotent per job id); refused
        with ``job_<state>`` when the job already went further (a duplicate), and a new request
        with ``rate_limited`` / ``too_many_pending`` when its tenant is over ``limits``.

        ``trace`` (a W3C carrier: ``traceparent``, ``tracestate``) is kept with the job and
        copied onto its lease, so every later step of the job continues that trace."""
        admission = Admission(
            job_id,
            priority,
            request_json,
            max_wait_ms,
            reason,
            detail,
            tenant=tenant,
            limits=limits or AdmissionLimits(),
            trace=trace or {},
        )
        return (await self.admit_many([admission]))[0]

    async def admit_many(self, admissions: Sequence[Admission]) -> list[ScriptResult]:
        """Admit each request, in order, in one round trip (each its own atomic ``pend.lua``;
        sent together, Redis makes them durable together).

        An admission with a ``placement`` is granted in the same step when the ledger accepts
        that placement and no other job waits (``outcome`` ``granted``, with the lease id,
        fencing token, the lease's record (``granted_lease``) and the grant's entry in the
        direct outbox, which the caller publishes and then confirms); otherwise it waits in
        the pending queue (``outcome`` ``pending``)."""
        if not admissions:
            return []
        return await self._run_many("pend", [a.script_args() for a in admissions])

    def granted_lease(self, result: ScriptResult) -> LeaseRecord | None:
        """The lease an admission granted (``admit_many``), as ``get_lease`` would read it."""
        if result.outcome != "granted":
            return None
        return self.announced_lease(result)

    def announced_lease(self, result: ScriptResult) -> LeaseRecord | None:
        """The lease whose event a script queued in the direct outbox for its caller to publish
        (a grant on admission, a holder's renewal or release with ``direct``), as ``get_lease``
        would read it right after the script."""
        if not (result.ok and result.entry and result.lease):
            return None
        return _lease(result.lease_id, _pairs(result.lease))

    def unconfirmed_grant(self, result: ScriptResult) -> dict[str, str] | None:
        """The grant entry a holder's renewal or release found unconfirmed (its event perhaps
        not yet stored), whose event is to be published before the command's own; else None."""
        return {_str(k): _str(v) for k, v in _pairs(result.grant).items()} if result.grant else None

    async def unconfirmed_grants(self, leases: Sequence[LeaseRecord]) -> dict[str, dict[str, str]]:
        """The grant entries of ``leases`` still in their outboxes (not yet confirmed stored by
        their publisher), by lease id, in one round trip (what ``unconfirmed_grant`` answers a
        holder's command, for the events a relay publishes)."""
        granted = [lease for lease in leases if lease.grant_entry]
        if not granted:
            return {}
        found = raise_first_error(
            await self._held.execute(
                [
                    (
                        "XRANGE",
                        self.key("outbox", lease.grant_outbox or DIRECT_OUTBOX),
                        lease.grant_entry,
                        lease.grant_entry,
                    )
                    for lease in granted
                ]
            )
        )
        return {
            lease.lease_id: {_str(k): _str(v) for k, v in _pairs(entries[0][1]).items()}
            for lease, entries in zip(granted, found, strict=True)
            if entries
        }

    async def confirm_direct(self, entry_ids: Sequence[str]) -> None:
        """Drop direct-outbox entries whose events their writer published and JetStream
        stored, so the lease-manager's relay never publishes them again."""
        if entry_ids:
            # On a held connection: it follows every grant and holder's release or renewal.
            raise_first_error(
                await self._held.execute([("XDEL", self.key("outbox", DIRECT_OUTBOX), *entry_ids)])
            )

    async def reap_relay_consumers(
        self, service: str, group: str, own: str, min_idle_ms: int
    ) -> list[str]:
        """Delete the consumers of ``service``'s outbox relay group (but ``own``) that hold no
        entry and have had none delivered for ``min_idle_ms``: the names of the relays that
        died or restarted (``reap_consumers.lua``, which checks and deletes in one step, so no
        pending entry is ever dropped with its consumer). The names deleted."""
        reply = await self._call("reap_consumers", [service, own, min_idle_ms, group])
        return [_str(name) for name in reply]

    async def any_pending(self) -> bool:
        """Whether any request waits in the pending queue (one read, no script)."""
        return bool(await self._redis.zcard(self.key("pending")))

    async def pending_count(self, tenant: str) -> int:
        """How many of ``tenant``'s requests wait in the pending queue."""
        return _int(await self._redis.hget(self.key("pending-count"), tenant))

    async def pending(self, limit: int = 1000) -> list[tuple[str, bytes | str]]:
        """The oldest-scored pending requests, as (job_id, request JSON)."""
        job_ids = [_str(j) for j in await self._redis.zrange(self.key("pending"), 0, limit - 1)]
        if not job_ids:
            return []
        bodies = await self._redis.mget([self.key("pending-req", j) for j in job_ids])
        return [(j, b) for j, b in zip(job_ids, bodies, strict=True) if b is not None]

    async def pending_jobs(
        self, limit: int = 1000, *, time_out_first: bool = False
    ) -> list[tuple[bytes | str, JobRecord]]:
        """The pending requests in score order with what the ledger knows of each job, in one
        round trip (``list_pending.lua``); with ``time_out_first``, those past their max wait
        are ended first (:meth:`time_out_pending`, sent ahead of the listing)."""
        calls: list[tuple[str, Sequence[ScriptArg]]] = [("list_pending", [limit])]
        if time_out_first:
            calls.insert(0, ("time_out_pending", [100]))
        listed = raise_first_error(await self._pipelined(calls))[-1]
        entries = [
            (_str(job_id), body, {_str(f): _str(v) for f, v in _pairs(row).items()})
            for job_id, body, row in zip(listed[0::3], listed[1::3], listed[2::3], strict=True)
            if body is not None
        ]
        jobs = []
        for job_id, body, r in entries:
            if r.get("state") != "pending":
                continue
            jobs.append(
                (
                    body,
                    JobRecord(
                        job_id=job_id,
                        state="pending",
                        lease_id=None,
                        reason=r.get("reason", ""),
                        detail=r.get("detail", ""),
                        since_ms=_int(r.get("since_ms")) or None,
                        nominated=r.get("nominated") == "1",
                        trace=_trace_of(r),
                    ),
                )
            )
        return jobs

    async def note_pending(
        self, job_id: str, reason: str, detail: str = "", nominated: bool | None = None
    ) -> bool:
        """Record why a pending job waits (for ``xpupool explain``); not a state change. False,
        and nothing written, when the job no longer waits (it ended since it was listed)."""
        flag = "" if nominated is None else "1" if nominated else "0"
        return (await self._run("note_pending", job_id, reason, detail, flag)).ok

    async def request_preemption(
        self, lease_id: str, job_id: str, grace_ms: int = 0
    ) -> ScriptResult:
        """Mark a lease as preempted for ``job_id`` and queue the EndLease command (outbox),
        which gives the holder ``grace_ms`` after its warning."""
        return await self._run("request_preemption", lease_id, job_id, grace_ms)

    async def end_after(self, lease_id: str, reason: str, grace_ms: int) -> ScriptResult:
        """End a lease ``grace_ms`` from now for ``reason`` (a preemption with grace): its
        holder is warned at once (``LeaseEnding`` through the outbox), renewals stop at the
        deadline, and the expiry sweep ends it then; idempotent."""
        return await self._run("end_after", lease_id, reason, grace_ms)

    async def drop_pending(
        self, job_id: str, reason: str, field_name: str | None, detail: str
    ) -> ScriptResult:
        """Reject a pending request for good; its terminal event goes through the outbox."""
        return await self._run("drop_pending", job_id, reason, field_name or "", detail)

    async def cancel_job(self, job_id: str, tenant: str) -> ScriptResult:
        """Cancel ``tenant``'s job: a waiting one ends (``outcome: cancelled``, its event goes
        through the outbox), a reserved or granted one's lease is asked to end (``outcome:
        releasing``); refused with ``unknown_job`` (none of this tenant's) or ``job_ended``."""
        return await self._run("cancel_job", job_id, tenant)

    async def acquire(self, name: str, owner: str, ttl_ms: int) -> bool:
        """Take (or extend) a short advisory lock."""
        return (await self._run("acquire", name, owner, ttl_ms)).ok

    async def release_lock(self, name: str, owner: str) -> None:
        """Give an advisory lock back if we hold it."""
        await self._run("release_lock", name, owner)

    async def time_out_pending(self, limit: int = 100) -> ScriptResult:
        """End pending requests past their max wait (events go through the outbox)."""
        return await self._run("time_out_pending", limit)

    # ---- leases ------------------------------------------------------------------------------

    async def grant(self, lease_id: str, secret: str | None = None) -> ScriptResult:
        """Turn a reservation into a lease with a fencing token and a holder secret (192 random
        bits unless given); idempotent: a duplicate keeps the first grant's token and secret."""
        return await self._run("grant", lease_id, secret or new_lease_secret())

    async def renew(
        self, lease_id: str, holder: Holder, ttl_ms: int | None = None, *, direct: bool = False
    ) -> ScriptResult:
        """Extend a lease for its holder; refused (``not_owner``, ``bad_secret``,
        ``lease_ended``, ``stale_token`` …) without touching it otherwise.

        ``direct``: the caller publishes the ``LeaseRenewed`` itself, so the entry goes to the
        direct outbox and the result carries it (``entry``) with the lease (``announced_lease``)."""
        return await self._run_batched(
            "renew",
            lease_id,
            holder.tenant,
            holder.secret,
            holder.token,
            "" if ttl_ms is None else ttl_ms,
            DIRECT_OUTBOX if direct else "",
        )

    async def release(self, lease_id: str, holder: Holder, *, direct: bool = False) -> ScriptResult:
        """End a lease on its holder's request, after the same checks as :meth:`renew`
        (``direct`` as there, for the ``LeaseEnded``)."""
        return await self._run_batched(
            "end",
            lease_id,
            "released",
            holder.tenant,
            holder.secret,
            holder.token,
            "",
            DIRECT_OUTBOX if direct else "",
        )

    async def end(self, lease_id: str, reason: str, detail: str = "") -> ScriptResult:
        """End a lease on the control plane's own authority (preemption); idempotent."""
        return await self._run_batched("end", lease_id, reason, "", "", "", detail)

    async def expire_due(self, limit: int = 256) -> ScriptResult:
        """End leases and reservations whose term has passed (``max_runtime`` for those at their
        deadline, ``expired`` for the rest)."""
        return await self._run("expire", limit)

    async def reclaim_idle(self, warning_ms: int, limit: int = 1024) -> ScriptResult:
        """Warn, then end ``idle`` after ``warning_ms``, every watched lease whose devices did no
        work for its queue's idle time (``ended`` lists the leases warned now)."""
        return await self._run("reclaim_idle", warning_ms, limit)

    async def warn_deadlines(self, warning_ms: int, limit: int = 256) -> ScriptResult:
        """Queue a ``LeaseEnding`` warning (once per lease) for every lease whose maximum run time
        ends within ``warning_ms``."""
        return await self._run("warn_deadlines", warning_ms, limit)

    # ---- retention ---------------------------------------------------------------------------

    async def set_retention(self, retention: Retention) -> Retention | None:
        """Keep ended jobs' and ended leases' records this long from their next end on (records
        already over keep their expiry); the retention it replaced, None if none was set."""
        raw = await self._call("set_retention", [retention.job_s, retention.lease_s])
        before = _RETENTION_SET.decode(raw)
        if not before.job_s or not before.lease_s:
            return None
        return Retention(job_s=int(before.job_s), lease_s=int(before.lease_s))

    async def retention(self) -> Retention:
        """How long the ledger keeps ended jobs' and ended leases' records (a week each by
        default, as ``retain_s`` in _prelude.lua)."""
        job_s, lease_s = await self._redis.hmget(self.key("retention"), ["job_s", "lease_s"])
        return Retention(
            job_s=_int(job_s, DEFAULT_RETENTION_S), lease_s=_int(lease_s, DEFAULT_RETENTION_S)
        )

    # ---- reads -------------------------------------------------------------------------------

    async def version(self) -> int:
        """A counter bumped by every change of capacity or health (cheap cache invalidation)."""
        return _int(await self._redis.get(self.key("ver")))

    async def changes_since(
        self,
        cursor: ChangeCursor | None,
        max_records: int = 0,
        known: Mapping[str, NodeRecord] | None = None,
    ) -> LedgerChanges:
        """The nodes, devices and leases changed since ``cursor`` (from the previous call), with
        the cursor for the next call and the ledger version, in one atomic read
        (``read_changes.lua``); with ``max_records``, the records they name too (``records``,
        left out when there are more than that).

        ``known``: the nodes as the caller read them up to ``cursor``. The script then sends
        only the devices that changed, and a changed node's other devices are taken from
        ``known``; a node with a device ``known`` lacks is left out of ``records`` (the caller
        reads it whole).

        ``complete`` is False when the change log cannot answer and the caller must read
        everything (``nodes()``, ``leases()``) after this call: no cursor yet, the log trimmed
        past it, started over (Redis flushed) or possibly rewound (another redis-server process:
        restarted from an older save, or failed over to a replica that lagged), in which case the
        sequence could have passed the cursor again without showing what was lost.
        """
        raw = await self._call("read_changes", _changes_args(cursor, max_records, known))
        return _parse_changes(raw, cursor, known)

    async def admit_and_read(
        self,
        admissions: Sequence[Admission],
        cursor: ChangeCursor | None,
        max_records: int = 0,
        known: Mapping[str, NodeRecord] | None = None,
    ) -> tuple[list[ScriptResult], LedgerChanges | None]:
        """``admit_many``, and ``changes_since`` read right after the admissions in the same
        round trip: the change log as it was once they were committed (their own changes in it),
        for a reader that would otherwise read it next, a round trip later. The read is None
        when it failed (the admissions stand; the reader reads on its own).

        A server without the scripts (restarted, or its cache flushed) refuses every admission
        with NOSCRIPT, so none ran: the scripts are loaded and everything sent again.
        """
        calls: list[tuple[str, Sequence[ScriptArg]]] = [
            ("pend", a.script_args()) for a in admissions
        ]
        calls.append(("read_changes", _changes_args(cursor, max_records, known)))
        # Only a refused admission sends the round trip again (the read alone failing leaves
        # the reader to read on its own).
        raw = await self._pipelined(calls, deciding=len(admissions))
        admitted, changes = raise_first_error(raw[:-1]), raw[-1]
        read_back = (
            None if isinstance(changes, Exception) else _parse_changes(changes, cursor, known)
        )
        return [_decode_result(r) for r in admitted], read_back

    async def follow_changes(
        self,
        on_change: Callable[[bool, int, bool], None],
        stop: asyncio.Event,
        retry_s: float = 0.5,
    ) -> None:
        """Follow the ledger's change feed until ``stop``: every script that changes a record
        publishes its change sequence there (``touched`` in ``_prelude.lua``).

        ``on_change(True, seq, load_only)`` is called for each change (its sequence; whether it
        was only live load, see ``_prelude.lua``), ``on_change(True, 0, False)`` once the feed is
        (re)subscribed and ``on_change(False, 0, False)`` when the feed is lost, since changes
        made meanwhile go unannounced (a reader then trusts nothing it kept until it read
        again). The messages carry no records: they tell a reader that keeps a copy (the
        scheduler's ``SnapshotCache``) to read the change log."""
        channel = self.key("changes-feed")
        while not stop.is_set():
            pubsub = self._redis.pubsub()
            try:
                await pubsub.subscribe(channel)
                # Messages are read without a timeout each (under load they come several per
                # grant); ``stop`` is watched beside them.
                listening = asyncio.ensure_future(_announce(pubsub, on_change))
                stopping = asyncio.ensure_future(stop.wait())
                try:
                    await asyncio.wait({listening, stopping}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    stopping.cancel()
                    listening.cancel()
                if listening.done() and not listening.cancelled():
                    listening.result()  # the connection's error, if it failed
            except asyncio.CancelledError:
                on_change(False, 0, False)
                raise
            except Exception:  # noqa: BLE001  (Redis away: lost until subscribed again)
                on_change(False, 0, False)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=retry_s)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
        on_change(False, 0, False)

    async def now_ms(self) -> int:
        """The ledger's clock."""
        seconds, micros = await self._redis.time()
        return int(seconds) * 1000 + int(micros) // 1000

    async def nodes(self) -> list[NodeRecord]:
        """Every node with its devices, read in two pipelined round trips."""
        node_ids = sorted(_str(n) for n in await self._redis.smembers(self.key("nodes")))
        return [n for n in await self._read_nodes(node_ids, members_only=False) if n is not None]

    async def get_nodes(self, node_ids: Sequence[str]) -> list[NodeRecord | None]:
        """The named nodes as ``nodes()`` reads them (None where not a registered node), in two
        pipelined round trips."""
        return await self._read_nodes(node_ids, members_only=True)

    async def get_nodes_and_leases(
        self, node_ids: Sequence[str], lease_ids: Sequence[str]
    ) -> tuple[list[NodeRecord | None], list[LeaseRecord | None]]:
        """:meth:`get_nodes` and :meth:`live_leases` together, in two round trips instead of
        three: the leases are read with the nodes' first one."""
        async with self._redis.pipeline(transaction=False) as pipe:
            self._queue_node_reads(pipe, node_ids, members_only=True)
            queued = len(pipe.command_stack)
            self._queue_lease_reads(pipe, lease_ids)
            raw = await pipe.execute()
        nodes = await self._finish_nodes(node_ids, raw[:queued], members_only=True)
        return nodes, self._live_leases_from(lease_ids, raw[queued:])

    def _queue_node_reads(self, pipe: Any, node_ids: Sequence[str], members_only: bool) -> None:
        for node_id in node_ids:
            pipe.hgetall(self.key("node", node_id))
            pipe.smembers(self.key("node-devices", node_id))
        if members_only and node_ids:
            pipe.smismember(self.key("nodes"), list(node_ids))

    def _queue_lease_reads(self, pipe: Any, lease_ids: Sequence[str]) -> None:
        for lease_id in lease_ids:
            pipe.hgetall(self.key("lease", lease_id))
        if lease_ids:
            pipe.smismember(self.key("leases"), list(lease_ids))

    def _live_leases_from(
        self, lease_ids: Sequence[str], raw: list[Any]
    ) -> list[LeaseRecord | None]:
        if not lease_ids:
            return []
        return [
            _lease(i, row) if row and live else None
            for i, row, live in zip(lease_ids, raw[:-1], raw[-1], strict=True)
        ]

    async def _read_nodes(
        self, node_ids: Sequence[str], members_only: bool
    ) -> list[NodeRecord | None]:
        async with self._redis.pipeline(transaction=False) as pipe:
            self._queue_node_reads(pipe, node_ids, members_only)
            raw = await pipe.execute()
        return await self._finish_nodes(node_ids, raw, members_only)

    async def _finish_nodes(
        self, node_ids: Sequence[str], raw: list[Any], members_only: bool
    ) -> list[NodeRecord | None]:
        """The nodes from their first round trip's answers, reading their devices (the
        second)."""
        node_rows = raw[0 : 2 * len(node_ids) : 2]
        device_ids = [sorted(_str(d) for d in ids) for ids in raw[1 : 2 * len(node_ids) : 2]]
        member = raw[-1] if members_only and node_ids else [True] * len(node_ids)
        async with self._redis.pipeline(transaction=False) as pipe:
            for ids in device_ids:
                for device_id in ids:
                    pipe.hgetall(self.key("dev", device_id))
            device_rows = iter(await pipe.execute())
        return [
            _member_node(node_id, known, row, [_device(node_id, next(device_rows)) for _ in ids])
            for node_id, row, ids, known in zip(
                node_ids, node_rows, device_ids, member, strict=True
            )
        ]

    async def node_devices(self, node_id: str) -> list[DeviceRecord]:
        """One node's devices (what the collector needs each tick), in two round trips."""
        ids = sorted(_str(d) for d in await self._redis.smembers(self.key("node-devices", node_id)))
        async with self._redis.pipeline(transaction=False) as pipe:
            for device_id in ids:
                pipe.hgetall(self.key("dev", device_id))
            rows = await pipe.execute()
        return [d for d in (_device(node_id, row) for row in rows) if d is not None]

    async def leases(self) -> list[LeaseRecord]:
        """Every live lease and reservation."""
        lease_ids = sorted(_str(x) for x in await self._redis.smembers(self.key("leases")))
        return [lease for lease in await self.get_leases(lease_ids) if lease is not None]

    async def lease_states(self, chunk: int = LEASE_STATES_CHUNK) -> dict[str, int]:
        """How many live leases and reservations are in each state, without reading them whole.

        The lease set is scanned ``chunk`` ids at a time and each chunk's states counted by one
        script (``lease_states.lua``), so the caller's event loop gets a turn between chunks
        and decodes ids and a few counts, not leases: reading and decoding every lease
        (``leases()``) took half a second at 10,000 leases, with turns of up to 80 ms that
        stalled every request the caller serves. Like ``leases()`` it is not one atomic read: a
        lease that comes or goes meanwhile may be missed, or counted in its new state; none is
        counted twice.
        """
        counts: dict[str, int] = {}
        seen: set[str] = set()
        cursor: int = 0
        while True:
            cursor, raw = await self._redis.sscan(self.key("leases"), cursor, count=chunk)
            ids = [lease_id for lease_id in map(_str, raw) if lease_id not in seen]
            seen.update(ids)
            if ids:
                raw_counts = await self._call("lease_states", ids)
                for state, n in zip(raw_counts[::2], raw_counts[1::2], strict=True):
                    counts[_str(state)] = counts.get(_str(state), 0) + int(n)
            if not cursor:
                return counts

    async def get_leases(self, lease_ids: Sequence[str]) -> list[LeaseRecord | None]:
        """The named leases (None where unknown), in one round trip."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for lease_id in lease_ids:
                pipe.hgetall(self.key("lease", lease_id))
            rows = await pipe.execute()
        return [_lease(i, r) if r else None for i, r in zip(lease_ids, rows, strict=True)]

    async def live_leases(self, lease_ids: Sequence[str]) -> list[LeaseRecord | None]:
        """The named leases as ``leases()`` reads them (None where not live), in one round
        trip."""
        if not lease_ids:
            return []
        async with self._redis.pipeline(transaction=False) as pipe:
            self._queue_lease_reads(pipe, lease_ids)
            raw = await pipe.execute()
        return self._live_leases_from(lease_ids, raw)

    async def trace_of(self, kind: str, record_id: str) -> dict[str, str]:
        """The trace context kept with a ``job`` or ``lease`` (empty when none, or gone)."""
        values = await self._redis.hmget(self.key(kind, record_id), list(TRACE_FIELDS))
        return {n: _str(v) for n, v in zip(TRACE_FIELDS, values, strict=True) if v}

    async def get_lease(self, lease_id: str) -> LeaseRecord | None:
        """One lease, or None."""
        return (await self.get_leases([lease_id]))[0]

    async def tenant_jobs(self, tenant: str, limit: int) -> list[JobRecord]:
        """``tenant``'s latest jobs, newest first (those whose record the ledger still keeps):
        its job index's, and the live jobs the index's trim (the job retention, the latest
        1,000) may have dropped: those of its live leases, and those still waiting. The trim
        drops the oldest entries, so they are looked for only when the index holds fewer than
        ``limit``; the waiting ones only when the tenant's count of waiting jobs says that some
        are not in the index (the queue holds every tenant's, so it is scanned only then)."""
        # The index and the count of waiting jobs in one round trip: Redis runs the two back
        # to back, so a job admitted meanwhile is in both or in neither.
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.zrange(self.key("tenant-jobs", tenant), 0, limit - 1, desc=True)
            pipe.hget(self.key("pending-count"), tenant)
            raw_ids, raw_waiting = await pipe.execute()
        indexed = [_str(i) for i in raw_ids]
        unindexed: list[str] = []
        if len(indexed) < limit:
            leases = await self.tenant_leases(tenant, len(indexed) + limit)
            unindexed = [lease.job_id for lease in leases if lease.job_id not in indexed]
        jobs = await self._jobs([*indexed, *dict.fromkeys(unindexed)])
        if len(indexed) < limit:
            waiting = sum(job.state == "pending" for job in jobs)
            if waiting < _int(raw_waiting):
                waiting_ids = await self._unindexed_waiting(tenant, {job.job_id for job in jobs})
                unindexed += waiting_ids
                jobs += await self._jobs(waiting_ids)
        if unindexed:
            # The index's order is its admission time, the record's since_ms (a stable sort keeps
            # the index's order among equals).
            jobs.sort(key=lambda job: job.since_ms or 0, reverse=True)
        return jobs[:limit]

    async def _jobs(self, job_ids: Sequence[str]) -> list[JobRecord]:
        """The records of these jobs that the ledger still keeps, in this order."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hgetall(self.key("job", job_id))
            rows = await pipe.execute()
        return [_job(j, row) for j, row in zip(job_ids, rows, strict=True) if row]

    async def _unindexed_waiting(
        self, tenant: str, listed: set[str], chunk: int = 1000
    ) -> list[str]:
        """``tenant``'s waiting jobs not in ``listed``, from the queue of every tenant's: scanned
        (``ZSCAN``: every job that waits throughout the scan is seen, however the queue changes
        meanwhile), a chunk of ids and their records' tenants per round trip."""
        found: dict[str, None] = {}
        cursor: int = 0
        while True:
            cursor, entries = await self._redis.zscan(self.key("pending"), cursor, count=chunk)
            ids = [_str(job_id) for job_id, _ in entries]
            async with self._redis.pipeline(transaction=False) as pipe:
                for job_id in ids:
                    pipe.hget(self.key("job", job_id), "tenant")
                owners = await pipe.execute()
            for job_id, owner in zip(ids, owners, strict=True):
                if owner is not None and _str(owner) == tenant and job_id not in listed:
                    found[job_id] = None  # a scan may return an id twice
            if cursor == 0:
                return list(found)

    async def tenant_leases(self, tenant: str, limit: int) -> list[LeaseRecord]:
        """``tenant``'s live leases (reserved or active), newest first, at most ``limit``: its set
        of live leases, which the reservation and end scripts keep."""
        lease_ids = [_str(i) for i in await self._redis.smembers(self.key("tenant-leases", tenant))]
        leases = [
            lease
            for lease in await self.live_leases(lease_ids)
            if lease is not None and lease.tenant == tenant
        ]
        leases.sort(key=lambda lease: (lease.created_ms, lease.lease_id), reverse=True)
        return leases[:limit]

    async def index_tenant_leases(self, chunk: int = 1000) -> int:
        """Put every live lease into its tenant's set of live leases (a ledger written before
        those sets: ``index_tenant_leases.lua``), a chunk per script call; how many it added.
        Once a pass has finished, the ledger remembers it and a later call is one round trip."""
        cursor, added = "0", 0
        while True:
            result = await self._run("index_tenant_leases", cursor, chunk)
            cursor, added = result.cursor, added + len(result.added)
            if cursor == "0":
                return added

    async def get_job(self, job_id: str) -> JobRecord | None:
        """What the ledger knows about a job id."""
        row = await self._redis.hgetall(self.key("job", job_id))
        if not row:
            return None
        return _job(job_id, row)

    async def usage(self, scope: str) -> dict[str, float]:
        """A quota scope's counters."""
        row = await self._redis.hgetall(self.key("usage", scope))
        return {_str(a): float(_str(b)) for a, b in row.items()}

    async def publish_fair_share(self, view: FairShareView) -> None:
        """Publish the scheduler's fair-share position for operators (last writer wins: every
        replica folds the same ledger usage, so their views agree up to a cycle)."""
        await self._redis.hset(self.key(SCHEDULER_STATE), "fair-share", msgspec.json.encode(view))

    async def fair_share(self) -> FairShareView | None:
        """The last published fair-share position, or None when no scheduler published one."""
        raw = await self._redis.hget(self.key(SCHEDULER_STATE), "fair-share")
        if raw is None:
            return None
        try:
            return _FAIR_SHARE_DECODER.decode(raw)
        except msgspec.ValidationError:
            return None  # written by another version: shown as unknown, never a crash


async def open_ledger(
    stack: AsyncExitStack, url: str, namespace: str, *, tls_ca: str = ""
) -> Ledger:
    """A ledger on its own Redis client, closed when ``stack`` closes. A ``rediss://`` URL
    (TLS; credentials as ``rediss://user:password@host:port/0``) verifies the server with
    ``tls_ca`` (default: the system's CAs)."""
    redis = Redis.from_url(url, ssl_ca_certs=tls_ca) if tls_ca else Redis.from_url(url)
    stack.push_async_callback(redis.aclose)
    return Ledger(redis, namespace)


async def _announce(pubsub: Any, on_change: Callable[[bool, int, bool], None]) -> None:
    """``Ledger.follow_changes``'s messages, as they come: ``<seq>``, or ``<seq>:load`` for a
    change of live load alone."""
    async for message in pubsub.listen():
        if message["type"] == "message":
            seq, _, kind = _str(message["data"]).partition(":")
            on_change(True, _int(seq), kind == "load")
        elif message["type"] == "subscribe":
            on_change(True, 0, False)  # live from here on (again)


def _sample_args(samples: Iterable[DeviceSample]) -> list[str]:
    """Samples as heartbeat.lua takes them: device id, utilisation, memory used ('' where
    unknown), each encoded as redis-py encodes numbers, so the stored form stays comparable."""
    args: list[str] = []
    for sample in samples:
        args += (
            sample.device_id,
            "" if sample.util_pct is None else repr(sample.util_pct),
            "" if sample.memory_used_mib is None else repr(sample.memory_used_mib),
        )
    return args


def _pairs(flat: Sequence[Any]) -> dict[Any, Any]:
    """A hash as a script returns it (HGETALL's flat list) as redis-py's dict."""
    return dict(zip(flat[0::2], flat[1::2], strict=True))


class _Incomplete:
    """A changed node whose unchanged devices the reader does not hold."""


_INCOMPLETE: Final = _Incomplete()


def _changed_node(
    node_id: str, row: Sequence[Any], known: NodeRecord | None
) -> NodeRecord | None | _Incomplete:
    """One node of ``read_changes.lua`` (``{node_id, member, hash, {device id, ...}, {device
    hash or nil, ...}}``), an unchanged device (nil) taken from ``known``, the node as read
    before; ``_INCOMPLETE`` when that lacks one."""
    member, node_hash, device_ids, rows = row[1], row[2], row[3], row[4]
    kept = {d.spec.device_id: d for d in known.devices} if known is not None else {}
    devices: list[DeviceRecord | None] = []
    for device_id, device_row in zip(device_ids, rows, strict=True):
        if device_row is not None:
            devices.append(_device(node_id, _pairs(device_row)))
        elif (device := kept.get(_str(device_id))) is not None:
            devices.append(device)
        else:
            return _INCOMPLETE
    return _member_node(node_id, bool(member), _pairs(node_hash), devices)


def _member_node(
    node_id: str, member: bool, row: dict[Any, Any], devices: Sequence[DeviceRecord | None]
) -> NodeRecord | None:
    """A node from its hash and its devices (in device id order; None: a device whose hash is
    gone); None when it is not a registered node."""
    if not member:
        return None
    return _node(node_id, row, [d for d in devices if d is not None])


def _device(node_id: str, row: dict[Any, Any]) -> DeviceRecord | None:
    if not row:
        return None
    r = {_str(a): _str(b) for a, b in row.items()}
    return DeviceRecord(
        spec=_SPEC_DECODER.decode(r["spec"]),
        node_id=node_id,
        memory_total_mib=_int(r.get("mem_total")),
        memory_free_mib=_int(r.get("mem_free")),
        compute_free_pct=_int(r.get("compute_free")),
        holders=_int(r.get("holders")),
        exclusive=r.get("exclusive") == "1",
        health=Health(r.get("health", "healthy")),
        util_pct=float(r["util"]) if r.get("util") else None,
        memory_used_mib=_int(r["mem_used"]) if r.get("mem_used") else None,
    )


def _node(node_id: str, row: dict[Any, Any], devices: list[DeviceRecord]) -> NodeRecord:
    r = {_str(a): _str(b) for a, b in row.items()}
    labels = msgspec.json.decode(r.get("labels") or "{}")
    return NodeRecord(
        node_id=node_id,
        status=r.get("status", "unknown"),
        cpu_total_milli=_int(r.get("cpu_total")),
        cpu_free_milli=_int(r.get("cpu_free")),
        memory_total_mib=_int(r.get("mem_total")),
        memory_free_mib=_int(r.get("mem_free")),
        last_seen_ms=_int(r.get("last_seen_ms")),
        labels=labels if isinstance(labels, dict) else {},
        devices=devices,
        draining=r.get("draining") == "1",
    )


_SLICES_DECODER = msgspec.json.Decoder(list[TakenSlice])
_SHAPES_DECODER = msgspec.json.Decoder(list[PoolShape])
_INCOMING_DECODER = msgspec.json.Decoder(dict[str, float])


def _pool_shapes(raw: bytes | str | None) -> list[PoolShape]:
    if not raw:
        return []
    try:
        return _SHAPES_DECODER.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return []


def _incoming_until(raw: bytes | str | None) -> dict[str, float]:
    if not raw:
        return {}
    try:
        return _INCOMING_DECODER.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError):
        return {}


_HOST_DECODER = msgspec.json.Decoder(dict[str, HostClaim])
_USAGE_DECODER = msgspec.json.Decoder(list[UsageClaim])


def _json_map(raw: str | None) -> str:
    """cjson writes an empty map as ``[]``; read that back as ``{}``."""
    return "{}" if not raw or raw == "[]" else raw


def _job(job_id: str, row: dict[Any, Any]) -> JobRecord:
    r = {_str(a): _str(b) for a, b in row.items()}
    return JobRecord(
        job_id=job_id,
        state=r.get("state", ""),
        lease_id=r.get("lease_id") or None,
        reason=r.get("reason", ""),
        detail=r.get("detail", ""),
        since_ms=_int(r.get("since_ms")) or None,
        trace=_trace_of(r),
    )


def _trace_of(row: Mapping[str, str]) -> dict[str, str]:
    """The W3C carrier kept in a job or lease hash (only the fields that are set)."""
    return {name: row[name] for name in TRACE_FIELDS if row.get(name)}


def _lease(lease_id: str, row: dict[Any, Any]) -> LeaseRecord:
    r = {_str(a): _str(b) for a, b in row.items()}
    return LeaseRecord(
        lease_id=lease_id,
        job_id=r.get("job_id", ""),
        tenant=r.get("tenant", ""),
        owner=r.get("owner", ""),
        queue=r.get("queue", ""),
        priority=_int(r.get("priority")),
        state=r.get("state", ""),
        slices=_SLICES_DECODER.decode(r.get("slices") or "[]"),
        token=_int(r.get("token")),
        ttl_ms=_int(r.get("ttl_ms")),
        created_ms=_int(r.get("created_ms")),
        granted_ms=_int(r.get("granted_ms")) or None,
        expires_ms=_int(r.get("expires_ms")),
        end_reason=r.get("end_reason") or None,
        end_detail=r.get("end_detail", ""),
        ended_ms=_int(r.get("ended_ms")) or None,
        host=_HOST_DECODER.decode(_json_map(r.get("host"))),
        usage=_USAGE_DECODER.decode(r.get("usage") or "[]") if r.get("usage") != "{}" else [],
        preempted_for=r.get("preempted_for", ""),
        secret=r.get("secret", ""),
        deadline_ms=_int(r.get("deadline_ms")) or None,
        trace={name: r[name] for name in TRACE_FIELDS if r.get(name)},
        grant_entry=r.get("grant_entry", ""),
        grant_outbox=r.get("grant_outbox", ""),
    )


def _changes_args(
    cursor: ChangeCursor | None, max_records: int, known: Mapping[str, NodeRecord] | None
) -> list[ScriptArg]:
    """``read_changes.lua``'s arguments for a reader at ``cursor``."""
    after = "" if cursor is None else str(cursor.seq)
    return [after, max_records, "1" if known is not None else ""]


def _parse_changes(
    raw: Any, cursor: ChangeCursor | None, known: Mapping[str, NodeRecord] | None
) -> LedgerChanges:
    """``read_changes.lua``'s answer to a reader at ``cursor`` (see ``changes_since``)."""
    header, entries, node_rows, lease_rows = raw
    epoch, seq, floor, version = (
        _str(header[0]),
        _int(header[1]),
        _int(header[2]),
        _int(header[3]),
    )
    now_ms = int(header[5]) * 1000 + int(header[6]) // 1000
    new = ChangeCursor(seq=seq, epoch=epoch, server=_str(header[4]))
    if (
        cursor is None
        or not epoch
        or (epoch, new.server) != (cursor.epoch, cursor.server)
        or not floor <= cursor.seq <= seq
    ):
        return LedgerChanges(cursor=new, version=version, complete=False, now_ms=now_ms)
    kinds: dict[str, set[str]] = {"node": set(), "dev": set(), "lease": set()}
    for entry in entries:
        kind, _, record_id = _str(entry).partition(":")
        kinds.setdefault(kind, set()).add(record_id)
    records = None
    if node_rows is not None and lease_rows is not None:
        nodes: dict[str, NodeRecord | None] = {}
        for row in node_rows:
            node_id = _str(row[0])
            node = _changed_node(node_id, row, (known or {}).get(node_id))
            if not isinstance(node, _Incomplete):
                nodes[node_id] = node
        records = ChangedRecords(
            nodes=nodes,
            leases={
                _str(lease_id): _lease(_str(lease_id), _pairs(row)) if row and live else None
                for lease_id, live, row in lease_rows
            },
        )
    return LedgerChanges(
        cursor=new,
        version=version,
        complete=True,
        nodes=frozenset(kinds["node"]),
        devices=frozenset(kinds["dev"]),
        leases=frozenset(kinds["lease"]),
        now_ms=now_ms,
        records=records,
    )
