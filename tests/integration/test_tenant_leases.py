"""A tenant's live leases (lease.list) come from its own set of live leases, which the scripts
keep: a lease is listed while it lives, whatever became of its job's entry in the tenant's job
index, and a ledger written before those sets is indexed once."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.ledger_builders import device_spec, reservation
from xpupool.ledger import Ledger, SliceClaim, audit

pytestmark = pytest.mark.integration


async def _eight_gpus(ledger: Ledger) -> None:
    specs = [device_spec("n1", i) for i in range(8)]
    assert (await ledger.register_node("n1", specs, 64_000, 256_000)).ok


async def test_a_tenant_lists_its_live_leases_newest_first_and_no_one_elses(
    ledger: Ledger,
) -> None:
    await _eight_gpus(ledger)
    for i, tenant in enumerate(["a", "a", "b", "a"]):
        claim = SliceClaim(f"n1/nvidia{i}", whole=True)
        assert (await ledger.reserve(reservation(f"j{i}", claim, tenant=tenant))).ok
        await asyncio.sleep(0.002)  # created_ms orders them
    assert (await ledger.grant("lease-j0")).ok
    assert [x.lease_id for x in await ledger.tenant_leases("a", 10)] == [
        "lease-j3",
        "lease-j1",
        "lease-j0",
    ]
    assert [x.lease_id for x in await ledger.tenant_leases("a", 2)] == ["lease-j3", "lease-j1"]
    assert [x.lease_id for x in await ledger.tenant_leases("b", 10)] == ["lease-j2"]
    assert (await ledger.end("lease-j1", "released")).ok
    assert (await ledger.end("lease-j2", "released")).ok
    assert [x.lease_id for x in await ledger.tenant_leases("a", 10)] == ["lease-j3", "lease-j0"]
    assert await ledger.tenant_leases("b", 10) == []
    # A tenant whose leases all ended keeps no set at all.
    assert not await ledger.redis.exists(ledger.key("tenant-leases", "b"))
    assert await audit(ledger) == []


async def test_a_long_running_lease_stays_listed_after_its_job_left_the_job_index(
    ledger: Ledger,
) -> None:
    """The job index keeps a tenant's jobs of the job retention, at most 1,000; a lease that
    outlives its job's entry there (a week-long run, or 1,000 newer jobs) is still the
    tenant's."""
    await _eight_gpus(ledger)
    assert (await ledger.pend("long", 1, b"{}", None, "queued", tenant="t")).ok
    assert (await ledger.reserve(reservation("long", SliceClaim("n1/nvidia0", whole=True)))).ok
    await ledger.redis.zrem(ledger.key("tenant-jobs", "t"), "long")
    assert [x.lease_id for x in await ledger.tenant_leases("t", 10)] == ["lease-long"]


async def test_a_running_job_stays_in_its_tenants_job_list_after_it_left_the_job_index(
    ledger: Ledger,
) -> None:
    """jobs.list: the index's jobs and, in their place by admission time, the jobs of the
    tenant's live leases that its trim dropped; the newest ``limit`` of them all."""
    await _eight_gpus(ledger)
    assert (await ledger.pend("long", 1, b"{}", None, "queued", tenant="t")).ok
    assert (await ledger.reserve(reservation("long", SliceClaim("n1/nvidia0", whole=True)))).ok
    for i in range(3):
        await asyncio.sleep(0.002)  # admission times order them
        assert (await ledger.pend(f"later{i}", 1, b"{}", None, "queued", tenant="t")).ok
    assert (await ledger.pend("other", 1, b"{}", None, "queued", tenant="u")).ok
    # What the index's trim does to an entry older than the job retention, or 1,000 jobs back.
    await ledger.redis.zrem(ledger.key("tenant-jobs", "t"), "long")
    assert [j.job_id for j in await ledger.tenant_jobs("t", 10)] == [
        "later2",
        "later1",
        "later0",
        "long",
    ]
    assert [j.job_id for j in await ledger.tenant_jobs("t", 2)] == ["later2", "later1"]
    (running,) = [j for j in await ledger.tenant_jobs("t", 10) if j.job_id == "long"]
    assert running.state == "reserved" and running.lease_id == "lease-long"
    assert [j.job_id for j in await ledger.tenant_jobs("u", 10)] == ["other"]
    # Once its lease ends, an unindexed job is no longer listed: ended jobs are the index's.
    assert (await ledger.end("lease-long", "released")).ok
    assert "long" not in [j.job_id for j in await ledger.tenant_jobs("t", 10)]


async def test_a_waiting_job_stays_in_its_tenants_job_list_after_it_left_the_job_index(
    ledger: Ledger,
) -> None:
    """A job that waits longer than the job retention (or behind 1,000 newer ones) is still the
    tenant's, listed by admission time; other tenants' waiting jobs are not."""
    assert (await ledger.pend("stuck", 1, b"{}", None, "no_capacity", tenant="t")).ok
    assert (await ledger.pend("theirs", 1, b"{}", None, "no_capacity", tenant="u")).ok
    await asyncio.sleep(0.002)  # admission times order them
    assert (await ledger.pend("later", 1, b"{}", None, "queued", tenant="t")).ok
    for tenant, job_id in (("t", "stuck"), ("u", "theirs")):
        await ledger.redis.zrem(ledger.key("tenant-jobs", tenant), job_id)
    listed = await ledger.tenant_jobs("t", 10)
    assert [(j.job_id, j.state) for j in listed] == [("later", "pending"), ("stuck", "pending")]
    assert [j.job_id for j in await ledger.tenant_jobs("t", 1)] == ["later"]
    assert [j.job_id for j in await ledger.tenant_jobs("u", 10)] == ["theirs"]
    # A queue longer than one chunk of the scan (and than a listpack's 128 entries, which a scan
    # returns whole) is read to its end.
    for i in range(140):
        assert (await ledger.pend(f"more{i}", 1, b"{}", None, "queued", tenant="u")).ok
    found = await ledger._unindexed_waiting("t", set(), chunk=2)  # noqa: SLF001
    assert sorted(found) == ["later", "stuck"]


async def test_a_ledger_written_before_tenant_lease_sets_is_indexed_once(ledger: Ledger) -> None:
    await _eight_gpus(ledger)
    for i in range(5):
        claim = SliceClaim(f"n1/nvidia{i}", whole=True)
        assert (await ledger.reserve(reservation(f"j{i}", claim, tenant=f"t{i % 2}"))).ok
    assert (await ledger.end("lease-j4", "released")).ok
    for tenant in ("t0", "t1"):
        await ledger.redis.delete(ledger.key("tenant-leases", tenant))
    assert sorted(await audit(ledger)) == [
        "tenant t0's lease set lacks live leases ['lease-j0', 'lease-j2'] and holds others []",
        "tenant t1's lease set lacks live leases ['lease-j1', 'lease-j3'] and holds others []",
    ]
    assert await ledger.index_tenant_leases(chunk=1) == 4
    assert await ledger.index_tenant_leases() == 0
    assert await audit(ledger) == []
    assert {x.lease_id for x in await ledger.tenant_leases("t1", 10)} == {"lease-j1", "lease-j3"}


async def test_the_audit_names_a_set_that_holds_a_lease_no_longer_live(ledger: Ledger) -> None:
    await _eight_gpus(ledger)
    assert (await ledger.reserve(reservation("j", SliceClaim("n1/nvidia0", whole=True)))).ok
    assert (await ledger.end("lease-j", "released")).ok
    await ledger.redis.sadd(ledger.key("tenant-leases", "t"), "lease-j")
    assert await audit(ledger) == [
        "tenant t's lease set lacks live leases [] and holds others ['lease-j']"
    ]
