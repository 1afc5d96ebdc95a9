"""Usage accounting on a real redis-server: every way a lease ends writes exactly one usage
record, in the script that ends it, with its granted and used capacity; running leases count up
to now; records are read by end time, aggregated and trimmed."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from tests.integration.ledger_builders import device_spec, reservation
from xpupool.cli.usage import (
    aggregate,
    format_records,
    format_rows,
    idle_leases,
    read_usage,
    records_ended_in,
)
from xpupool.contracts import DeviceSample
from xpupool.devices.catalog import load_catalog
from xpupool.ledger import Holder, Ledger, SliceClaim, SliceMeta
from xpupool.ledger.usage import ended_usage, live_usage, trim_usage

pytestmark = pytest.mark.integration


def _claim(i: int, *, whole: bool = True, compute_pct: int = 100) -> SliceClaim:
    return SliceClaim(
        device_id=f"n1/nvidia{i}",
        memory_mib=81920 if whole else 40960,
        compute_pct=compute_pct,
        whole=whole,
        meta=SliceMeta(vendor="nvidia", model="A100", index=i, uuid=f"GPU-n1-{i}"),
    )


async def _grant(ledger: Ledger, job: str, claim: SliceClaim, **kwargs: object) -> str:
    assert (await ledger.reserve(reservation(job, claim, **kwargs))).ok
    assert (await ledger.grant(f"lease-{job}")).ok
    return f"lease-{job}"


async def _records(ledger: Ledger) -> dict[str, list[object]]:
    by_lease: dict[str, list[object]] = {}
    for record in await ended_usage(ledger, 0, 2**62):
        by_lease.setdefault(record.lease_id, []).append(record)
    return by_lease


async def test_each_end_path_writes_one_record_and_a_duplicate_end_none(ledger: Ledger) -> None:
    await ledger.register_node("n1", [device_spec("n1", i) for i in range(6)])
    await ledger.register_node("n2", [device_spec("n2", 0)])
    released = await _grant(ledger, "rel", _claim(0))
    preempted = await _grant(ledger, "pre", _claim(1))
    expired = await _grant(ledger, "exp", _claim(2), ttl_ms=100)
    graced = await _grant(ledger, "grace", _claim(3))
    idle = await _grant(ledger, "idle", _claim(4), idle_after_ms=100)
    lost_claim = SliceClaim(device_id="n2/nvidia0", memory_mib=81920, compute_pct=100, whole=True)
    lost = await _grant(ledger, "lost", lost_claim)
    await asyncio.sleep(0.25)

    lease = await ledger.get_lease(released)
    assert lease is not None
    holder = Holder(tenant="t", secret=lease.secret, token=lease.token)
    assert (await ledger.release(released, holder)).ok
    assert (await ledger.end(preempted, "preempted")).ok
    assert (await ledger.end(preempted, "preempted")).outcome == "already_ended"
    assert (await ledger.end_after(graced, "preempted", 0)).ok
    assert (await ledger.reclaim_idle(warning_ms=0)).ended == [idle]
    await asyncio.sleep(0.01)
    assert sorted((await ledger.expire_due()).ended) == sorted([expired, graced, idle])
    await ledger.heartbeat("n1")
    await asyncio.sleep(0.2)
    await ledger.heartbeat("n1")
    assert (await ledger.reap_nodes(grace_ms=150)).lost == ["n2"]
    assert (await ledger.reap_nodes(grace_ms=150)).lost == []
    assert (await ledger.expire_due()).ended == []

    records = await _records(ledger)
    assert sorted(records) == sorted([released, preempted, expired, graced, idle, lost])
    assert all(len(rs) == 1 for rs in records.values())
    reasons = {lease_id: rs[0].end_reason for lease_id, rs in records.items()}  # type: ignore[attr-defined]
    assert reasons == {
        released: "released",
        preempted: "preempted",
        expired: "expired",
        graced: "preempted",
        idle: "idle",
        lost: "lost",
    }
    rec = records[released][0]
    assert rec.tenant == "t" and rec.queue == "q" and rec.job_id == "rel"  # type: ignore[attr-defined]
    assert rec.duration_s >= 0.25  # type: ignore[attr-defined]
    (s,) = rec.slices  # type: ignore[attr-defined]
    assert s.model == "A100" and s.whole and s.share == 1.0
    assert s.granted_capacity_s == pytest.approx(rec.duration_s)  # type: ignore[attr-defined]
    assert s.used_capacity_s == 0.0  # no telemetry: nothing shown used


async def test_used_capacity_is_the_load_integral_since_the_grant(ledger: Ledger) -> None:
    await ledger.register_node("n1", [device_spec("n1", i) for i in range(2)])
    # Load before the grant does not count toward the lease.
    assert (await ledger.heartbeat("n1", [DeviceSample(device_id="n1/nvidia0", util_pct=100.0)])).ok
    await asyncio.sleep(0.2)
    whole = await _grant(ledger, "w", _claim(0))
    share = await _grant(ledger, "s", _claim(1, whole=False, compute_pct=50))
    for _ in range(5):
        tick = [
            DeviceSample(device_id="n1/nvidia0", util_pct=50.0, memory_used_mib=40960),
            DeviceSample(device_id="n1/nvidia1", util_pct=100.0, memory_used_mib=40960),
        ]
        assert (await ledger.heartbeat("n1", tick)).ok
        await asyncio.sleep(0.1)
    unknown = [DeviceSample(device_id="n1/nvidia0"), DeviceSample(device_id="n1/nvidia1")]
    assert (await ledger.heartbeat("n1", unknown)).ok
    running = {r.lease_id: r for r in await live_usage(ledger)}
    assert set(running) == {whole, share} and all(r.running for r in running.values())
    assert (await ledger.end(whole, "preempted")).ok
    assert (await ledger.end(share, "preempted")).ok
    records = {r.lease_id: r for r in await ended_usage(ledger, 0, 2**62)}

    (w,) = records[whole].slices
    # First sample at the grant: the 0.2 s of 100 % before it goes to nobody; ~0.5 s at 50 %.
    assert w.used_capacity_s == pytest.approx(0.25, abs=0.08)
    assert w.used_capacity_s / w.granted_capacity_s == pytest.approx(0.5, abs=0.15)
    assert w.used_memory_mib_s / w.granted_memory_mib_s == pytest.approx(0.5, abs=0.15)
    (s,) = records[share].slices
    # A half share of a device at 100 % is counted up to its grant: fully used.
    assert s.share == 0.5 and s.used_capacity_s == pytest.approx(s.granted_capacity_s, rel=0.2)
    # The running figure before the end agrees with the end record (up to the later end).
    assert running[whole].slices[0].used_capacity_s == pytest.approx(w.used_capacity_s, abs=0.02)


async def test_running_leases_count_up_to_now_and_since_filters(ledger: Ledger) -> None:
    await ledger.register_node("n1", [device_spec("n1", i) for i in range(3)])
    old = await _grant(ledger, "old", _claim(0), tenant="a", queue="qa")
    await asyncio.sleep(0.1)
    assert (await ledger.end(old, "preempted")).ok
    await asyncio.sleep(0.3)
    cut = await ledger.now_ms()
    recent = await _grant(ledger, "new", _claim(1), tenant="b", queue="qb")
    assert (await ledger.end(recent, "preempted")).ok
    running = await _grant(ledger, "run", _claim(2), tenant="b", queue="qa")
    await asyncio.sleep(0.2)

    everything = await read_usage(ledger, 0, await ledger.now_ms() + 1000)
    assert sorted(r.lease_id for r in everything) == sorted([old, recent, running])
    (live,) = [r for r in everything if r.running]
    assert live.lease_id == running and live.duration_s >= 0.2

    since_cut = await read_usage(ledger, cut, await ledger.now_ms() + 1000)
    assert sorted(r.lease_id for r in since_cut) == sorted([recent, running])
    before_cut = await read_usage(ledger, 0, cut)
    assert [r.lease_id for r in before_cut] == [old]  # running leases only when until reaches now

    catalog = load_catalog()
    by_tenant = {row.key: row for row in aggregate(everything, "tenant", catalog)}
    assert set(by_tenant) == {"a", "b"} and by_tenant["b"].leases == 2
    hours = sum(r.slices[0].granted_capacity_s for r in everything if r.tenant == "b") / 3600
    assert by_tenant["b"].device_hours == pytest.approx(hours)
    a100 = catalog.get("A100")
    assert by_tenant["b"].cost == pytest.approx(hours * a100.cost_per_hour)
    assert by_tenant["b"].capacity_hours == pytest.approx(hours * a100.capacity_units)
    by_queue = {row.key: row.leases for row in aggregate(everything, "queue", catalog)}
    assert by_queue == {"qa": 2, "qb": 1}
    (model,) = aggregate(everything, "model", catalog)
    assert model.key == "A100" and model.leases == 3 and model.efficiency == 0.0

    as_json = json.loads(format_rows(aggregate(everything, "tenant", catalog), "tenant", "json"))
    assert {row["key"] for row in as_json} == {"a", "b"}
    csv_lines = format_rows(aggregate(everything, "queue", catalog), "queue", "csv").splitlines()
    assert csv_lines[0].startswith("queue,leases,device_h") and len(csv_lines) == 3
    # Nothing was used: the running lease is an idle holder, listed with who holds it.
    (holder,) = idle_leases(everything, 0.1)
    assert holder.lease_id == running and holder.tenant == "b" and holder.models == ["A100"]


async def test_retention_trims_old_records_only(ledger: Ledger) -> None:
    await ledger.register_node("n1", [device_spec("n1", i) for i in range(2)])
    first = await _grant(ledger, "a", _claim(0))
    assert (await ledger.end(first, "preempted")).ok
    await asyncio.sleep(0.3)
    second = await _grant(ledger, "b", _claim(1))
    assert (await ledger.end(second, "preempted")).ok
    assert await trim_usage(ledger, retention_s=0.2) == 1
    assert [r.lease_id for r in await ended_usage(ledger, 0, 2**62)] == [second]
    assert await ledger.redis.hexists(ledger.key("usage-rec"), first) == 0


async def test_an_unclaimed_reservation_ends_with_a_record_of_nothing_used(ledger: Ledger) -> None:
    await ledger.register_node("n1", [device_spec("n1", 0)])
    assert (await ledger.reserve(reservation("r", _claim(0), hold_ms=50))).ok
    await asyncio.sleep(0.1)
    assert (await ledger.expire_due()).ended == ["lease-r"]
    (record,) = await ended_usage(ledger, 0, 2**62)
    assert record.granted_ms == 0 and record.end_reason == "expired" and record.duration_s == 0
    assert record.slices[0].granted_capacity_s == 0 and not record.running


async def test_exports_of_consecutive_windows_hold_each_lease_once(ledger: Ledger) -> None:
    """``xpupool usage`` and ``--records``: a window takes the leases that ended from its start
    to before its end, so a lease that ended exactly where two windows meet is in the later one
    only."""
    await ledger.register_node("n1", [device_spec("n1", i) for i in range(3)], 64_000, 256_000)
    for i in range(3):
        lease = await _grant(ledger, f"w{i}", _claim(i))
        assert (await ledger.end(lease, "released")).ok
        await asyncio.sleep(0.005)
    every = await ended_usage(ledger, 0, 2**62)
    cut = every[1].ended_ms
    earlier = await records_ended_in(ledger, 0, cut)
    later = await records_ended_in(ledger, cut, 2**62)
    assert [r.lease_id for r in earlier] == ["lease-w0"]
    assert [r.lease_id for r in later] == ["lease-w1", "lease-w2"]
    assert format_records(later).splitlines()[0] == msgspec.json.encode(later[0]).decode()
    # The report (``xpupool usage``) reads its windows the same way.
    assert [r.lease_id for r in await read_usage(ledger, 0, cut)] == ["lease-w0"]
    assert [r.lease_id for r in await read_usage(ledger, cut, None)] == ["lease-w1", "lease-w2"]


async def test_a_sample_that_is_no_finite_count_is_unknown_and_its_device_stays_grantable(
    ledger: Ledger,
) -> None:
    """A tool's NaN, infinity or negative reading is taken for unknown: it never reaches a
    device's integrals, where a NaN would stay for ever and fail every later grant's encoding
    of its load baseline. A ledger that holds such a value from before is read as zero."""
    await ledger.register_node("n1", [device_spec("n1", i) for i in range(2)])
    tick = [
        DeviceSample(device_id="n1/nvidia0", util_pct=float("nan"), memory_used_mib=-1),
        DeviceSample(device_id="n1/nvidia1", util_pct=float("inf"), memory_used_mib=100),
    ]
    assert (await ledger.heartbeat("n1", tick)).ok
    nodes = await ledger.nodes()
    read = [(d.util_pct, d.memory_used_mib) for d in nodes[0].devices]
    assert read == [(None, None), (None, 100)]
    await asyncio.sleep(0.05)
    busy = [DeviceSample(device_id=f"n1/nvidia{i}", util_pct=50.0) for i in range(2)]
    assert (await ledger.heartbeat("n1", busy)).ok
    # As a ledger written before the check may hold it.
    await ledger.redis.hset(ledger.key("dev", "n1/nvidia1"), mapping={"util_int": "nan"})
    leases = [await _grant(ledger, f"j{i}", _claim(i)) for i in range(2)]
    await asyncio.sleep(0.05)
    assert (await ledger.heartbeat("n1", busy)).ok
    running = await live_usage(ledger)
    assert len(running) == 2 and all(r.slices[0].used_capacity_s > 0 for r in running)
    for lease_id in leases:
        assert (await ledger.end(lease_id, "released")).ok
    ended = await _records(ledger)
    assert sorted(ended) == sorted(leases)
    assert all(0 < r.slices[0].used_capacity_s < 1 for [r] in ended.values())  # type: ignore[attr-defined]
