"""The Python client's request/reply against a real nats-server: a command that found no
service subscribed (one restarting, or not up yet) is sent again until the deadline; one that
may have reached a service is never sent twice."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime

import msgspec
import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from xpupool.bus.connection import ensure_streams
from xpupool.client import XpupoolClient, connected
from xpupool.contracts import (
    AllocationGranted,
    JobRequested,
    LeaseReply,
    ReleaseLease,
    SubmitOutcome,
    SubmitReply,
    encode,
)
from xpupool.contracts import subjects as s
from xpupool.devstack.servers import NatsServer

pytestmark = pytest.mark.timeout(60)

RENEW = s.LEASE_RENEW.subject(tenant="acme")


@pytest.fixture
async def service(nats_server: NatsServer) -> AsyncIterator[Client]:
    nc = await nats.connect(nats_server.url)
    yield nc
    await nc.close()


async def _answer_renewals(service: Client, seen: list[bytes], answer: bool = True) -> None:
    async def on_request(msg: Msg) -> None:
        seen.append(msg.data)
        if answer:
            await msg.respond(encode(LeaseReply(ok=True, lease_id="lease-1")))

    await service.subscribe(RENEW, queue="lease-manager", cb=on_request)
    await service.flush()


async def test_a_renewal_sent_before_the_lease_manager_is_up_is_answered_once_it_is(
    nats_server: NatsServer, service: Client
) -> None:
    seen: list[bytes] = []
    async with connected(nats_server.url) as client:
        renewal = asyncio.create_task(client.renew("lease-1", 1, secret="s", tenant="acme"))
        await asyncio.sleep(0.3)
        assert not renewal.done()  # "no responders" was not the answer
        await _answer_renewals(service, seen)
        reply = await renewal
    assert reply.ok and reply.lease_id == "lease-1"
    assert len(seen) == 1  # the attempts that found nobody reached nobody


async def test_with_no_service_at_all_the_request_fails_as_no_responders_at_its_deadline(
    nats_server: NatsServer,
) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        client = XpupoolClient(nc, "acme", request_timeout_s=0.5)
        with pytest.raises(NoRespondersError):
            await client.release("lease-1", 1, secret="s")
        with pytest.raises(NoRespondersError):
            await client.leases()
    finally:
        await nc.close()


async def test_a_request_that_reached_a_service_is_not_sent_again(
    nats_server: NatsServer, service: Client
) -> None:
    seen: list[bytes] = []
    await _answer_renewals(service, seen, answer=False)
    nc = await nats.connect(nats_server.url)
    try:
        client = XpupoolClient(nc, "acme", request_timeout_s=0.5)
        with pytest.raises(NatsTimeoutError):
            await client.renew("lease-1", 1, secret="s")
    finally:
        await nc.close()
    assert len(seen) == 1


# ---- jobs submitted by request/reply ----------------------------------------------------------

SUBMIT = s.JOB_SUBMIT.subject(tenant="acme")


def _grant(job_id: str) -> AllocationGranted:
    now = datetime.now(UTC)
    return AllocationGranted(
        job_id=job_id,
        lease_id=f"lease-{job_id}",
        tenant="acme",
        owner="acme",
        fencing_token=7,
        granted_at=now,
        expires_at=now,
        slices=[],
        env={},
        lease_secret="secret-of-" + job_id,
    )


async def _serve_submissions(service: Client, answer: Callable[[Msg], Awaitable[None]]) -> None:
    await service.subscribe(SUBMIT, queue="scheduler", cb=answer)
    await service.flush()


async def test_a_submission_no_scheduler_answers_is_published_on_the_job_stream(
    nats_server: NatsServer,
) -> None:
    async with connected(nats_server.url) as client:
        await ensure_streams(client.js, s.STREAMS)
        with pytest.raises(TimeoutError):
            await client.submit_and_wait(JobRequested(job_id="j-1", tenant="acme"), timeout_s=0.5)
        stored = await client.js.get_last_msg(s.JOBS_STREAM.name, s.JOB_REQUESTED.pattern)
    assert stored.headers is not None and stored.headers["Nats-Msg-Id"] == "j-1"
    assert stored.data is not None
    assert msgspec.json.decode(stored.data, type=JobRequested).job_id == "j-1"


async def test_a_granted_reply_is_the_outcome_and_its_secret_serves_the_release(
    nats_server: NatsServer, service: Client
) -> None:
    grant = _grant("j-2")
    released: list[ReleaseLease] = []

    async def answer(msg: Msg) -> None:
        reply = SubmitReply(job_id="j-2", outcome=SubmitOutcome.GRANTED, granted=grant)
        await msg.respond(encode(reply))

    async def release(msg: Msg) -> None:
        released.append(msgspec.json.decode(msg.data, type=ReleaseLease))
        await msg.respond(encode(LeaseReply(ok=True, lease_id=grant.lease_id)))

    await _serve_submissions(service, answer)
    await service.subscribe(s.LEASE_RELEASE.subject(tenant="acme"), cb=release)
    await service.flush()
    async with connected(nats_server.url, "acme") as client:
        # No event is ever published here: the reply alone answers, and holds the secret.
        outcome = await client.submit_and_wait(JobRequested(job_id="j-2"), timeout_s=5)
        assert outcome == grant
        assert (await client.release(grant.lease_id, grant.fencing_token)).ok
    assert [r.lease_secret for r in released] == [grant.lease_secret]


async def test_a_waiting_reply_is_followed_by_the_outcome_event(
    nats_server: NatsServer, service: Client
) -> None:
    grant = _grant("j-3")

    async def answer(msg: Msg) -> None:
        await msg.respond(encode(SubmitReply(job_id="j-3", outcome=SubmitOutcome.WAITING)))
        await asyncio.sleep(0.2)
        await service.publish(s.TENANT_ALLOC_GRANTED.subject(tenant="acme"), encode(grant))

    await _serve_submissions(service, answer)
    async with connected(nats_server.url, "acme") as client:
        assert await client.submit_and_wait(JobRequested(job_id="j-3"), timeout_s=5) == grant
