"""``xpupool usage``: device-hours, normalised capacity-hours, cost and efficiency per tenant,
queue or model, from the ledger's usage records (ended leases) and the running leases up to now;
``--idle`` lists running leases whose devices telemetry shows barely used, and who holds them;
``--records`` exports the ended leases' records themselves, one JSON line each (the
``UsageRecord`` schema), for a store that keeps them longer than the ledger does.

The aggregation is pure (``aggregate``, ``idle_leases``, ``parse_duration``, the formatters);
``read_usage`` is the only Redis I/O."""

from __future__ import annotations

import argparse
import csv
import io
import math
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Literal

import msgspec

from xpupool.contracts import UsageRecord

if TYPE_CHECKING:
    # Imported where used: every command's parser registers ``usage``, and ``xpupool run``
    # needs neither Redis's client nor the ledger.
    from redis.asyncio import Redis

    from xpupool.devices.catalog import Catalog
    from xpupool.ledger import Ledger

GroupBy = Literal["tenant", "queue", "model"]
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class UsageRow(msgspec.Struct, frozen=True, kw_only=True):
    """One group's totals. ``efficiency`` is used over granted capacity (None: nothing granted)."""

    key: str
    leases: int
    device_hours: float
    capacity_hours: float
    cost: float
    granted_capacity_hours: float
    used_capacity_hours: float
    efficiency: float | None
    memory_efficiency: float | None


class IdleLease(msgspec.Struct, frozen=True, kw_only=True):
    """A running lease whose devices did little of the work they were granted."""

    lease_id: str
    job_id: str
    tenant: str
    queue: str
    models: list[str]
    since: str
    hours: float
    efficiency: float


def parse_duration(text: str) -> float:
    """``7d``, ``12h``, ``30m``, ``90s``, ``2w`` (or plain seconds) in seconds."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*", text)
    # More digits than a float holds read as infinity, which no point in time is ms away from.
    seconds = float(match[1]) * _UNITS[match[2] or "s"] if match else math.inf
    if not math.isfinite(seconds):
        raise ValueError(f"not a duration: {text!r} (e.g. 7d, 12h, 30m)")
    return seconds


def parse_time(text: str, now_ms: int) -> int:
    """A point in time: a duration ago (``7d``) or an ISO 8601 timestamp; in epoch ms."""
    try:
        return now_ms - int(parse_duration(text) * 1000)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text)
    except ValueError as error:
        raise ValueError(f"not a duration or ISO time: {text!r}") from error
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return int(when.timestamp() * 1000)


@dataclass
class _Acc:
    leases: set[str]
    device_s: float = 0.0
    capacity_s: float = 0.0
    cost: float = 0.0
    granted_s: float = 0.0
    used_s: float = 0.0
    granted_mem: float = 0.0
    used_mem: float = 0.0


def _ratio(used: float, granted: float) -> float | None:
    return used / granted if granted > 0 else None


def aggregate(records: Iterable[UsageRecord], by: GroupBy, catalog: Catalog) -> list[UsageRow]:
    """Totals per tenant, queue or model, sorted by device-hours (largest first). A share counts
    its fraction of a device; capacity is the catalog's normalised capacity (A100 = 1) and cost
    its price per device-hour; a model the catalog does not know counts 0 for both."""
    groups: dict[str, _Acc] = {}
    for record in records:
        for s in record.slices:
            key = {"tenant": record.tenant, "queue": record.queue, "model": s.model}[by]
            acc = groups.setdefault(key, _Acc(leases=set()))
            acc.leases.add(record.lease_id)
            entry = catalog.lookup(s.model)
            acc.device_s += s.granted_capacity_s
            if entry is not None:
                acc.capacity_s += s.granted_capacity_s * entry.capacity_units
                acc.cost += s.granted_capacity_s / 3600 * entry.cost_per_hour
            acc.granted_s += s.granted_capacity_s
            acc.used_s += s.used_capacity_s
            acc.granted_mem += s.granted_memory_mib_s
            acc.used_mem += s.used_memory_mib_s
    rows = [
        UsageRow(
            key=key,
            leases=len(acc.leases),
            device_hours=acc.device_s / 3600,
            capacity_hours=acc.capacity_s / 3600,
            cost=acc.cost,
            granted_capacity_hours=acc.granted_s / 3600,
            used_capacity_hours=acc.used_s / 3600,
            efficiency=_ratio(acc.used_s, acc.granted_s),
            memory_efficiency=_ratio(acc.used_mem, acc.granted_mem),
        )
        for key, acc in groups.items()
    ]
    return sorted(rows, key=lambda row: (-row.device_hours, row.key))


def idle_leases(records: Iterable[UsageRecord], threshold: float) -> list[IdleLease]:
    """Running leases whose used share of granted capacity is below ``threshold``, longest
    held first (a lease granted nothing yet is not listed)."""
    out = []
    for record in records:
        if not record.running:
            continue
        granted = sum(s.granted_capacity_s for s in record.slices)
        used = sum(s.used_capacity_s for s in record.slices)
        if granted <= 0 or used / granted >= threshold:
            continue
        out.append(
            IdleLease(
                lease_id=record.lease_id,
                job_id=record.job_id,
                tenant=record.tenant,
                queue=record.queue,
                models=sorted({s.model for s in record.slices}),
                since=_iso(record.granted_ms),
                hours=record.duration_s / 3600,
                efficiency=used / granted,
            )
        )
    return sorted(out, key=lambda lease: -lease.hours)


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="seconds")


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.1f}%"


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Plain aligned text: the first column left, the others right."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        parts = [
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers), *(line(r) for r in rows)]) + "\n"


_HEADERS = ("leases", "device_h", "capacity_h", "cost", "efficiency", "mem_efficiency")


def format_rows(rows: Sequence[UsageRow], by: GroupBy, fmt: Literal["text", "json", "csv"]) -> str:
    """The report as a table, JSON or CSV."""
    if fmt == "json":
        return msgspec.json.format(msgspec.json.encode(rows), indent=2).decode() + "\n"
    cells = [
        [
            row.key,
            str(row.leases),
            f"{row.device_hours:.3f}",
            f"{row.capacity_hours:.3f}",
            f"{row.cost:.2f}",
            _pct(row.efficiency) if fmt == "text" else _num(row.efficiency),
            _pct(row.memory_efficiency) if fmt == "text" else _num(row.memory_efficiency),
        ]
        for row in rows
    ]
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow([by, *_HEADERS])
        writer.writerows(cells)
        return out.getvalue()
    return table([by, *_HEADERS], cells) if cells else "no usage in that period\n"


def _num(value: float | None) -> str:
    return "" if value is None else f"{value:.4f}"


def format_idle(leases: Sequence[IdleLease], fmt: Literal["text", "json", "csv"]) -> str:
    """Idle holders as a table, JSON or CSV."""
    if fmt == "json":
        return msgspec.json.format(msgspec.json.encode(leases), indent=2).decode() + "\n"
    headers = ["lease", "tenant", "queue", "job", "models", "since", "hours", "efficiency"]
    cells = [
        [
            x.lease_id,
            x.tenant,
            x.queue,
            x.job_id,
            ",".join(x.models),
            x.since,
            f"{x.hours:.2f}",
            _pct(x.efficiency) if fmt == "text" else _num(x.efficiency),
        ]
        for x in leases
    ]
    if fmt == "csv":
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(headers)
        writer.writerows(cells)
        return out.getvalue()
    return table(headers, cells) if cells else "no running lease is below that utilisation\n"


def format_records(records: Iterable[UsageRecord]) -> str:
    """Usage records as JSON lines, as the contract encodes them."""
    encoder = msgspec.json.Encoder()
    return "".join(encoder.encode(r).decode() + "\n" for r in records)


async def records_ended_in(ledger: Ledger, since_ms: int, until_ms: int) -> list[UsageRecord]:
    """The records of leases that ended at or after ``since_ms`` and before ``until_ms``: end
    times are whole milliseconds, so reports and exports of consecutive windows hold each lease
    once."""
    from xpupool.ledger.usage import ended_usage

    return await ended_usage(ledger, since_ms, until_ms - 1)


async def read_usage(ledger: Ledger, since_ms: int, until_ms: int | None) -> list[UsageRecord]:
    """Ended leases' records in the window (``records_ended_in``; ``until_ms`` None: up to and
    including now), plus the running leases counted up to now when the window reaches now."""
    from xpupool.ledger.usage import live_usage

    now = await ledger.now_ms()
    until = now + 1 if until_ms is None else until_ms
    records = await records_ended_in(ledger, since_ms, until)
    if until > now:
        records += [r for r in await live_usage(ledger) if r.granted_ms < until]
    return records


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``xpupool usage``."""
    usage = sub.add_parser(
        "usage", help="device-hours, capacity-hours, cost and efficiency; --idle: idle holders"
    )
    usage.add_argument("--since", default="7d", help="a duration ago (7d) or an ISO time")
    usage.add_argument("--until", default=None, help="a duration ago or an ISO time (now)")
    usage.add_argument("--by", choices=("tenant", "queue", "model"), default="tenant")
    fmt = usage.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true")
    fmt.add_argument("--csv", action="store_true")
    fmt.add_argument(
        "--records",
        action="store_true",
        help="the usage records of leases that ended from --since to before --until, one JSON "
        "line each, oldest end first",
    )
    usage.add_argument(
        "--idle", action="store_true", help="running leases whose devices are barely used"
    )
    usage.add_argument(
        "--below", type=float, default=0.1, help="--idle's utilisation threshold (0.1 = 10%%)"
    )


async def run(args: argparse.Namespace, redis: Redis, namespace: str) -> int:
    """``xpupool usage`` against an open Redis client (closed by the caller)."""
    from xpupool.devices.catalog import load_catalog
    from xpupool.ledger import Ledger
    from xpupool.ledger.usage import live_usage

    ledger = Ledger(redis, namespace)
    fmt: Literal["text", "json", "csv"] = "json" if args.json else "csv" if args.csv else "text"
    now = await ledger.now_ms()
    if args.idle and args.records:
        sys.stderr.write(
            "xpupool: error: --records exports ended leases; --idle lists running ones\n"
        )
        return 2
    if args.idle:
        sys.stdout.write(format_idle(idle_leases(await live_usage(ledger), args.below), fmt))
        return 0
    try:
        since = parse_time(args.since, now)
        until = parse_time(args.until, now) if args.until else None
    except ValueError as error:
        sys.stderr.write(f"xpupool: error: {error}\n")
        return 2
    try:
        if args.records:
            ended = await records_ended_in(ledger, since, now if until is None else until)
            sys.stdout.write(format_records(ended))
            return 0
        records = await read_usage(ledger, since, until)
    except ValueError as error:
        # A record that does not decode (another version's, or damaged) is named, never
        # skipped: said in one line, as `scale status` says a status it cannot read.
        sys.stderr.write(f"xpupool: error: {' '.join(str(error).split())}\n")
        return 1
    sys.stdout.write(format_rows(aggregate(records, args.by, load_catalog()), args.by, fmt))
    return 0
