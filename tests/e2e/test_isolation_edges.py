"""Tenant isolation at its edges, on the secure configuration: what a tenant holding only its own
NKey can make a *service* do for it. A request's reply subject is the requester's to choose and
NATS checks only the subject it is published on, so a service that answers a request publishes,
with its own (wider) permissions, wherever the requester asked.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from tests.conftest import eventually
from tests.e2e.conftest import Ready
from xpupool.bus import round_trip
from xpupool.contracts import AllocationGranted, JobRequested
from xpupool.contracts import subjects as s
from xpupool.devstack.stack import NodeSpec, Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

QUIET_S = 0.5  # how long an observer waits for a message that must not come


@pytest.fixture
def secure_stack(tmp_path: Path) -> Iterator[Stack]:
    """A secure stack (TLS, NKeys, Redis ACLs) with tenants alice and mallory."""
    stack = Stack(
        nodes=[NodeSpec("node-a", "2xA100-80GB")],
        secure=True,
        tenants=["alice", "mallory"],
        workdir=tmp_path / "stack",
    )
    stack.workdir.mkdir(parents=True, exist_ok=True)
    stack.start()
    yield stack
    stack.stop()


async def _answered(nc: Client, subject: str) -> None:
    """A request of ``nc``'s own on ``subject`` is answered: the service is serving it, and has
    taken the requests sent before this one off the connection."""

    async def answer() -> bool:
        try:
            await nc.request(subject, b"{}", timeout=2)
        except Exception:  # noqa: BLE001  (not serving yet: what we wait out)
            return False
        return True

    await eventually(answer)


async def _stored(operator: Client, stream: s.Stream) -> int:
    return (await operator.jetstream().stream_info(stream.name)).state.messages


async def _with_alices_grant(stack: Stack, ready: Ready) -> AllocationGranted:
    """Alice holds a lease: her grant (with its secret) is stored in XPUPOOL_TENANT_EVENTS, its
    operator copy in XPUPOOL_EVENTS."""
    await ready(stack, 2)
    async with stack.client("alice") as alice:
        outcome = await alice.submit_and_wait(JobRequested(job_id="alice-1"), timeout_s=20)
    assert isinstance(outcome, AllocationGranted), outcome
    return outcome


async def test_a_reply_subject_cannot_make_a_service_purge_a_stream(
    secure_stack: Stack, ready: Ready
) -> None:
    """Mallory asks for her own job and lease lists with the reply subject set to the JetStream
    API's purge of the event streams: the scheduler and the lease-manager (whose identities may
    use the JetStream API) would publish their answer there, and the server would purge every
    tenant's events. The streams keep every message; Mallory's ordinary requests are still
    answered."""
    await _with_alices_grant(secure_stack, ready)
    operator = await secure_stack.connect_operator()
    mallory = await secure_stack.connect_tenant("mallory")
    try:
        streams = (s.TENANT_EVENTS_STREAM, s.EVENTS_STREAM)

        async def stored() -> dict[str, int] | None:
            counts = {stream.name: await _stored(operator, stream) for stream in streams}
            return counts if all(counts.values()) else None

        # Something to lose: the grant's events, published a turn after its reply.
        before = await eventually(stored)
        assert before is not None
        for request in (s.JOB_LIST, s.LEASE_LIST):
            subject = request.subject(tenant="mallory")
            await _answered(mallory, subject)
            for stream in streams:
                await mallory.publish(subject, b"{}", reply=f"$JS.API.STREAM.PURGE.{stream.name}")
            await _answered(mallory, subject)
        await asyncio.sleep(QUIET_S)
        after = {stream.name: await _stored(operator, stream) for stream in streams}
        assert all(after[name] >= count for name, count in before.items()), (before, after)
    finally:
        await mallory.close()
        await operator.close()


async def test_a_reply_subject_cannot_put_a_message_on_another_tenants_events(
    secure_stack: Stack, ready: Ready
) -> None:
    """Mallory asks for her own lists with the reply subject set to Alice's event subjects and
    to the operator copies: the services may publish there (their events go there), so the
    answer to Mallory would reach Alice's subscribers and her stored events. Nothing arrives
    on any of them."""
    await _with_alices_grant(secure_stack, ready)
    operator = await secure_stack.connect_operator()
    mallory = await secure_stack.connect_tenant("mallory")
    seen: list[Msg] = []

    async def keep(msg: Msg) -> None:
        seen.append(msg)

    try:
        for watched in (f"{s.TENANT_SPACE}.alice.events.>", "xpupool.jobs.v1.>"):
            await operator.subscribe(watched, cb=keep)
        await round_trip(operator)
        targets = (
            (
                s.JOB_LIST,
                (s.TENANT_JOB_REJECTED.subject(tenant="alice"), s.JOB_PENDING.address),
            ),
            (
                s.LEASE_LIST,
                (
                    s.TENANT_ALLOC_GRANTED.subject(tenant="alice"),
                    s.TENANT_ALLOC_ENDED.subject(tenant="alice", reason="expired"),
                ),
            ),
        )
        for request, replies in targets:
            subject = request.subject(tenant="mallory")
            await _answered(mallory, subject)
            for reply in replies:
                await mallory.publish(subject, b"{}", reply=reply)
            await _answered(mallory, subject)
        await asyncio.sleep(QUIET_S)
        assert [m.subject for m in seen] == []
    finally:
        await mallory.close()
        await operator.close()


async def test_another_tenants_message_id_cannot_have_a_request_dropped(
    secure_stack: Stack, ready: Ready
) -> None:
    """Mallory publishes a job of her own under the ``Nats-Msg-Id`` Alice's next job will use
    (the header is the sender's to set; clients set it to the job id). With the stream's
    deduplication as the idempotency key (a 10 s window), Alice's request, published a moment
    later, was dropped by the stream as a duplicate and never answered. The ledger's job record is
    the key now: Alice's job is granted, Mallory's is hers."""
    await ready(secure_stack, 2)
    mallory = await secure_stack.connect_tenant("mallory")
    try:
        payload = msgspec.json.encode(JobRequested(job_id="mallory-1", tenant="mallory"))
        ack = await mallory.jetstream().publish(
            s.JOB_REQUESTED.subject(tenant="mallory"),
            payload,
            headers={"Nats-Msg-Id": "alice-next"},
        )
        assert not ack.duplicate
        await asyncio.sleep(0.2)  # past the stream's window (100 ms), well inside the old 10 s
        async with secure_stack.client("alice") as alice:
            outcome = await alice.submit_and_wait(
                JobRequested(job_id="alice-next"), timeout_s=20, by_request=False
            )
        assert isinstance(outcome, AllocationGranted) and outcome.tenant == "alice", outcome
    finally:
        await mallory.close()
