"""Jobs submitted by request/reply (``jobs.submit``): the reply says where the job stands once the
ledger has it, and every outcome is published as the same event a stream submission gets."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable

import msgspec
import pytest

from tests.conftest import eventually
from tests.e2e.conftest import Ready
from xpupool.client import TenantEvent, XpupoolClient
from xpupool.contracts import (
    AllocationGranted,
    JobReason,
    JobRejected,
    JobRequested,
    LeaseEnded,
    SubmitOutcome,
    SubmitReply,
    decoder_for,
    encode,
)
from xpupool.contracts import subjects as s
from xpupool.devstack.stack import NodeSpec, Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

TENANT = "alpha"
_REPLY = decoder_for((SubmitReply,))


@pytest.fixture(params=["plain", "secure"])
def stack_security(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _whole(job_id: str) -> JobRequested:
    return JobRequested(job_id=job_id, tenant=TENANT)


@pytest.fixture
async def serving(
    make_stack: Callable[..., Stack], ready: Ready
) -> AsyncIterator[tuple[XpupoolClient, list[TenantEvent]]]:
    """A tenant's client of a one-device stack whose scheduler serves submissions, and the
    tenant's events it receives."""
    stack = make_stack([NodeSpec("node-s", "1xA100-80GB")], tenants=[TENANT])
    await ready(stack, 1)
    async with stack.client(TENANT) as client:
        events: list[TenantEvent] = []
        client.listen(events.append)
        await client.jobs()  # answered once the scheduler serves (submissions before queries)
        yield client, events


async def test_the_reply_is_the_outcome_and_the_events_say_the_same(
    serving: tuple[XpupoolClient, list[TenantEvent]],
) -> None:
    client, events = serving
    placed = await client.submit_request(_whole("sub-1"))
    assert placed is not None and placed.outcome is SubmitOutcome.GRANTED
    grant = placed.granted
    assert grant is not None and grant.job_id == "sub-1" and grant.lease_secret

    # The only device is held: the next one waits, and its grant comes as an event.
    waiting = await client.submit_request(_whole("sub-2"))
    assert waiting is not None and waiting.outcome is SubmitOutcome.WAITING
    assert waiting.granted is None and waiting.rejected is None

    # A resubmission of a job that went further is told so, and granted nothing more; its
    # owner is given the live grant again (one whose connection was down when it went out has
    # no other way to it).
    again = await client.submit_request(_whole("sub-1"))
    assert again is not None and again.outcome is SubmitOutcome.KNOWN
    assert again.granted == grant

    # The reply's grant is the published one; releasing it needs nothing but the reply.
    def granted() -> list[AllocationGranted]:
        return [e for e in events if isinstance(e, AllocationGranted)]

    async def first_grant() -> list[AllocationGranted] | None:
        return granted() or None

    await eventually(first_grant)
    assert granted() == [grant]
    assert (await client.release(grant.lease_id, grant.fencing_token)).ok

    async def second() -> AllocationGranted | None:
        return next((e for e in granted() if e.job_id == "sub-2"), None)

    later = await eventually(second)
    assert later is not None and later.lease_secret
    assert [e.job_id for e in granted()] == ["sub-1", "sub-2"]


async def test_a_holder_releasing_on_the_answer_never_sees_its_end_before_its_grant(
    serving: tuple[XpupoolClient, list[TenantEvent]],
) -> None:
    """The answer leaves ahead of the grant's event, and the holder releases at once: each
    lease's grant is still received exactly once, and before its end (the lease-manager sends a
    copy of a grant the scheduler has not yet confirmed stored ahead of the ``LeaseEnded``;
    ``tests/integration/test_grant_order.py`` holds the scheduler back to prove it)."""
    client, events = serving
    leases = []
    for i in range(8):
        placed = await client.submit_request(_whole(f"order-{i}"))
        assert placed is not None and placed.granted is not None
        leases.append(placed.granted.lease_id)
        assert (await client.release(placed.granted.lease_id, placed.granted.fencing_token)).ok

    def ended() -> set[str]:
        return {e.lease_id for e in events if isinstance(e, LeaseEnded)}

    await eventually(lambda: ended() >= set(leases))
    for lease_id in leases:
        kinds = [type(e) for e in events if getattr(e, "lease_id", None) == lease_id]
        assert kinds == [AllocationGranted, LeaseEnded], lease_id


async def test_bad_and_refused_requests_are_answered_and_published(
    serving: tuple[XpupoolClient, list[TenantEvent]],
) -> None:
    client, events = serving
    subject = s.JOB_SUBMIT.subject(tenant=TENANT)

    # Not a job request at all: the reply names the field, the rejection is published.
    bad = {"job_id": "sub-bad", "count": "two"}
    raw = await client.nc.request(subject, json.dumps(bad).encode(), timeout=5)
    reply = _REPLY.decode(raw.data)
    assert reply.outcome is SubmitOutcome.REJECTED and reply.rejected is not None
    assert reply.rejected.job_id == "sub-bad"
    assert reply.rejected.reason is JobReason.INVALID_REQUEST
    assert reply.rejected.field_name == "count"

    # A payload naming another tenant.
    foreign = msgspec.structs.replace(_whole("sub-foreign"), tenant="beta")
    raw = await client.nc.request(subject, encode(foreign), timeout=5)
    reply = _REPLY.decode(raw.data)
    assert reply.rejected is not None and reply.rejected.reason is JobReason.TENANT_MISMATCH

    async def both_rejected() -> bool:
        return {e.job_id for e in events if isinstance(e, JobRejected)} >= {
            "sub-bad",
            "sub-foreign",
        }

    await eventually(both_rejected)

    # submit_and_wait answers a refusal at once, without waiting for the event.
    outcome = await client.submit_and_wait(
        JobRequested(job_id="sub-queue", tenant=TENANT, queue="nobody-s-queue"),
        timeout_s=10,
    )
    assert isinstance(outcome, JobRejected)
    assert outcome.reason is JobReason.QUEUE_NOT_ALLOWED


async def test_duplicates_by_request_and_by_stream_make_one_grant(
    serving: tuple[XpupoolClient, list[TenantEvent]],
) -> None:
    """The same job sent twice by request and once on the stream, at once: one grant, one
    event; the other replies say the job is known (or, if it came first, granted)."""
    client, events = serving
    request = _whole("sub-dup")
    first, second, _ = await asyncio.gather(
        client.submit_request(request), client.submit_request(request), client.submit(request)
    )
    assert first is not None and second is not None
    outcomes = sorted([first.outcome, second.outcome])
    assert outcomes in (
        [SubmitOutcome.GRANTED, SubmitOutcome.KNOWN],
        [SubmitOutcome.KNOWN, SubmitOutcome.KNOWN],  # the stream's copy came first
    )

    async def granted() -> list[AllocationGranted] | None:
        return [e for e in events if isinstance(e, AllocationGranted)] or None

    (grant,) = await eventually(granted) or []
    await asyncio.sleep(1.0)  # a second grant, if any, would be out by now
    assert [e for e in events if isinstance(e, AllocationGranted)] == [grant]
    assert grant.job_id == "sub-dup"
    assert all(r.granted in (None, grant) for r in (first, second))


async def test_a_plain_nats_client_reads_the_reply_as_the_schema_says(
    serving: tuple[XpupoolClient, list[TenantEvent]],
) -> None:
    """What a client written from proto/ alone sends and reads: plain JSON both ways."""
    client, _ = serving
    request = {"job_id": "sub-plain", "count": 1, "device": {"memory_mib": 1000}}
    raw = await client.nc.request(
        s.JOB_SUBMIT.subject(tenant=TENANT), json.dumps(request).encode(), timeout=5
    )
    reply = json.loads(raw.data)
    assert reply["type"] == "xpupool.job.submit_reply.v1" and reply["outcome"] == "granted"
    grant = reply["granted"]
    assert grant["type"] == "xpupool.alloc.granted.v1" and grant["job_id"] == "sub-plain"
    assert grant["lease_secret"] and grant["env"] and grant["slices"][0]["memory_mib"] == 1000
    assert (raw.headers or {})["ce-type"] == "xpupool.job.submit_reply.v1"
