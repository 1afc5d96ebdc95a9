"""JetStream acknowledgements on the publisher's own inbox (``JetStreamAcks``), on a real
nats-server: stored, a duplicate, refusals, cancellation and the bound on pending ones."""

from __future__ import annotations

import asyncio

import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.errors import APIError, BadRequestError, NoStreamResponseError

from tests.conftest import eventually
from xpupool.bus.acks import JetStreamAcks
from xpupool.contracts import subjects

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]

# A subject of the jobs stream (declared by the ``nc`` fixture).
STORED = subjects.JOB_REQUESTED.subject(tenant="acks")


async def _stream_messages(nc: Client) -> int:
    info = await nc.jetstream().stream_info(subjects.JOBS_STREAM.name)
    return int(info.state.messages)


async def test_a_stored_message_and_its_duplicate_settle_without_error(nc: Client) -> None:
    acks = JetStreamAcks(nc)
    first = await acks.publish(STORED, b"{}", {"Nats-Msg-Id": "once"})
    again = await acks.publish(STORED, b"{}", {"Nats-Msg-Id": "once"})
    await asyncio.wait_for(asyncio.gather(first, again), 5)
    assert first.exception() is None and again.exception() is None
    assert await _stream_messages(nc) == 1
    assert acks.pending == 0


async def test_a_subject_no_stream_holds_fails_at_once(nc: Client) -> None:
    """No stream listens: the server's 503 status fails the future (not a timeout)."""
    acks = JetStreamAcks(nc)
    future = await acks.publish("no.stream.here", b"{}")
    with pytest.raises(NoStreamResponseError):
        await asyncio.wait_for(future, 5)


async def test_jetstream_refusing_a_message_fails_with_its_error(nc: Client) -> None:
    """A stored-message check that fails (the expected stream is another) comes back as
    JetStream's error, as its own type; nats-py's ``publish_async`` raises it inside its
    callback and leaves the future pending until its caller's timeout."""
    acks = JetStreamAcks(nc)
    future = await acks.publish(STORED, b"{}", {"Nats-Expected-Stream": "ANOTHER"})
    with pytest.raises(BadRequestError) as refused:
        await asyncio.wait_for(future, 5)
    assert isinstance(refused.value, APIError)
    assert refused.value.err_code == 10060  # expected stream does not match
    assert await _stream_messages(nc) == 0


async def test_a_cancelled_acknowledgement_is_forgotten(nc: Client) -> None:
    acks = JetStreamAcks(nc)
    future = await acks.publish(STORED, b"{}")
    future.cancel()
    await asyncio.sleep(0)  # a future's done callbacks run on the loop's next turn
    assert acks.pending == 0
    # The late acknowledgement finds nothing to settle, and publishing goes on.
    later = await acks.publish(STORED, b"{}")
    await asyncio.wait_for(later, 5)
    assert later.exception() is None


async def test_publishing_waits_while_the_most_acknowledgements_are_pending(nc: Client) -> None:
    """At ``max_pending`` awaited acknowledgements, a publish waits for one to come back."""
    acks = JetStreamAcks(nc, max_pending=2)
    held: list[Msg] = []
    settle = acks._on_ack  # noqa: SLF001  (acknowledgements held back, then let through)

    async def hold(msg: Msg) -> None:
        held.append(msg)

    acks._on_ack = hold  # type: ignore[method-assign]  # noqa: SLF001
    first = await acks.publish(STORED, b"1")
    second = await acks.publish(STORED, b"2")
    third_published = asyncio.ensure_future(acks.publish(STORED, b"3"))
    await eventually(lambda: len(held) == 2)
    assert not third_published.done()
    assert acks.pending == 2
    await settle(held.pop(0))
    third = await asyncio.wait_for(third_published, 5)
    await eventually(lambda: len(held) == 2)  # the second's and the third's
    for msg in held:
        await settle(msg)
    await asyncio.wait_for(asyncio.gather(first, second, third), 5)
    assert all(f.exception() is None for f in (first, second, third))
    assert acks.pending == 0


async def test_an_unreadable_acknowledgement_does_not_count_as_stored(nc: Client) -> None:
    """Bytes that name an error but are no acknowledgement fail the future: the message is not
    known to be stored (it is neither taken for stored nor left to time out)."""
    acks = JetStreamAcks(nc)
    held: list[Msg] = []
    settle = acks._on_ack  # noqa: SLF001

    async def hold(msg: Msg) -> None:
        held.append(msg)

    acks._on_ack = hold  # type: ignore[method-assign]  # noqa: SLF001
    future = await acks.publish(STORED, b"{}")
    await eventually(lambda: held)
    await settle(Msg(nc, subject=held[0].subject, data=b'{"error": cut sh'))
    with pytest.raises(APIError, match="unreadable acknowledgement"):
        await asyncio.wait_for(future, 5)
