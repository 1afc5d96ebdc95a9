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

from xpupool.bus.connection import ensure_streams, round_trip
from xpupool.client import XpupoolClient, connected
from xpupool.contracts import (
    AllocationGranted,
    EndReason,
    JobRequested,
    LeaseEnded,
    LeaseError,
    LeaseReply,
    ReleaseLease,
    RenewLease,
    SubmitOutcome,
    SubmitReply,
    encode,
)
from xpupool.contracts import subjects as s
from xpupool.contracts.subjects import Channel
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
    await round_trip(service)  # the server has the subscription


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
    await round_trip(service)  # the server has the subscription


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
    await round_trip(service)  # the server has the subscription
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


# ---- the secrets a client keeps for its holder's commands -------------------------------------


async def _serve_releases(
    service: Client, answer: LeaseReply | None = None, channel: Channel = s.LEASE_RELEASE
) -> list[ReleaseLease | RenewLease]:
    """Answer the tenant's releases (or renewals, with ``channel``) with ``answer`` (default:
    ok); the commands answered."""
    received: list[ReleaseLease | RenewLease] = []

    async def on_command(msg: Msg) -> None:
        command: ReleaseLease | RenewLease = (
            msgspec.json.decode(msg.data, type=RenewLease)
            if channel is s.LEASE_RENEW
            else msgspec.json.decode(msg.data, type=ReleaseLease)
        )
        received.append(command)
        await msg.respond(encode(answer or LeaseReply(ok=True, lease_id=command.lease_id)))

    await service.subscribe(channel.subject(tenant="acme"), cb=on_command)
    await round_trip(service)  # the server has the subscription
    return received


async def _granted(service: Client, client: XpupoolClient, *grants: AllocationGranted) -> None:
    """The tenant's copies of ``grants``, seen by ``client``."""
    seen = [client.expect(grant.job_id) for grant in grants]
    for grant in grants:
        await service.publish(s.TENANT_ALLOC_GRANTED.subject(tenant="acme"), encode(grant))
    await service.flush()
    await asyncio.wait_for(asyncio.gather(*seen), 5)


async def test_a_replayed_release_reaches_the_service_after_a_release(
    nats_server: NatsServer, service: Client
) -> None:
    """The secret outlives the release: a replay is the service's to refuse (``lease_ended``)."""
    grant = _grant("j-4")
    answers = [
        LeaseReply(ok=True, lease_id=grant.lease_id),
        LeaseReply(ok=False, lease_id=grant.lease_id, error=LeaseError.LEASE_ENDED),
    ]
    released: list[ReleaseLease] = []

    async def release(msg: Msg) -> None:
        released.append(msgspec.json.decode(msg.data, type=ReleaseLease))
        await msg.respond(encode(answers[len(released) - 1]))

    await service.subscribe(s.LEASE_RELEASE.subject(tenant="acme"), cb=release)
    await round_trip(service)  # the server has the subscription
    async with connected(nats_server.url, "acme") as client:
        await _granted(service, client, grant)
        assert (await client.release(grant.lease_id, grant.fencing_token)).ok
        replay = await client.release(grant.lease_id, grant.fencing_token)
        assert replay.error is LeaseError.LEASE_ENDED
    assert [r.lease_secret for r in released] == [grant.lease_secret] * 2


async def test_a_lease_s_end_event_keeps_its_secret_for_the_service_to_answer(
    nats_server: NatsServer, service: Client
) -> None:
    """A holder that renews after its lease ended (preempted, cancelled) hears ``lease_ended``
    from the service, not a local error about a secret."""
    grant = _grant("j-7")
    renewals = await _serve_releases(
        service, LeaseReply(ok=False, lease_id="", error=LeaseError.LEASE_ENDED), s.LEASE_RENEW
    )
    async with connected(nats_server.url, "acme") as client:
        await _granted(service, client, grant)
        ended = asyncio.get_running_loop().create_future()
        client.listen(lambda event: ended.set_result(event) if not ended.done() else None)
        end = LeaseEnded(
            job_id=grant.job_id,
            lease_id=grant.lease_id,
            tenant="acme",
            reason=EndReason.PREEMPTED,
            fencing_token=grant.fencing_token,
            ended_at=datetime.now(UTC),
        )
        await service.publish(
            s.TENANT_ALLOC_ENDED.subject(tenant="acme", reason=end.reason), encode(end)
        )
        await service.flush()
        await asyncio.wait_for(ended, 5)
        refused = await client.renew(grant.lease_id, grant.fencing_token)
        assert refused.error is LeaseError.LEASE_ENDED
    assert [r.lease_secret for r in renewals] == [grant.lease_secret]


async def test_a_client_keeps_at_most_its_bound_of_secrets_the_oldest_out(
    nats_server: NatsServer, service: Client
) -> None:
    first, second, third = _grant("j-8"), _grant("j-9"), _grant("j-10")
    released = await _serve_releases(service)
    nc = await nats.connect(nats_server.url)
    try:
        client = XpupoolClient(nc, "acme", known_secrets=2)
        await client.start()
        await _granted(service, client, first, second, third)
        with pytest.raises(ValueError, match="no lease secret known"):
            await client.release(first.lease_id, first.fencing_token)
        assert (await client.release(second.lease_id, second.fencing_token)).ok
        assert (await client.release(third.lease_id, third.fencing_token)).ok
    finally:
        await nc.close()
    assert [r.lease_id for r in released] == [second.lease_id, third.lease_id]
