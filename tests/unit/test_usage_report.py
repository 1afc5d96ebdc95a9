"""xpupool usage's pure parts, without servers: durations and times, aggregation by tenant,
queue and model with the catalog's capacity and prices, idle holders, and the output formats."""

from __future__ import annotations

import csv
import io
import json

import pytest

from xpupool.cli.usage import (
    aggregate,
    format_idle,
    format_rows,
    idle_leases,
    parse_duration,
    parse_time,
)
from xpupool.contracts import UsageRecord, UsageSlice
from xpupool.devices.catalog import load_catalog
from xpupool.ledger import LeaseRecord, SliceMeta, TakenSlice
from xpupool.ledger.usage import carried_load, running_usage


def _slice(model: str, share: float, hours: float, used: float) -> UsageSlice:
    return UsageSlice(
        device_id=f"n/{model}",
        model=model,
        whole=share == 1.0,
        share=share,
        granted_capacity_s=hours * 3600 * share,
        used_capacity_s=used * hours * 3600 * share,
    )


def _record(
    lease: str, tenant: str, queue: str, *slices: UsageSlice, running: bool = False
) -> UsageRecord:
    return UsageRecord(
        lease_id=lease,
        job_id=lease,
        tenant=tenant,
        queue=queue,
        granted_ms=1_000,
        ended_ms=2_000,
        end_reason="" if running else "released",
        duration_s=max(s.granted_capacity_s / s.share for s in slices) if slices else 0.0,
        slices=list(slices),
        running=running,
    )


RECORDS = [
    _record("l1", "a", "q1", _slice("A100", 1.0, 2.0, 0.5)),
    _record("l2", "a", "q2", _slice("H100", 0.5, 4.0, 1.0), _slice("A100", 1.0, 1.0, 0.0)),
    _record("l3", "b", "q1", _slice("A100", 1.0, 1.0, 0.05), running=True),
]


def test_durations_and_times() -> None:
    assert parse_duration("7d") == 7 * 86400 and parse_duration("90") == 90
    assert parse_duration("1.5h") == 5400
    assert parse_time("1h", 10_000_000) == 10_000_000 - 3_600_000
    assert parse_time("1970-01-01T00:00:10+00:00", 0) == 10_000
    with pytest.raises(ValueError, match="not a duration"):
        parse_time("last week", 0)


def test_aggregation_by_tenant_queue_and_model() -> None:
    catalog = load_catalog()
    a100, h100 = catalog.get("A100"), catalog.get("H100")
    tenants = {row.key: row for row in aggregate(RECORDS, "tenant", catalog)}
    # Tenant a: 2 h + 1 h of an A100, half an H100 for 4 h (2 device-hours).
    assert tenants["a"].leases == 2 and tenants["a"].device_hours == pytest.approx(5.0)
    assert tenants["a"].capacity_hours == pytest.approx(
        3 * a100.capacity_units + 2 * h100.capacity_units
    )
    assert tenants["a"].cost == pytest.approx(3 * a100.cost_per_hour + 2 * h100.cost_per_hour)
    assert tenants["a"].efficiency == pytest.approx((1.0 + 2.0) / 5.0)
    assert [row.key for row in aggregate(RECORDS, "tenant", catalog)] == ["a", "b"]
    queues = {row.key: row.leases for row in aggregate(RECORDS, "queue", catalog)}
    assert queues == {"q1": 2, "q2": 1}
    models = {row.key: row for row in aggregate(RECORDS, "model", catalog)}
    assert models["A100"].leases == 3 and models["A100"].device_hours == pytest.approx(4.0)
    assert models["H100"].device_hours == pytest.approx(2.0)
    assert models["A100"].memory_efficiency is None  # no memory granted in these records


def test_an_unknown_model_counts_hours_but_no_capacity_or_cost() -> None:
    (row,) = aggregate(
        [_record("x", "t", "q", _slice("Mystery-9000", 1.0, 1.0, 0.0))], "model", load_catalog()
    )
    assert row.device_hours == pytest.approx(1.0) and row.capacity_hours == 0 and row.cost == 0


def test_idle_holders_are_running_leases_below_the_threshold() -> None:
    (idle,) = idle_leases(RECORDS, 0.1)
    assert idle.lease_id == "l3" and idle.tenant == "b" and idle.models == ["A100"]
    assert idle.efficiency == pytest.approx(0.05)
    assert idle_leases(RECORDS, 0.01) == []
    assert "l3" in format_idle([idle], "text") and json.loads(format_idle([idle], "json"))


def test_formats() -> None:
    rows = aggregate(RECORDS, "queue", load_catalog())
    text = format_rows(rows, "queue", "text").splitlines()
    assert text[0].split() == [
        "queue",
        "leases",
        "device_h",
        "capacity_h",
        "cost",
        "efficiency",
        "mem_efficiency",
    ]
    assert text[1].startswith("q1") and text[1].split()[-1] == "-"
    parsed = list(csv.DictReader(io.StringIO(format_rows(rows, "queue", "csv"))))
    assert [r["queue"] for r in parsed] == ["q1", "q2"] and parsed[0]["mem_efficiency"] == ""
    assert float(parsed[0]["device_h"]) == pytest.approx(3.0)
    assert [r["key"] for r in json.loads(format_rows(rows, "queue", "json"))] == ["q1", "q2"]
    assert format_rows([], "queue", "text") == "no usage in that period\n"


def test_running_usage_mirrors_the_end_record() -> None:
    meta = SliceMeta(vendor="nvidia", model="A100", index=0, uuid="u")
    lease = LeaseRecord(
        lease_id="l",
        job_id="j",
        tenant="t",
        owner="o",
        queue="q",
        priority=1,
        state="active",
        slices=[
            TakenSlice(
                device_id="d", node_id="n", whole=False, memory_mib=1000, compute_pct=50, meta=meta
            )
        ],
        token=1,
        ttl_ms=1,
        created_ms=0,
        granted_ms=10_000,
        expires_ms=0,
        end_reason=None,
        end_detail="",
        ended_ms=None,
    )
    # 10 s held at half a device; the device did 900 %·s (9 device-seconds) since the grant.
    record = running_usage(lease, {"d": (100.0, 0.0)}, {"d": (1000.0, 5000.0)}, 20_000)
    (s,) = record.slices
    assert record.running and record.duration_s == 10.0 and s.share == 0.5
    assert s.granted_capacity_s == 5.0 and s.used_capacity_s == 5.0  # capped at the share
    assert s.granted_memory_mib_s == 10_000 and s.used_memory_mib_s == 5000
    # The last sample is held until now, at most a minute.
    assert carried_load([b"10", b"20", b"50", b"100", b"1000"], 3000) == (110.0, 220.0)
    assert carried_load([b"10", None, b"50", None, b"0"], 600_000) == (3010.0, 0.0)
    assert carried_load([None, None, None, None, None], 5) == (0.0, 0.0)
