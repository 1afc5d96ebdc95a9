"""The ledger's announced lease ends (maximum run time, idle reclaim) on a real redis-server:
each sweep reads only the leases due, and a sweep smaller than the watch list reaches them all."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.ledger_builders import granted_whole_leases
from xpupool.contracts import DeviceSample
from xpupool.ledger import Ledger

pytestmark = pytest.mark.integration


async def test_idle_leases_beyond_one_sweep_are_all_reclaimed(ledger: Ledger) -> None:
    leases = await granted_whole_leases(ledger, 3, idle_after_ms=200)
    await asyncio.sleep(0.3)
    warned: list[str] = []
    for _ in range(3):  # one lease per sweep: each sweep must reach a new one
        warned += (await ledger.reclaim_idle(warning_ms=60_000, limit=1)).ended
    assert sorted(warned) == leases
    assert (await ledger.reclaim_idle(warning_ms=60_000)).ended == []  # warned once each
    for lease_id in leases:
        lease = await ledger.get_lease(lease_id)
        assert lease is not None and lease.state == "active"  # ends at the deadline, not now


async def test_a_busy_lease_is_looked_at_again_only_when_it_could_be_idle(ledger: Ledger) -> None:
    (lease_id,) = await granted_whole_leases(ledger, 1, idle_after_ms=400)
    await asyncio.sleep(0.2)
    assert (await ledger.heartbeat("n1", [DeviceSample(device_id="n1/nvidia0", util_pct=80.0)])).ok
    await asyncio.sleep(0.25)  # 450 ms after the grant, 250 after the work
    assert (await ledger.reclaim_idle(warning_ms=60_000)).ended == []
    await asyncio.sleep(0.25)  # 500 ms after the work
    assert (await ledger.reclaim_idle(warning_ms=60_000)).ended == [lease_id]


async def test_max_runtime_warnings_read_only_leases_with_a_deadline(ledger: Ledger) -> None:
    bounded = await granted_whole_leases(ledger, 2, max_runtime_ms=300)
    assert (await ledger.warn_deadlines(warning_ms=100)).ended == []  # 300 ms away
    await asyncio.sleep(0.25)
    assert (
        sorted(
            (await ledger.warn_deadlines(warning_ms=100, limit=1)).ended
            + (await ledger.warn_deadlines(warning_ms=100, limit=1)).ended
        )
        == bounded
    )
    await asyncio.sleep(0.2)
    assert sorted((await ledger.expire_due()).ended) == bounded
    for lease_id in bounded:
        lease = await ledger.get_lease(lease_id)
        assert lease is not None and lease.end_reason == "max_runtime"


async def test_a_lease_record_without_slices_still_ends_whole(ledger: Ledger) -> None:
    """A record missing its slices (damaged by hand or by an older writer) ends like any other:
    the script does not stop halfway through its writes, after the usage record and before the
    lease, its indexes and its job are ended."""
    [lease_id] = await granted_whole_leases(ledger, 1)
    await ledger.redis.hdel(ledger.key("lease", lease_id), "slices")
    result = await ledger.end(lease_id, "expired")
    assert result.ok and result.outcome == "ended"
    lease = await ledger.redis.hgetall(ledger.key("lease", lease_id))
    assert lease[b"state"] == b"ended" and lease[b"end_reason"] == b"expired"
    job = await ledger.get_job("j0")
    assert job is not None and job.state == "ended"
    assert await ledger.redis.zscore(ledger.key("expiry"), lease_id) is None
    assert not await ledger.redis.sismember(ledger.key("leases"), lease_id)
    assert await ledger.redis.hexists(ledger.key("usage-rec"), lease_id)
