"""Crashes staged at named points (``XPUPOOL_FAILPOINTS``, ``xpupool.obs.failpoints``) rather than
timed: a service killed right after the ledger committed a step and before anyone heard of it.

Each test then checks the reliability plan's invariants on what the streams stored and what the
ledger holds: one terminal event of each kind per job (I2), no device granted twice (I1, a later
job gets another device or the freed one), nothing leaked (the ledger's audit, I3).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

import pytest

from tests.conftest import eventually
from tests.e2e.conftest import EventLog, Ready, terminal_counts
from xpupool.contracts import AllocationGranted, JobRequested, subjects
from xpupool.devstack.stack import NodeSpec, ServiceProcess, Stack
from xpupool.ledger import Ledger, audit

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]


def _service(stack: Stack, name: str) -> ServiceProcess:
    return next(s for s in stack.services if s.name == name)


async def _outbox_drained(ledger: Ledger) -> None:
    """Wait until the direct outbox is empty: every entry a dead publisher left there was
    published by the lease-manager's sweep (after ``DIRECT_STALE_MS``) and confirmed, so
    nothing more of it can come."""

    async def drained() -> bool:
        return int(await ledger.redis.xlen(ledger.key("outbox", "direct"))) == 0

    await eventually(drained, timeout_s=40)


def _each_stream(**counts: int) -> dict[str, Counter[str]]:
    expected = Counter(counts)
    return {
        subjects.EVENTS_STREAM.name: expected,
        subjects.TENANT_EVENTS_STREAM.name: expected,
    }


@pytest.mark.parametrize("term", ["kill", "1*raise"])
async def test_scheduler_failing_after_committing_a_grant_before_anyone_heard_of_it(
    make_stack: Callable[..., Stack], ready: Ready, term: str
) -> None:
    """F1: the admission script granted the job on arrival and the scheduler died (or its
    admission batch failed: ``raise``) before it answered the request or published the grant.
    The grant stands in the ledger; the client, unanswered, sends the request on the stream as
    well, which the (restarted) scheduler finds leased (nothing new); the grant's entry, left
    in the direct outbox, is published by the lease-manager's sweep. The job has one grant, and
    the next job another device."""
    stack = make_stack(
        [NodeSpec("node-f", "2xA100-80GB")],
        extra_env={"XPUPOOL_FAILPOINTS": f"scheduler.admission_committed={term}"},
    )
    ledger = await ready(stack, 2)
    scheduler = _service(stack, "scheduler")
    log = EventLog()
    async with stack.client() as client:
        await log.attach(client.nc)
        waiting = asyncio.create_task(
            client.submit_and_wait(JobRequested(job_id="f1", tenant="t"), timeout_s=90)
        )

        async def leased() -> bool:
            job = await ledger.get_job("f1")
            return job is not None and job.state == "leased"

        await eventually(leased, timeout_s=20)
        job = await ledger.get_job("f1")
        assert job is not None
        if term == "kill":
            await eventually(lambda: not scheduler.alive(), timeout_s=20)
            stack.restart(scheduler, XPUPOOL_FAILPOINTS="")
        else:
            assert scheduler.alive()

        grant = await waiting
        assert isinstance(grant, AllocationGranted) and grant.lease_id == job.lease_id
        after = await client.submit_and_wait(JobRequested(job_id="f1-after", tenant="t"))
        assert isinstance(after, AllocationGranted)
        assert {s.device_id for s in after.slices}.isdisjoint(s.device_id for s in grant.slices)
        await _outbox_drained(ledger)
        await asyncio.sleep(0.5)  # anything still on its way is stored by now
        assert await terminal_counts(client.nc, "f1") == _each_stream(AllocationGranted=1)
        assert len([g for g in log.distinct(AllocationGranted) if g.job_id == "f1"]) == 1
        assert log.copies_that_differ() == []
    assert await audit(ledger) == []


async def test_scheduler_killed_after_publishing_a_grant_before_confirming_it(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    """F2: a request sent on the stream is granted on arrival, its grant handed to the
    connection, and the scheduler dies before JetStream's acknowledgement confirmed the grant's
    outbox entry and before it acknowledged the request. The sweep publishes the entry again
    (JetStream keeps one copy: same ``Nats-Msg-Id``), and the request, delivered again to the
    restarted scheduler once its ack wait ran out, finds its job leased and publishes nothing:
    one grant stored, and the stream's consumer has nothing left to deliver."""
    stack = make_stack(
        [NodeSpec("node-g", "1xA100-80GB")],
        extra_env={"XPUPOOL_FAILPOINTS": "scheduler.grants_published=kill"},
    )
    ledger = await ready(stack, 1)
    await stack.wait_until_pulling()
    scheduler = _service(stack, "scheduler")
    async with stack.client() as client:
        waiting = asyncio.create_task(
            client.submit_and_wait(
                JobRequested(job_id="f2", tenant="t"), timeout_s=90, by_request=False
            )
        )
        await eventually(lambda: not scheduler.alive(), timeout_s=20)
        stack.restart(scheduler, XPUPOOL_FAILPOINTS="")
        grant = await waiting
        assert isinstance(grant, AllocationGranted)
        js = client.nc.jetstream()

        async def request_settled() -> bool:
            info = await js.consumer_info(subjects.JOBS_STREAM.name, subjects.SCHEDULER_JOBS.name)
            return bool(info.num_ack_pending == 0 and info.num_pending == 0)

        # The request's first delivery was never acknowledged: it comes again after 30 s.
        await eventually(request_settled, timeout_s=60)
        await _outbox_drained(ledger)
        await asyncio.sleep(0.5)
        assert await terminal_counts(client.nc, "f2") == _each_stream(AllocationGranted=1)
        leases = [lease for lease in await ledger.leases() if lease.job_id == "f2"]
        assert [lease.lease_id for lease in leases] == [grant.lease_id]
    assert await audit(ledger) == []


async def test_lease_manager_killed_after_ending_a_lease_before_anyone_heard_of_it(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    """F3: a holder's release ended its lease in the ledger and the lease-manager died before
    the reply and the LeaseEnded. The holder's release is unanswered, and asked again it is
    told the lease ended; the sweep of the restarted lease-manager publishes the LeaseEnded
    once; the device is free for the next job."""
    stack = make_stack(
        [NodeSpec("node-h", "1xA100-80GB")],
        extra_env={"XPUPOOL_FAILPOINTS": "lease_manager.lease_ended=kill"},
    )
    ledger = await ready(stack, 1)
    lease_manager = _service(stack, "lease-manager")
    async with stack.client() as client:
        grant = await client.submit_and_wait(JobRequested(job_id="f3", tenant="t"))
        assert isinstance(grant, AllocationGranted)
        release = asyncio.create_task(client.release(grant.lease_id, grant.fencing_token))
        await eventually(lambda: not lease_manager.alive(), timeout_s=20)
        lease = await ledger.get_lease(grant.lease_id)
        assert lease is not None and lease.state == "ended", lease
        stack.restart(lease_manager, XPUPOOL_FAILPOINTS="")
        with pytest.raises(Exception):  # noqa: B017,PT011  (no reply ever came)
            await release
        again = await client.release(grant.lease_id, grant.fencing_token)
        assert not again.ok and again.error == "lease_ended", again

        after = await client.submit_and_wait(JobRequested(job_id="f3-after", tenant="t"))
        assert isinstance(after, AllocationGranted)
        assert [s.device_id for s in after.slices] == [s.device_id for s in grant.slices]
        await _outbox_drained(ledger)
        await asyncio.sleep(0.5)
        assert await terminal_counts(client.nc, "f3") == _each_stream(
            AllocationGranted=1, LeaseEnded=1
        )
    assert await audit(ledger) == []


async def test_scheduler_killed_after_a_cycle_committed_its_grant(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    """A scheduling cycle's reservation granted a waiting job and the scheduler died before the
    cycle's bookkeeping: the grant, queued in the lease-manager's outbox by the same script, is
    published by its relay, once; the restarted scheduler's cycles find nothing left to place."""
    stack = make_stack(
        [NodeSpec("node-k", "1xA100-80GB")],
        extra_env={
            "XPUPOOL_FAILPOINTS": "scheduler.cycle_committed=kill",
            "XPUPOOL_PLACE_ON_ADMISSION": "0",
        },
    )
    ledger = await ready(stack, 1)
    scheduler = _service(stack, "scheduler")
    async with stack.client() as client:
        waiting = asyncio.create_task(
            client.submit_and_wait(JobRequested(job_id="f4", tenant="t"), timeout_s=60)
        )
        await eventually(lambda: not scheduler.alive(), timeout_s=20)
        stack.restart(scheduler, XPUPOOL_FAILPOINTS="")
        grant = await waiting
        assert isinstance(grant, AllocationGranted)
        after = asyncio.create_task(
            client.submit_and_wait(JobRequested(job_id="f4-after", tenant="t"), timeout_s=60)
        )
        await asyncio.sleep(1.5)  # the one device is f4's: the next job waits
        assert not after.done()
        await client.release(grant.lease_id, grant.fencing_token)
        assert isinstance(await after, AllocationGranted)
        await asyncio.sleep(0.5)
        assert await terminal_counts(client.nc, "f4") == _each_stream(
            AllocationGranted=1, LeaseEnded=1
        )
    assert await audit(ledger) == []
