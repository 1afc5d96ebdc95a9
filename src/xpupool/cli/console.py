"""The operator console: ``xpupool status`` (pool and queue summary), ``xpupool top`` (the same,
live, with the latest events) and ``xpupool events``.

The view models are pure functions of ledger records and event payloads, so they are tested
without servers; the commands below them only read (the ledger's read APIs, JetStream) and
render (a rich table on a terminal, JSON otherwise).
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as Nats
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy
from redis.asyncio import Redis
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from xpupool.bus.connection import connect_client, round_trip
from xpupool.contracts import Health
from xpupool.contracts import subjects as s
from xpupool.contracts.access import OPERATOR, service_inbox, tenant_inbox
from xpupool.ledger import Ledger
from xpupool.ledger.ledger import DeviceRecord, LeaseRecord, NodeRecord

#: The queue a lease or request is shown under when it names none.
NO_QUEUE = "(none)"
#: A fair-share view older than this (no scheduler publishing) is not shown.
FAIR_SHARE_STALE_S = 60.0
#: What a terminal would act on rather than show: C0 and C1 controls (escape sequences, BEL,
#: newlines), DEL, and the bidirectional overrides that reorder what follows them.
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on written as an escape (``\\x1b``):
    events carry what tenants sent (a field name in a rejection's detail), which must reach the
    operator's screen as text, never as a command to the terminal or a line of its own."""
    return _UNPRINTABLE.sub(lambda m: ascii(m[0])[1:-1], text)


def _cell(text: str) -> Text:
    """A table cell that shows ``text`` as it is: rich reads a plain string as markup, so a name
    such as ``[/x]`` (a closing tag nobody opened) would raise instead of being drawn."""
    return Text(printable(text))


@dataclass(frozen=True)
class PoolRow:
    """The devices of one vendor and model, summed over every node."""

    vendor: str
    model: str
    devices: int
    healthy: int
    unhealthy: int
    memory_total_mib: int
    memory_used_mib: int
    memory_free_mib: int
    compute_used_pct: float
    """Share of the group's compute held by leases (0-100, over all its devices)."""
    compute_free_pct: float
    util_pct: float | None
    """Mean measured utilisation of the devices that reported one (None: no telemetry yet)."""


@dataclass(frozen=True)
class QueueRow:
    """One queue: its running leases and waiting requests, and the compute it holds."""

    queue: str
    running: int
    reserved: int
    pending: int
    devices_held: int
    memory_mib: int
    compute_pct: int
    pool_compute_share: float
    """Share of the whole pool's compute this queue holds (0-1)."""
    quota_used: dict[str, float]
    """The queue's quota counters in the ledger (``units``, ``devices:<model>``), as charged."""
    fair_share_usage: float | None = None
    """The queue's decayed normalized usage, what fair share ranks it by (None: no scheduler
    published one recently)."""
    fair_share_fraction: float | None = None
    """That usage as a share of all queues' (0-1): compare it with the queue's weight share."""


@dataclass(frozen=True)
class EventLine:
    """One event as the console prints it."""

    time: str
    type: str
    tenant: str
    job: str
    lease: str
    summary: str
    subject: str


def pool_summary(nodes: Iterable[NodeRecord]) -> list[PoolRow]:
    """The pool by (vendor, model), in name order; lost nodes' devices are left out (they hold
    nothing placement can use)."""
    groups: dict[tuple[str, str], list[DeviceRecord]] = defaultdict(list)
    for node in nodes:
        if node.status == "lost":
            continue
        for device in node.devices:
            groups[(str(device.spec.vendor), device.spec.model)].append(device)
    rows = []
    for (vendor, model), devices in sorted(groups.items()):
        total = sum(d.memory_total_mib for d in devices)
        free = sum(d.memory_free_mib for d in devices)
        compute_free = sum(d.compute_free_pct for d in devices) / len(devices)
        utils = [d.util_pct for d in devices if d.util_pct is not None]
        healthy = sum(1 for d in devices if d.health == Health.HEALTHY)
        rows.append(
            PoolRow(
                vendor=vendor,
                model=model,
                devices=len(devices),
                healthy=healthy,
                unhealthy=len(devices) - healthy,
                memory_total_mib=total,
                memory_used_mib=total - free,
                memory_free_mib=free,
                compute_used_pct=round(100.0 - compute_free, 1),
                compute_free_pct=round(compute_free, 1),
                util_pct=round(sum(utils) / len(utils), 1) if utils else None,
            )
        )
    return rows


def queue_summary(
    leases: Iterable[LeaseRecord],
    pending_queues: Iterable[str | None],
    pool_compute_pct: int,
    usage: Mapping[str, Mapping[str, float]] | None = None,
    fair_share: Mapping[str, float] | None = None,
    fair_share_total: float = 0.0,
) -> list[QueueRow]:
    """Per queue: live leases (active and reserved), waiting requests and the compute held, as a
    share of ``pool_compute_pct`` (100 per device in the pool), with the quota counters in
    ``usage`` (by queue name) and the scheduler's fair-share usage (``fair_share``, by queue, a
    parent's including its children's), each also as a share of ``fair_share_total``."""
    usage = usage or {}
    total_fair = fair_share_total
    running: dict[str, int] = defaultdict(int)
    reserved: dict[str, int] = defaultdict(int)
    pending: dict[str, int] = defaultdict(int)
    devices: dict[str, int] = defaultdict(int)
    memory: dict[str, int] = defaultdict(int)
    compute: dict[str, int] = defaultdict(int)
    for lease in leases:
        queue = lease.queue or NO_QUEUE
        if lease.state == "reserved":
            reserved[queue] += 1
        else:
            running[queue] += 1
        devices[queue] += len(lease.slices)
        memory[queue] += sum(x.memory_mib for x in lease.slices)
        compute[queue] += sum(x.compute_pct for x in lease.slices)
    for name in pending_queues:
        pending[name or NO_QUEUE] += 1
    charged = {q for q, counters in usage.items() if any(counters.values())}
    names = sorted(
        set(running)
        | set(reserved)
        | set(pending)
        | charged
        | {q for q, u in (fair_share or {}).items() if u > 0}
    )
    return [
        QueueRow(
            queue=q,
            running=running[q],
            reserved=reserved[q],
            pending=pending[q],
            devices_held=devices[q],
            memory_mib=memory[q],
            compute_pct=compute[q],
            pool_compute_share=round(compute[q] / pool_compute_pct, 3) if pool_compute_pct else 0,
            quota_used={k: round(v, 3) for k, v in sorted(usage.get(q, {}).items())},
            fair_share_usage=None if fair_share is None else round(fair_share.get(q, 0.0), 3),
            fair_share_fraction=(
                None
                if fair_share is None
                else round(fair_share.get(q, 0.0) / total_fair, 3)
                if total_fair
                else 0.0
            ),
        )
        for q in names
    ]


def pending_queue(body: bytes | str) -> str | None:
    """The queue a pending request names (None: none, or a body that is not a JSON object; the
    request still counts as pending)."""
    try:
        decoded = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return None
    queue = decoded.get("queue") if isinstance(decoded, dict) else None
    return queue if isinstance(queue, str) else None


_SUMMARY_KEYS = ("reason", "detail", "node_id", "device_id", "health", "pool", "action")


def event_line(subject: str, data: bytes, received: datetime | None = None) -> EventLine:
    """The line of one event: a payload that does not decode is still shown (type
    ``undecodable``), never dropped."""
    try:
        decoded = msgspec.json.decode(data)
    except msgspec.DecodeError:
        decoded = None
    if not isinstance(decoded, dict):
        when = (received or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%S")
        return EventLine(when, "undecodable", "", "", "", f"{len(data)} bytes", printable(subject))
    raw_time = decoded.get("time") or decoded.get("at") or decoded.get("granted_at")
    when = (
        str(raw_time)[:19]
        if raw_time
        else (received or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%S")
    )
    kind = str(decoded.get("type") or subject)
    summary = " ".join(
        f"{k}={decoded[k]}" for k in _SUMMARY_KEYS if decoded.get(k) not in (None, "", [])
    )
    slices = decoded.get("slices")
    if isinstance(slices, list) and slices:
        where = ",".join(
            f"{x.get('node_id')}/{x.get('device_id')}" for x in slices if isinstance(x, dict)
        )
        summary = f"{summary} on {where}".strip()
    return EventLine(
        time=printable(when),
        type=printable(_short_type(kind)),
        tenant=printable(str(decoded.get("tenant") or "")),
        job=printable(str(decoded.get("job_id") or "")),
        lease=printable(str(decoded.get("lease_id") or "")),
        summary=printable(summary),
        subject=printable(subject),
    )


def matches(line: EventLine, tenant: str | None, types: Sequence[str]) -> bool:
    """Whether ``line`` passes the --tenant and --type filters (a type matches its short name,
    e.g. ``granted``, or any part of it, e.g. ``alloc``)."""
    if tenant and line.tenant != tenant:
        return False
    return not types or any(t in line.type.split(".") or t == line.type for t in types)


def _short_type(kind: str) -> str:
    # "xpupool.alloc.granted.v1" -> "alloc.granted": the prefix and version say nothing here.
    parts = kind.split(".")
    if parts and parts[0] == "xpupool":
        parts = parts[1:]
    if parts and parts[-1].startswith("v") and parts[-1][1:].isdigit():
        parts = parts[:-1]
    return ".".join(parts)


@dataclass(frozen=True)
class Summary:
    """What ``xpupool status`` shows."""

    pool: list[PoolRow]
    queues: list[QueueRow]


async def read_summary(ledger: Ledger) -> Summary:
    """The pool and queue summary from the ledger's read APIs."""
    nodes = await ledger.nodes()
    leases = await ledger.leases()
    pending = await ledger.pending_jobs()
    pool = pool_summary(nodes)
    pool_compute = 100 * sum(row.devices for row in pool)
    live = [lease for lease in leases if lease.state in ("active", "reserved")]
    queued = [pending_queue(b) for b, _ in pending]
    names = sorted({lease.queue for lease in live if lease.queue} | {q for q in queued if q})
    usage = {name: await ledger.usage(name) for name in names}
    view = await ledger.fair_share()
    now_s = (await ledger.now_ms()) / 1000
    fresh = view is not None and now_s - view.at_s <= FAIR_SHARE_STALE_S
    if view is not None and fresh:
        rows = queue_summary(live, queued, pool_compute, usage, view.units, view.total_units)
    else:
        rows = queue_summary(live, queued, pool_compute, usage)
    return Summary(pool, rows)


def summary_json(summary: Summary) -> dict[str, Any]:
    """The ``--json`` form of the summary."""
    return {
        "pool": [asdict(r) for r in summary.pool],
        "queues": [asdict(r) for r in summary.queues],
    }


def _mib(value: int) -> str:
    return f"{value / 1024:.1f}G"


def summary_tables(summary: Summary) -> Group:
    """The summary as two rich tables."""
    pool = Table(title="pool")
    for column in ("vendor", "model", "devices", "health", "memory used/total", "compute used"):
        pool.add_column(column)
    pool.add_column("util")
    for r in summary.pool:
        pool.add_row(
            _cell(r.vendor),
            _cell(r.model),
            str(r.devices),
            f"{r.healthy} ok" + (f", {r.unhealthy} not" if r.unhealthy else ""),
            f"{_mib(r.memory_used_mib)}/{_mib(r.memory_total_mib)}",
            f"{r.compute_used_pct:.0f}%",
            "-" if r.util_pct is None else f"{r.util_pct:.0f}%",
        )
    queues = Table(title="queues")
    for column in ("queue", "running", "reserved", "pending", "devices", "memory", "pool share"):
        queues.add_column(column)
    queues.add_column("quota used")
    queues.add_column("fair-share usage")
    for q in summary.queues:
        queues.add_row(
            _cell(q.queue),
            str(q.running),
            str(q.reserved),
            str(q.pending),
            str(q.devices_held),
            _mib(q.memory_mib),
            f"{q.pool_compute_share:.0%}",
            _cell(" ".join(f"{k}={v:g}" for k, v in q.quota_used.items()) or "-"),
            "-"
            if q.fair_share_usage is None
            else f"{q.fair_share_usage:g} ({q.fair_share_fraction or 0:.0%})",
        )
    return Group(pool, queues)


def events_table(lines: Sequence[EventLine]) -> Table:
    """The latest events, newest last."""
    table = Table(title="latest events")
    for column in ("time", "type", "tenant", "job", "lease", "summary"):
        table.add_column(column)
    for line in lines:
        cells = (line.time, line.type, line.tenant, line.job, line.lease, line.summary)
        table.add_row(*(_cell(x) for x in cells))
    return table


def format_line(line: EventLine) -> str:
    """One event on one terminal line."""
    return (
        f"{line.time}  {line.type:<22} {line.tenant:<12} {line.job or '-':<24} "
        f"{line.lease or '-':<28} {line.summary}"
    )


def print_summary(summary: Summary, as_json: bool) -> None:
    if as_json or not sys.stdout.isatty():
        sys.stdout.write(msgspec.json.encode(summary_json(summary)).decode() + "\n")
    else:
        Console().print(summary_tables(summary))


def event_subjects(tenant: str | None) -> list[str]:
    """What to read: the operator event stream's subjects, or, for one tenant, only its own
    event subjects: the only ones its credentials may read (operator credentials may read
    them too, and the tenant copies name the tenant on every event)."""
    if not tenant:
        return list(s.EVENTS_STREAM.subjects)
    return [f"{s.TENANT_SPACE}.{tenant}.events.>"]


async def recent_events(
    nc: Nats, subjects: Sequence[str], scan: int = 5000
) -> list[tuple[str, bytes, datetime | None]]:
    """Up to ``scan`` of the latest messages of the stream holding ``subjects`` (read with an
    ordered, ephemeral consumer: nothing is acknowledged or changed)."""
    js = nc.jetstream()
    stream = await js.find_stream_name_by_subject(subjects[0])
    info = await js.stream_info(stream)
    last = info.state.last_seq
    if info.state.messages == 0:
        return []
    start = max(info.state.first_seq, last - scan + 1)
    out: list[tuple[str, bytes, datetime | None]] = []
    sub = await js.subscribe(
        subjects[0] if len(subjects) == 1 else ">",
        stream=stream,
        ordered_consumer=True,
        config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=start),
    )
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=1.0)
            except TimeoutError:
                break
            out.append((msg.subject, msg.data, _stamp(msg)))
            if msg.metadata.sequence.stream >= last:
                break
    finally:
        await sub.unsubscribe()
    wanted = set(subjects)
    return [e for e in out if _covered(e[0], wanted)]


def _covered(subject: str, patterns: set[str]) -> bool:
    tokens = subject.split(".")
    for pattern in patterns:
        parts = pattern.split(".")
        if parts[-1] == ">" and tokens[: len(parts) - 1] == parts[:-1]:
            return True
        if len(parts) == len(tokens) and all(
            p in ("*", t) for p, t in zip(parts, tokens, strict=True)
        ):
            return True
    return False


def _stamp(msg: Msg) -> datetime | None:
    try:
        return msg.metadata.timestamp
    except Exception:  # a core (non-JetStream) message has no metadata
        return None


async def follow_events(
    nc: Nats, subjects: Sequence[str], on_line: Callable[[str, bytes, datetime | None], None]
) -> list[Any]:
    """Subscribe (core NATS, live only) to ``subjects``; returns the subscriptions."""

    async def handler(msg: Msg) -> None:
        on_line(msg.subject, msg.data, None)

    return [await nc.subscribe(subject, cb=handler) for subject in subjects]


async def run_top(
    ledger: Ledger,
    nc: Nats,
    subjects: Sequence[str],
    *,
    iterations: int,
    interval_s: float,
    keep: int = 15,
) -> None:
    """Redraw the summary every ``interval_s`` with the latest events below (0: until Ctrl-C)."""
    lines = [event_line(*e) for e in await recent_events(nc, subjects)][-keep:]

    def on_event(subject: str, data: bytes, received: datetime | None) -> None:
        lines.append(event_line(subject, data, received))
        del lines[:-keep]

    subs = await follow_events(nc, subjects, on_event)
    # Off a terminal (a file, a pipe, a screenshot) rich would assume 80 columns and cut the
    # event ids short.
    console = Console(width=None if sys.stdout.isatty() else 160)
    try:
        with Live(console=console, auto_refresh=False) as live:
            count = 0
            while True:
                summary = await read_summary(ledger)
                live.update(Group(summary_tables(summary), events_table(lines)), refresh=True)
                count += 1
                if iterations and count >= iterations:
                    break
                await asyncio.sleep(interval_s)
    finally:
        for sub in subs:
            await sub.unsubscribe()


@dataclass
class Refusals:
    """What the NATS server refused on this connection (permission violations)."""

    errors: list[str] = field(default_factory=list)
    event: asyncio.Event = field(default_factory=asyncio.Event)


def _emit(line: EventLine, as_json: bool) -> None:
    if as_json:
        sys.stdout.write(msgspec.json.encode(asdict(line)).decode() + "\n")
    else:
        sys.stdout.write(format_line(line) + "\n")
    sys.stdout.flush()


async def _connect(
    nats_url: str,
    tenant: str | None,
    creds: str | None,
    tls_ca: str | None,
    refused: Refusals,
) -> Nats:
    # With credentials, replies must come back on the identity's own inbox (its permissions
    # allow no other): a tenant's when a tenant is named, else the operator's.
    inbox = None
    if creds:
        inbox = tenant_inbox(tenant) if tenant else service_inbox(OPERATOR)

    async def on_error(error: Exception) -> None:
        # A subscription the credentials do not allow fails asynchronously, here: recorded so
        # the command says so and exits instead of waiting on a subject that never delivers.
        if "permission" in str(error).lower():
            refused.errors.append(str(error))
            refused.event.set()

    return await connect_client(
        nats_url,
        creds=creds,
        tls_ca=tls_ca,
        inbox_prefix=inbox,
        name="xpupool-console",
        error_cb=on_error,
    )


async def _events(args: Any, nc: Nats, refused: Refusals) -> int:
    as_json = args.json or not sys.stdout.isatty()
    subjects = event_subjects(args.tenant)
    if args.follow:

        def on_event(subject: str, data: bytes, received: datetime | None) -> None:
            line = event_line(subject, data, received)
            if matches(line, args.tenant, args.type):
                _emit(line, as_json)

        await follow_events(nc, subjects, on_event)
        await round_trip(nc)  # subscribed at the server once this returns
        # On stderr, so JSON lines on stdout stay clean; a script can wait for it.
        sys.stderr.write(f"following {' '.join(subjects)}\n")
        sys.stderr.flush()
        await refused.event.wait()  # until Ctrl-C, or the server refuses the subscription
        sys.stderr.write(f"xpupool: error: NATS refused: {refused.errors[0]}\n")
        return 2
    try:
        recent = await recent_events(nc, subjects)
    except (nats.errors.Error, nats.js.errors.Error) as error:
        sys.stderr.write(
            f"xpupool: error: cannot read the event stream ({error}); a tenant's credentials "
            "have no JetStream access: use --follow for its live events\n"
        )
        return 2
    lines = [event_line(*e) for e in recent]
    for line in [x for x in lines if matches(x, args.tenant, args.type)][-args.limit :]:
        _emit(line, as_json)
    return 0


async def run_command(
    args: Any,
    nats_url: str,
    redis_url: str,
    namespace: str,
    *,
    creds: str | None = None,
    tls_ca: str | None = None,
) -> int:
    """``xpupool top`` or ``xpupool events`` (``args`` from the CLI's parser)."""
    tenant = getattr(args, "tenant", None)
    refused = Refusals()
    nc = await _connect(nats_url, tenant, creds, tls_ca, refused)
    try:
        if args.command == "events":
            return await _events(args, nc, refused)
        ca = args.redis_tls_ca or os.environ.get("XPUPOOL_REDIS_TLS_CA")
        redis = Redis.from_url(redis_url, ssl_ca_certs=ca) if ca else Redis.from_url(redis_url)
        try:
            await run_top(
                Ledger(redis, namespace),
                nc,
                event_subjects(None),
                iterations=1 if args.once else args.iterations,
                interval_s=args.interval,
            )
        finally:
            await redis.aclose()
        return 0
    finally:
        await nc.drain()
