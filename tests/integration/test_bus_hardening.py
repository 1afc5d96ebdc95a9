"""The bus adapter under hostile input, on a real nats-server: no message silences a service.

Each test uses its own stream and channels (not the registry's), so only libs/bus is on trial.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack
from typing import Any

import msgspec
import nats
import nats.errors
import nats.js.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from tests.conftest import eventually
from xpupool.bus import (
    INVALID_REQUEST,
    PAYLOAD_TOO_LARGE,
    BusClosed,
    DispatchStats,
    InvalidMessage,
    MessageTooLarge,
    Publisher,
    consume_stream,
    early_reply,
    ensure_streams,
    serve_subject,
    supervise,
    watch_bus,
)
from xpupool.bus.lifecycle import open_bus, run_until_stopped
from xpupool.contracts import subjects
from xpupool.devstack.servers import NatsServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


class Ask(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="tests.ask.v1"):
    """A test request; unknown fields are skipped (so deep nesting reaches the decoder)."""

    name: str = ""
    count: int = 0


class Answer(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="tests.answer.v1"):
    """A test reply."""

    ok: bool
    echo: str = ""


class Echo(msgspec.Struct, frozen=True, kw_only=True, tag_field="type", tag="tests.echo.v1"):
    """A test event (what a careless ``on_invalid`` might send: the input echoed back)."""

    text: str = ""
    detail: str = ""


STREAM = subjects.Stream(
    name="TESTS_HARDENING",
    subjects=("tests.hardening.>",),
    work_queue=True,
    description="The hardening tests' requests.",
)
TENANT = {"tenant": "the sending tenant"}
ASKS = subjects.Channel(
    "tests.hardening.{tenant}.asks",
    (Ask,),
    "Asks of one tenant, on a stream.",
    sender="tests",
    receivers=("tests",),
    stream=STREAM,
    parameters=TENANT,
)
RPC = subjects.Channel(
    "tests.rpc.{tenant}.ask",
    (Ask,),
    "Asks of one tenant, request/reply.",
    sender="tests",
    receivers=("tests",),
    reply=Answer,
    parameters=TENANT,
)
ECHOES = subjects.Channel(
    "tests.echoes", (Echo,), "Echo events (core NATS).", sender="tests", receivers=("tests",)
)

ONE_MB = 1024 * 1024  # nats-server's default max_payload


class _EchoPublisher(Publisher):
    """A publisher for the test's own event type (the registry does not know it)."""

    async def publish(self, event: msgspec.Struct, event_id: str | None = None) -> None:
        await self.publish_to(ECHOES, ECHOES.address, event, event_id)


async def _connect(url: str) -> Client:
    return await nats.connect(url, reconnect_time_wait=0.2, max_reconnect_attempts=-1)


@pytest.fixture
async def service(nats_server: NatsServer) -> AsyncIterator[Client]:
    """The service side's connection, with the test stream declared."""
    nc = await _connect(nats_server.url)
    await ensure_streams(nc.jetstream(), (STREAM,))
    yield nc
    await nc.close()


@pytest.fixture
async def client(nats_server: NatsServer) -> AsyncIterator[Client]:
    """A separate connection for the sender (what the server does to it is not the point)."""
    nc = await _connect(nats_server.url)
    yield nc
    await nc.close()


def _durable(name: str) -> subjects.Durable:
    return subjects.Durable(name, ASKS, "tests")


async def _stored(nc: Client) -> int:
    info = await nc.jetstream().stream_info(STREAM.name)
    return int(info.state.messages)


async def _drained(nc: Client) -> None:
    async def empty() -> bool:
        return await _stored(nc) == 0

    await eventually(empty)


async def _received(nc: Client, subject: str) -> list[Msg]:
    seen: list[Msg] = []

    async def keep(msg: Msg) -> None:
        seen.append(msg)

    await nc.subscribe(subject, cb=keep)
    return seen


class _Recorder:
    """A handler and an on_invalid that remember what they were given."""

    def __init__(self, answer_invalid: bool = False) -> None:
        self.handled: list[tuple[Ask, str]] = []
        self.invalid: list[InvalidMessage] = []
        self.answer_invalid = answer_invalid

    async def handle(self, ask: Ask, *, tenant: str) -> Sequence[msgspec.Struct]:
        self.handled.append((ask, tenant))
        return []

    def on_invalid(self, invalid: InvalidMessage) -> Sequence[msgspec.Struct]:
        self.invalid.append(invalid)
        if not self.answer_invalid:
            return []
        # Careless on purpose: the (cut) input echoed twenty times is over max_payload.
        return [Echo(text=invalid.data.decode("utf-8", "replace") * 20, detail=invalid.detail)]


async def _start_consumer(
    nc: Client, name: str, recorder: _Recorder, stats: DispatchStats, **kwargs: Any
) -> tuple[asyncio.Task[None], asyncio.Event]:
    stop = asyncio.Event()
    task = asyncio.create_task(
        consume_stream(
            nc.jetstream(),
            _durable(name),
            recorder.handle,
            _EchoPublisher(nc, source="/tests"),
            stop,
            on_invalid=recorder.on_invalid,
            stats=stats,
            **kwargs,
        )
    )
    return task, stop


async def _raw_publish(port: int, subject: str, header_block: bytes, payload: bytes) -> None:
    """Publish with a hand-written header block over a plain TCP connection, as a
    non-conforming client could."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        await reader.readline()  # INFO
        writer.write(b'CONNECT {"verbose":false,"pedantic":false,"headers":true,"protocol":1}\r\n')
        total = len(header_block) + len(payload)
        writer.write(
            b"HPUB %s %d %d\r\n%s%s\r\nPING\r\n"
            % (subject.encode(), len(header_block), total, header_block, payload)
        )
        await writer.drain()
        assert (await reader.readline()).startswith(b"PONG")
    finally:
        writer.close()
        await writer.wait_closed()


async def _close_by_server(nc: Client) -> None:
    """Make the server close ``nc`` for good: a message whose headers push it over
    max_payload (nats-py checks only the payload) is answered with -ERR and a close."""
    await nc.publish("tests.junk", b"x", headers={"X-Pad": "p" * nc.max_payload})
    await eventually(lambda: nc.is_closed, timeout_s=10)


async def test_oversized_message_is_answered_and_the_consumer_keeps_working(
    service: Client, client: Client
) -> None:
    """A 900 KB request (plus 60 KB of headers) is not decoded: on_invalid gets it cut to the
    limit, its over-max_payload echo is not sent, and the next request is handled."""
    recorder, stats = _Recorder(answer_invalid=True), DispatchStats()
    echoes = await _received(client, ECHOES.address)
    task, stop = await _start_consumer(service, "big", recorder, stats)
    await client.jetstream().publish(
        ASKS.subject(tenant="acme"),
        json.dumps({"name": "x" * 900_000}).encode(),
        headers={"X-Pad": "p" * 60_000},  # JetStream stores at most 64 KiB of headers
    )
    await eventually(lambda: recorder.invalid)
    invalid = recorder.invalid[0]
    assert (invalid.code, invalid.field, invalid.params) == (
        PAYLOAD_TOO_LARGE,
        None,
        {"tenant": "acme"},
    )
    assert invalid.detail == "900012 bytes, limit 65536" and len(invalid.data) == 65536
    await client.jetstream().publish(ASKS.subject(tenant="acme"), b'{"name":"after"}')
    await eventually(lambda: recorder.handled)
    assert recorder.handled == [(Ask(name="after"), "acme")]
    assert not service.is_closed and echoes == []
    assert stats.invalid == {PAYLOAD_TOO_LARGE: 1} and stats.too_large == 1 and stats.handled == 1
    await _drained(client)
    stop.set()
    await task


async def test_deep_nesting_is_invalid_once_and_never_redelivered(
    service: Client, client: Client
) -> None:
    """A request nested 10,000 deep (RecursionError in msgspec) is answered once as invalid,
    acknowledged, never retried as a handler failure."""
    recorder, stats = _Recorder(), DispatchStats()
    task, stop = await _start_consumer(service, "deep", recorder, stats)
    nested = b'{"name":"deep","junk":' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    await client.jetstream().publish(ASKS.subject(tenant="acme"), nested)
    await eventually(lambda: recorder.invalid)
    await asyncio.sleep(1.5)  # a nak'ed first delivery would be back by now
    assert len(recorder.invalid) == 1 and recorder.handled == []
    invalid = recorder.invalid[0]
    assert (invalid.code, invalid.field, invalid.detail) == (
        INVALID_REQUEST,
        None,
        "nesting too deep",
    )
    assert stats.failed == 0 and stats.invalid_total == 1
    assert await _stored(client) == 0
    stop.set()
    await task


async def test_invalid_fields_and_tenants_are_named_and_bounded(
    service: Client, client: Client
) -> None:
    """A wrong field type names the field; a subject whose tenant token is not a tenant name is
    invalid with field "tenant"; neither reaches the handler."""
    recorder, stats = _Recorder(), DispatchStats()
    task, stop = await _start_consumer(service, "fields", recorder, stats)
    js = client.jetstream()
    await js.publish(ASKS.subject(tenant="acme"), b'{"count":"' + b"9" * 5000 + b'"}')
    await js.publish(ASKS.subject(tenant="b@d"), b'{"name":"fine"}')
    await eventually(lambda: len(recorder.invalid) == 2)
    by_field = {i.field: i for i in recorder.invalid}
    assert by_field["count"].detail == "Expected `int`, got `str`"
    assert by_field["tenant"].params == {} and by_field["tenant"].code == INVALID_REQUEST
    assert recorder.handled == [] and stats.invalid == {INVALID_REQUEST: 2}
    stop.set()
    await task


async def test_status_line_headers_do_not_hide_a_stream_message(
    service: Client, client: Client, nats_server: NatsServer
) -> None:
    """Messages stored with headers that look like NATS status lines (503, 404, 408) are
    handled like any other, not taken for the server's status replies."""
    recorder, stats = _Recorder(), DispatchStats()
    task, stop = await _start_consumer(service, "raw", recorder, stats)
    blocks = [
        b"NATS/1.0 503\r\n\r\n",
        b"NATS/1.0 404 No Messages\r\n\r\n",
        b"NATS/1.0 408 Request Timeout\r\nNats-Msg-Id: raw-3\r\n\r\n",
    ]
    for number, block in enumerate(blocks, start=1):
        payload = json.dumps({"name": f"raw-{number}"}).encode()
        await _raw_publish(nats_server.port, ASKS.subject(tenant="raw"), block, payload)
    await eventually(lambda: len(recorder.handled) == 3, timeout_s=10)
    assert sorted(a.name for a, _ in recorder.handled) == ["raw-1", "raw-2", "raw-3"]
    assert {t for _, t in recorder.handled} == {"raw"}
    await _drained(client)
    stop.set()
    await task


async def test_a_reply_never_carries_the_request_headers(service: Client, client: Client) -> None:
    """A request with a megabyte of headers is answered with the service's own CloudEvents
    headers (echoed, they plus the 120 KB answer would exceed max_payload and the server would
    close the service's connection), and the service keeps answering."""
    stats = DispatchStats()

    async def answer(ask: Ask, *, tenant: str) -> Sequence[msgspec.Struct]:
        return [Answer(ok=True, echo=f"{tenant}:{ask.name * 3}")]

    publisher = Publisher(service, source="/tests/rpc")
    await serve_subject(service, RPC, answer, publisher, queue="rpc", stats=stats)
    junk = {"X-Junk": "y" * 1_000_000}
    body = json.dumps({"name": "n" * 40_000}).encode()
    reply = await client.request(RPC.subject(tenant="acme"), body, timeout=5, headers=junk)
    headers = reply.headers or {}
    assert "X-Junk" not in headers and headers["ce-type"] == "tests.answer.v1"
    assert headers["ce-source"] == "/tests/rpc"
    assert msgspec.json.decode(reply.data, type=Answer).echo == "acme:" + "n" * 120_000
    again = await client.request(RPC.subject(tenant="acme"), b'{"name":"again"}', timeout=5)
    assert msgspec.json.decode(again.data, type=Answer).echo == "acme:againagainagain"
    assert not service.is_closed and stats.handled == 2


async def test_a_subject_is_served_as_soon_as_serve_subject_returns(
    service: Client, client: Client
) -> None:
    """A request sent from another connection right after ``serve_subject`` returns is answered,
    never "no responders" (nats-py's own flush can return before the SUB reached the server)."""

    async def answer(ask: Ask) -> Sequence[msgspec.Struct]:
        return [Answer(ok=True, echo=ask.name)]

    publisher = Publisher(service, source="/tests/rpc")
    for i in range(40):
        channel = subjects.Channel(
            f"tests.rpc.fresh{i}", (Ask,), "Fresh.", sender="t", receivers=("t",), reply=Answer
        )
        await serve_subject(service, channel, answer, publisher, queue=f"fresh{i}")
        reply = await client.request(channel.address, b'{"name":"hi"}', timeout=5)
        assert msgspec.json.decode(reply.data, type=Answer).echo == "hi"


async def test_an_early_reply_is_the_only_one_and_goes_out_before_the_handler_returns(
    service: Client, client: Client
) -> None:
    """A handler that answers through ``early_reply`` (as work batched with other requests
    does) is answered then; what it returns afterwards is not sent a second time."""
    returned = asyncio.Event()
    release = asyncio.Event()

    async def answer(ask: Ask) -> Sequence[msgspec.Struct]:
        early = early_reply()
        assert early is not None
        await early.send(Answer(ok=True, echo="early"))
        await release.wait()
        returned.set()
        return [Answer(ok=True, echo="late")]

    channel = subjects.Channel(
        "tests.rpc.early", (Ask,), "Early.", sender="t", receivers=("t",), reply=Answer
    )
    publisher = Publisher(service, source="/tests/rpc")
    await serve_subject(service, channel, answer, publisher, queue="early", concurrency=4)
    inbox = client.new_inbox()
    replies = await client.subscribe(inbox)
    await client.publish(channel.address, b'{"name":"x"}', reply=inbox)
    first = await replies.next_msg(timeout=5)
    assert msgspec.json.decode(first.data, type=Answer).echo == "early"
    assert not returned.is_set()  # answered while the handler still works
    release.set()
    await asyncio.wait_for(returned.wait(), 5)
    await client.flush()
    with pytest.raises(nats.errors.TimeoutError):
        await replies.next_msg(timeout=0.3)


def test_early_reply_is_none_outside_a_served_request() -> None:
    assert early_reply() is None


async def test_a_reply_over_max_payload_is_replaced_by_a_short_error(
    service: Client, client: Client
) -> None:
    """A reply larger than max_payload is never sent: the channel's hook builds a short reply,
    and without one the requester gets an empty body with Nats-Service-Error headers."""
    stats = DispatchStats()

    async def huge(ask: Ask, *, tenant: str) -> Sequence[msgspec.Struct]:
        return [Answer(ok=True, echo="z" * ONE_MB)]

    def too_large(reply: msgspec.Struct) -> msgspec.Struct:
        return Answer(ok=False, echo="response too large")

    publisher = Publisher(service, source="/tests")
    await serve_subject(
        service, RPC, huge, publisher, queue="hook", stats=stats, too_large_reply=too_large
    )
    hooked = await client.request(RPC.subject(tenant="a"), b"{}", timeout=5)
    assert msgspec.json.decode(hooked.data, type=Answer) == Answer(
        ok=False, echo="response too large"
    )

    plain = subjects.Channel(
        "tests.rpc.plain", (Ask,), "No hook.", sender="t", receivers=("t",), reply=Answer
    )

    async def huge_plain(ask: Ask) -> Sequence[msgspec.Struct]:
        return [Answer(ok=True, echo="z" * ONE_MB)]

    await serve_subject(service, plain, huge_plain, publisher, queue="plain", stats=stats)
    bare = await client.request(plain.address, b"{}", timeout=5)
    assert bare.data == b""
    assert bare.headers == {
        "Nats-Service-Error": "response too large",
        "Nats-Service-Error-Code": "500",
    }
    assert stats.too_large == 2 and not service.is_closed


async def test_an_event_over_max_payload_is_refused_before_it_is_sent(service: Client) -> None:
    """An event whose payload fits max_payload but whose headers push it over raises
    MessageTooLarge instead of being sent (the server would close the connection for it)."""
    publisher = _EchoPublisher(service, source="/tests")
    echoes = await _received(service, ECHOES.address)
    overhead = len(msgspec.json.encode(Echo(text="")))
    nearly = Echo(text="e" * (service.max_payload - overhead))
    assert len(msgspec.json.encode(nearly)) == service.max_payload
    with pytest.raises(MessageTooLarge, match="max_payload"):
        await publisher.publish(nearly)
    await publisher.publish(Echo(text="small"))
    await eventually(lambda: echoes)
    assert [msgspec.json.decode(m.data, type=Echo) for m in echoes] == [Echo(text="small")]
    assert not service.is_closed


async def test_a_consumer_on_a_closed_connection_raises_instead_of_living_deaf(
    service: Client, client: Client
) -> None:
    """When the server closes the connection for good, consume_stream raises BusClosed rather
    than retrying forever on a connection nats-py will never reopen."""
    recorder, stats = _Recorder(), DispatchStats()
    task, _ = await _start_consumer(service, "deaf", recorder, stats)
    await client.jetstream().publish(ASKS.subject(tenant="acme"), b'{"name":"before"}')
    await eventually(lambda: recorder.handled)
    await _close_by_server(service)
    with pytest.raises(BusClosed):
        await asyncio.wait_for(task, timeout=5)


async def test_supervise_reopens_the_bus_after_the_server_closes_it(
    nats_server: NatsServer, client: Client
) -> None:
    """A service run under supervise with watch_bus comes back on a fresh connection after the
    server closed its old one, and answers again."""
    buses: list[Client] = []

    async def answer(ask: Ask, *, tenant: str) -> Sequence[msgspec.Struct]:
        return [Answer(ok=True, echo=f"{len(buses)}:{ask.name}")]

    async def run_once(stop: asyncio.Event) -> None:
        async with AsyncExitStack() as stack:
            bus = await open_bus(stack, nats_server.url, "tests-service", "/tests/service")
            await serve_subject(bus.nc, RPC, answer, bus.publisher, queue="svc")
            await bus.nc.flush()
            buses.append(bus.nc)
            await run_until_stopped(stop, watch_bus(bus.nc, stop))

    stop = asyncio.Event()
    supervisor = asyncio.create_task(supervise(run_once, stop, backoff_s=0.1))
    await eventually(lambda: buses)
    first = await client.request(RPC.subject(tenant="a"), b'{"name":"one"}', timeout=5)
    assert msgspec.json.decode(first.data, type=Answer).echo == "1:one"
    await _close_by_server(buses[0])
    await eventually(lambda: len(buses) == 2, timeout_s=10)
    second = await client.request(RPC.subject(tenant="a"), b'{"name":"two"}', timeout=5)
    assert msgspec.json.decode(second.data, type=Answer).echo == "2:two"
    stop.set()
    await asyncio.wait_for(supervisor, timeout=5)
    assert all(nc.is_closed for nc in buses)


async def test_shutdown_is_bounded_while_the_server_is_gone(nats_server: NatsServer) -> None:
    """With nats-server gone (the client reconnecting forever), a service's loops and its bus
    still stop within a few seconds of the stop signal, without an error."""
    stop = asyncio.Event()
    recorder, stats = _Recorder(), DispatchStats()
    async with AsyncExitStack() as stack:
        bus = await open_bus(stack, nats_server.url, "tests-service", "/tests/service")
        await ensure_streams(bus.js, (STREAM,))
        runner = asyncio.create_task(
            run_until_stopped(
                stop,
                watch_bus(bus.nc, stop),
                consume_stream(
                    bus.js, _durable("gone"), recorder.handle, bus.publisher, stop, stats=stats
                ),
            )
        )
        await asyncio.sleep(0.5)
        nats_server.kill()
        await eventually(lambda: not bus.nc.is_connected, timeout_s=10)
        await asyncio.sleep(1.0)
        started = time.monotonic()
        stop.set()
        await asyncio.wait_for(runner, timeout=10)
    assert time.monotonic() - started < 3.0
    assert bus.nc.is_closed


async def test_the_consumer_resumes_after_a_server_restart(
    nats_server: NatsServer, service: Client, client: Client
) -> None:
    """A pull request lost in a server restart is replaced; a message published after the
    restart is handled."""
    recorder, stats = _Recorder(), DispatchStats()
    task, stop = await _start_consumer(service, "restart", recorder, stats)
    await client.jetstream().publish(ASKS.subject(tenant="acme"), b'{"name":"before"}')
    await eventually(lambda: recorder.handled)
    nats_server.restart()
    await eventually(lambda: service.is_connected and client.is_connected, timeout_s=15)

    async def published() -> bool:  # JetStream takes a moment to recover its streams
        try:
            await client.jetstream().publish(
                ASKS.subject(tenant="acme"), b'{"name":"after"}', timeout=1
            )
        except (nats.errors.TimeoutError, nats.js.errors.APIError):
            return False
        return True

    await eventually(published, timeout_s=15)
    await eventually(lambda: len(recorder.handled) == 2, timeout_s=15)
    assert [a.name for a, _ in recorder.handled] == ["before", "after"]
    stop.set()
    await task
