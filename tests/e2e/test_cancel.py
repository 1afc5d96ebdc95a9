"""Cancelling jobs, and resubmitting a job id that has ended, against a running stack."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
import pytest

from tests.conftest import eventually
from tests.e2e.conftest import EventLog, Ready
from xpupool.client import TenantEvent, XpupoolClient
from xpupool.contracts import (
    AllocationGranted,
    CancelError,
    CancelOutcome,
    JobCancelled,
    JobPending,
    JobReason,
    JobRejected,
    JobRequested,
    JobState,
    LeaseEnded,
    SubmitOutcome,
)
from xpupool.devstack.stack import NodeSpec, Stack
from xpupool.ledger import Ledger, audit

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

OWNER, OTHER = "alpha", "beta"


@pytest.fixture(params=["plain", "secure"])
def stack_security(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _one_gpu(make_stack: Callable[..., Stack]) -> Stack:
    return make_stack([NodeSpec("node-c", "1xA100-80GB")], tenants=[OWNER, OTHER])


async def _granted(client: XpupoolClient, job_id: str) -> AllocationGranted:
    outcome = await client.submit_and_wait(JobRequested(job_id=job_id, tenant=OWNER))
    assert isinstance(outcome, AllocationGranted), outcome
    return outcome


async def _device_free(ledger: Ledger) -> None:
    async def free() -> bool:
        (node,) = await ledger.nodes()
        return node.devices[0].holders == 0

    await eventually(free)


async def test_a_waiting_job_is_cancelled_once_and_never_granted(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    stack = _one_gpu(make_stack)
    ledger = await ready(stack, 1)
    async with stack.client() as operator, stack.client(OWNER) as owner:
        log = EventLog()
        await log.attach(operator.nc)
        holder = await _granted(owner, "holder")
        await owner.submit(JobRequested(job_id="waiter", tenant=OWNER))

        async def waiting() -> bool:
            return bool(log.of(JobPending, "waiter"))

        await eventually(waiting)
        outcome = owner.expect("waiter")  # before cancelling: the event may beat the reply
        reply = await owner.cancel("waiter")
        assert reply.ok and reply.outcome is CancelOutcome.CANCELLED, reply
        assert isinstance(await asyncio.wait_for(outcome, 10), JobCancelled)
        again = await owner.cancel("waiter")
        assert again.error is CancelError.JOB_ENDED and "cancelled" in again.detail
        # The freed device must not go to the cancelled job.
        assert (await owner.release(holder.lease_id, holder.fencing_token)).ok
        await _device_free(ledger)
        await asyncio.sleep(1.0)  # a scheduling cycle or two
        assert not log.of(AllocationGranted, "waiter")
        assert len(log.of(JobCancelled, "waiter")) == 1
    assert await audit(ledger) == []


async def test_a_granted_job_is_cancelled_by_releasing_its_lease(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    stack = _one_gpu(make_stack)
    ledger = await ready(stack, 1)
    async with stack.client() as operator, stack.client(OWNER) as owner:
        log = EventLog()
        await log.attach(operator.nc)
        grant = await _granted(owner, "running")
        reply = await owner.cancel("running")
        assert reply.ok and reply.outcome is CancelOutcome.RELEASING, reply

        async def released() -> bool:
            return [e.reason.value for e in log.of(LeaseEnded, "running")] == ["released"]

        await eventually(released)
        await _device_free(ledger)
        # The holder learns it lost the lease; nothing else ends twice.
        refused = await owner.renew(grant.lease_id, grant.fencing_token)
        assert not refused.ok and refused.error is not None
        assert refused.error.value == "lease_ended"
    assert await audit(ledger) == []


async def test_another_tenant_cannot_cancel_or_even_see_a_job(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    stack = _one_gpu(make_stack)
    ledger = await ready(stack, 1)
    async with stack.client(OWNER) as owner, stack.client(OTHER) as other:
        grant = await _granted(owner, "mine")
        foreign = await other.cancel("mine")
        assert foreign.error is CancelError.UNKNOWN_JOB and foreign.detail == ""
        unknown = await other.cancel("no-such-job")
        assert unknown.error is CancelError.UNKNOWN_JOB
        lease = await ledger.get_lease(grant.lease_id)
        assert lease is not None and lease.state == "active"
        assert (await owner.release(grant.lease_id, grant.fencing_token)).ok


async def test_resubmitting_an_ended_job_is_answered_with_its_outcome(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    """The same request again after its job ended (a retry, on the stream or by request) gets no
    second outcome: by request it is answered ``known``, ended, with how; another request under
    the job id is rejected duplicate_job naming how the job ended; the ended job is left as it
    was."""
    stack = _one_gpu(make_stack)
    ledger = await ready(stack, 1)
    async with stack.client(OWNER) as owner, stack.client(OTHER) as other:
        grant = await _granted(owner, "once")
        assert (await owner.release(grant.lease_id, grant.fencing_token)).ok
        await _device_free(ledger)
        seen: list[TenantEvent] = []
        owner.listen(seen.append)
        other_seen: list[TenantEvent] = []
        other.listen(other_seen.append)
        same = JobRequested(job_id="once", tenant=OWNER)
        await owner.submit(same)
        reply = await owner.submit_request(same)
        assert reply is not None and reply.outcome is SubmitOutcome.KNOWN, reply
        assert reply.state is JobState.ENDED and reply.granted is None and reply.rejected is None
        assert f"its lease {grant.lease_id} ended (released)" in reply.detail
        changed = JobRequested(job_id="once", tenant=OWNER, labels={"attempt": "2"})
        # A message id of its own: within the stream's 100 ms window, the client's (the job id)
        # would have the stream drop it as the retry's copy.
        await owner.submit_raw(msgspec.json.encode(changed), msg_id="once-changed", tenant=OWNER)

        def answered() -> list[TenantEvent]:
            return [e for e in seen if getattr(e, "job_id", None) == "once"]

        # The stream is handled in order: once the changed request is answered, the retry
        # published before it was handled too, and published nothing.
        (rejection,) = await eventually(answered)
        assert isinstance(rejection, JobRejected), rejection
        assert rejection.reason is JobReason.DUPLICATE_JOB
        assert f"its lease {grant.lease_id} ended (released)" in rejection.detail
        # Another tenant using the id learns nothing about the job.
        foreign = msgspec.json.encode(JobRequested(job_id="once", tenant=OTHER))
        await other.submit_raw(foreign, msg_id="once-other", tenant=OTHER)

        def refused() -> list[JobRejected]:
            return [e for e in other_seen if isinstance(e, JobRejected) and e.job_id == "once"]

        (theirs,) = await eventually(refused)
        assert theirs.reason is JobReason.DUPLICATE_JOB and grant.lease_id not in theirs.detail
    assert await audit(ledger) == []
