"""How long the ledger keeps what is over: a live job's or lease's record never expires, one that
is over expires after its retention (``retain_s`` in _prelude.lua), and the audit names a record
that breaks either rule."""

from __future__ import annotations

import asyncio

import pytest
import structlog

from tests.integration.ledger_builders import device_spec, reservation
from xpupool.lease_manager.main import prepare_ledger
from xpupool.lease_manager.settings import LeaseManagerSettings
from xpupool.ledger import Ledger, Retention, SliceClaim, audit
from xpupool.ledger.ledger import DEFAULT_RETENTION_S
from xpupool.obs import load_settings

pytestmark = pytest.mark.integration

JOB_S, LEASE_S = 5000, 4000


async def _ttl(ledger: Ledger, kind: str, record_id: str) -> int:
    return int(await ledger.redis.ttl(ledger.key(kind, record_id)))


def _about(ttl: int, retention_s: int) -> bool:
    """A TTL just read of a key given ``retention_s`` by a script a moment ago."""
    return retention_s - 5 <= ttl <= retention_s


async def test_the_retention_set_is_read_back_and_replaces_the_last_one(ledger: Ledger) -> None:
    default = Retention(job_s=DEFAULT_RETENTION_S, lease_s=DEFAULT_RETENTION_S)
    assert await ledger.retention() == default
    assert await ledger.set_retention(Retention(job_s=JOB_S, lease_s=LEASE_S)) is None
    assert await ledger.retention() == Retention(job_s=JOB_S, lease_s=LEASE_S)
    before = await ledger.set_retention(Retention(job_s=9000, lease_s=8000))
    assert before == Retention(job_s=JOB_S, lease_s=LEASE_S)


async def test_live_records_never_expire_and_each_way_of_ending_starts_the_retention(
    ledger: Ledger,
) -> None:
    """Pending, reserved and granted: no expiry (a job waiting or running longer than the
    retention keeps its id). Released, rejected, cancelled, timed out: the job's record expires
    after the job retention, the ended lease's after the lease retention."""
    await ledger.set_retention(Retention(job_s=JOB_S, lease_s=LEASE_S))
    await ledger.register_node("n1", [device_spec("n1", 0)], 64_000, 256_000)
    for job_id in ("run", "drop", "cancel"):
        assert (await ledger.pend(job_id, 1, b"{}", None, "queued", tenant="t")).ok
        assert await _ttl(ledger, "job", job_id) == -1
    assert (await ledger.pend("late", 1, b"{}", 1, "queued", tenant="t")).ok

    assert (await ledger.reserve(reservation("run", SliceClaim("n1/nvidia0", whole=True)))).ok
    assert (await _ttl(ledger, "job", "run"), await _ttl(ledger, "lease", "lease-run")) == (-1, -1)
    assert (await ledger.grant("lease-run")).ok
    assert (await _ttl(ledger, "job", "run"), await _ttl(ledger, "lease", "lease-run")) == (-1, -1)
    assert await audit(ledger) == []

    assert (await ledger.end("lease-run", "released")).ok
    assert _about(await _ttl(ledger, "job", "run"), JOB_S)
    assert _about(await _ttl(ledger, "lease", "lease-run"), LEASE_S)
    assert (await ledger.drop_pending("drop", "invalid_request", "", "bad")).ok
    assert _about(await _ttl(ledger, "job", "drop"), JOB_S)
    assert (await ledger.cancel_job("cancel", "t")).outcome == "cancelled"
    assert _about(await _ttl(ledger, "job", "cancel"), JOB_S)
    await asyncio.sleep(0.01)
    assert (await ledger.time_out_pending()).ended == ["late"]
    assert _about(await _ttl(ledger, "job", "late"), JOB_S)
    assert await audit(ledger) == []


async def test_a_job_pended_with_an_expiry_keeps_its_record_once_reserved(ledger: Ledger) -> None:
    """A job admitted by a version that gave a pending record its expiry at once: its
    reservation takes the expiry away, so the record lasts as long as the job."""
    await ledger.register_node("n1", [device_spec("n1", 0)], 64_000, 256_000)
    assert (await ledger.pend("old", 1, b"{}", None, "queued", tenant="t")).ok
    await ledger.redis.expire(ledger.key("job", "old"), 600)
    assert await audit(ledger) == ["job:old is pending and expires in 600 s"]
    assert (await ledger.reserve(reservation("old", SliceClaim("n1/nvidia0", whole=True)))).ok
    assert await _ttl(ledger, "job", "old") == -1
    assert await audit(ledger) == []


async def test_the_audit_names_a_record_kept_for_ever_or_one_that_may_vanish(
    ledger: Ledger,
) -> None:
    await ledger.register_node("n1", [device_spec("n1", 0), device_spec("n1", 1)], 64_000, 256_000)
    assert (await ledger.reserve(reservation("a", SliceClaim("n1/nvidia0", whole=True)))).ok
    assert (await ledger.reserve(reservation("b", SliceClaim("n1/nvidia1", whole=True)))).ok
    assert (await ledger.end("lease-b", "released")).ok
    await ledger.redis.persist(ledger.key("lease", "lease-b"))
    await ledger.redis.persist(ledger.key("job", "b"))
    await ledger.redis.expire(ledger.key("lease", "lease-a"), 60)
    await ledger.redis.hset(ledger.key("job", "ghost"), "reason", "insufficient_capacity")
    assert sorted(await audit(ledger)) == [
        "job:b is ended and never expires",
        "job:ghost has no known state (None)",
        "lease:lease-a is reserved and expires in 60 s",
        "lease:lease-b is ended and never expires",
    ]


async def test_the_audit_names_a_device_record_no_registered_device_owns(
    ledger: Ledger,
) -> None:
    """A device record outside the ledger's devices (left by a write to a device it does not
    hold) would stay for ever: the audit names it; a device that left with its record does not
    show."""
    await ledger.register_node("n1", [device_spec("n1", 0), device_spec("n1", 1)], 64_000, 256_000)
    await ledger.register_node("n1", [device_spec("n1", 0)], 64_000, 256_000)  # nvidia1 leaves
    assert await audit(ledger) == []
    await ledger.redis.hset(ledger.key("dev", "n1/nvidia9"), "util", "50.0")
    assert await audit(ledger) == ["device record n1/nvidia9 belongs to no registered device"]


async def test_once_its_retention_is_over_an_ended_job_is_forgotten(ledger: Ledger) -> None:
    """The records go (a lease lookup finds nothing) and the job id may be used again."""
    await ledger.set_retention(Retention(job_s=1, lease_s=1))
    await ledger.register_node("n1", [device_spec("n1", 0)], 64_000, 256_000)
    assert (await ledger.pend("once", 1, b"{}", None, "queued", tenant="t")).ok
    assert (await ledger.reserve(reservation("once", SliceClaim("n1/nvidia0", whole=True)))).ok
    assert (await ledger.end("lease-once", "released")).ok
    retried = await ledger.pend("once", 1, b"{}", None, "queued", tenant="t")
    assert retried.reason == "job_ended" and "released" in retried.detail
    refused = await ledger.pend("once", 1, b'{"count":2}', None, "queued", tenant="t")
    assert refused.reason == "duplicate_job" and "released" in refused.detail
    await asyncio.sleep(2.1)
    assert await ledger.get_lease("lease-once") is None
    assert await ledger.get_job("once") is None
    assert (await ledger.pend("once", 1, b"{}", None, "queued", tenant="t")).ok
    assert await audit(ledger) == []


async def test_a_tenants_job_index_outlives_its_newest_entrys_retention(ledger: Ledger) -> None:
    """Its expiry is set to twice the job retention when less than one is left: never shorter
    than an entry's retention, and not written again at every admission."""
    await ledger.set_retention(Retention(job_s=JOB_S, lease_s=LEASE_S))
    index = ledger.key("tenant-jobs", "t")
    assert (await ledger.pend("first", 1, b"{}", None, "queued", tenant="t")).ok
    assert _about(int(await ledger.redis.ttl(index)), 2 * JOB_S)
    await ledger.redis.expire(index, JOB_S + 100)
    assert (await ledger.pend("second", 1, b"{}", None, "queued", tenant="t")).ok
    assert _about(int(await ledger.redis.ttl(index)), JOB_S + 100)  # more than one left: kept
    await ledger.redis.expire(index, JOB_S - 100)
    assert (await ledger.pend("third", 1, b"{}", None, "queued", tenant="t")).ok
    assert _about(int(await ledger.redis.ttl(index)), 2 * JOB_S)
    assert [j.job_id for j in await ledger.tenant_jobs("t", 10)] == ["third", "second", "first"]


async def test_before_any_retention_is_set_the_scripts_keep_a_week(ledger: Ledger) -> None:
    """The scripts' own default (``DEFAULT_RETAIN_S`` in _prelude.lua) is the one the ledger
    reports (``DEFAULT_RETENTION_S``)."""
    await ledger.register_node("n1", [device_spec("n1", 0)], 64_000, 256_000)
    assert (await ledger.reserve(reservation("d", SliceClaim("n1/nvidia0", whole=True)))).ok
    assert (await ledger.end("lease-d", "released")).ok
    assert _about(await _ttl(ledger, "job", "d"), DEFAULT_RETENTION_S)
    assert _about(await _ttl(ledger, "lease", "lease-d"), DEFAULT_RETENTION_S)


async def test_the_lease_manager_prepares_the_ledger_with_its_settings(ledger: Ledger) -> None:
    """At start: its retention written, and the live leases of a ledger written before tenant
    lease sets indexed; a retention under an hour is refused at start-up, naming the variable."""
    settings = load_settings(
        LeaseManagerSettings,
        {"XPUPOOL_JOB_RETENTION_S": "7200", "XPUPOOL_LEASE_RETENTION_S": "3600"},
    )
    await ledger.register_node("n1", [device_spec("n1", 0)], 64_000, 256_000)
    assert (await ledger.reserve(reservation("old", SliceClaim("n1/nvidia0", whole=True)))).ok
    await ledger.redis.delete(ledger.key("tenant-leases", "t"))
    with structlog.testing.capture_logs() as logs:
        await prepare_ledger(ledger, settings)
    assert await ledger.retention() == Retention(job_s=7200, lease_s=3600)
    assert [x.lease_id for x in await ledger.tenant_leases("t", 10)] == ["lease-old"]
    assert await audit(ledger) == []
    # What changed is said once: the retention the ledger had (none: a week) and the leases
    # indexed. A start that changes nothing says nothing.
    said = {entry["event"]: entry for entry in logs}
    assert said["retention_set"]["before"] is None
    assert said["retention_set"]["job_retention_s"] == 7200
    assert said["tenant_leases_indexed"]["count"] == 1
    with structlog.testing.capture_logs() as again:
        await prepare_ledger(ledger, settings)
    assert again == []
    with pytest.raises(SystemExit, match="job_retention_s"):
        load_settings(LeaseManagerSettings, {"XPUPOOL_JOB_RETENTION_S": "600"})
