"""The Python client's request/reply against a real nats-server: a command that found no
service subscribed (one restarting, or not up yet) is sent again until the deadline; one that
may have reached a service is never sent twice."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from xpupool.client import XpupoolClient, connected
from xpupool.contracts import LeaseReply, encode
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
