"""The ledger's held connections on a real redis-server: replies stay matched to their commands
through error replies, a cancelled caller and a dropped connection, and a traced process goes
through redis-py's (instrumented) pipeline."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from xpupool.devstack.servers import RedisServer
from xpupool.ledger.held import HeldConnections

pytestmark = [pytest.mark.integration, pytest.mark.timeout(30)]


@asynccontextmanager
async def _client(server: RedisServer, **options: Any) -> AsyncIterator[Redis]:
    client = Redis.from_url(server.url, **options)
    try:
        yield client
    finally:
        await client.aclose()


@pytest.fixture
async def redis(redis_server: RedisServer) -> AsyncIterator[Redis]:
    async with _client(redis_server) as client:
        yield client


def untraced(redis: Redis) -> HeldConnections:
    return HeldConnections(redis, traced=lambda: False)


async def test_replies_come_back_in_order_with_refusals_in_place(redis: Redis) -> None:
    held = untraced(redis)
    replies = await held.execute([("SET", "a", "x"), ("INCR", "a"), ("GET", "a")])
    assert replies[0] is True or replies[0] == b"OK"
    assert isinstance(replies[1], ResponseError)
    assert replies[2] == b"x"
    # The refusal was read off the connection: the next round trip gets its own replies.
    assert await held.execute([("ECHO", "next")]) == [b"next"]


async def test_a_cancelled_caller_leaves_no_reply_for_the_next(redis: Redis) -> None:
    held = untraced(redis)
    waiting = asyncio.create_task(held.execute([("BLPOP", "nothing-here", "0.5")]))
    await asyncio.sleep(0.1)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    # Were the cancelled caller's connection reused, this would read BLPOP's late nil.
    assert await held.execute([("ECHO", "mine")]) == [b"mine"]
    await asyncio.sleep(0.6)
    assert await held.execute([("ECHO", "still mine")]) == [b"still mine"]


async def test_a_dropped_connection_is_replaced_and_the_round_trip_made(
    redis: Redis, redis_server: RedisServer
) -> None:
    held = untraced(redis)
    assert await held.execute([("ECHO", "first")]) == [b"first"]
    admin = Redis.from_url(redis_server.url)
    try:
        killed = await admin.client_kill_filter(_type="normal", skipme=True)
        assert int(killed) >= 1
    finally:
        await admin.aclose()
    assert await held.execute([("SET", "b", "1"), ("GET", "b")]) in ([True, b"1"], [b"OK", b"1"])
    assert await held.execute([("ECHO", "again")]) == [b"again"]


async def test_a_burst_of_callers_each_gets_its_own_replies(redis: Redis) -> None:
    held = untraced(redis)
    replies = await asyncio.gather(*(held.execute([("ECHO", str(i))]) for i in range(16)))
    assert replies == [[str(i).encode()] for i in range(16)]


async def test_a_traced_process_goes_through_the_pipeline(
    redis: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipelines: list[Any] = []
    make_pipeline = redis.pipeline

    def counting(*args: Any, **kwargs: Any) -> Any:
        pipe = make_pipeline(*args, **kwargs)
        pipelines.append(pipe)
        return pipe

    monkeypatch.setattr(redis, "pipeline", counting)
    assert await HeldConnections(redis, traced=lambda: True).execute([("ECHO", "t")]) == [b"t"]
    assert len(pipelines) == 1
    assert await untraced(redis).execute([("ECHO", "u")]) == [b"u"]
    assert len(pipelines) == 1


async def test_a_small_pool_keeps_room_for_the_clients_other_commands(
    redis_server: RedisServer,
) -> None:
    async with _client(redis_server, max_connections=4) as client:
        held = HeldConnections(client, traced=lambda: False)
        replies = await asyncio.gather(*(held.execute([("ECHO", str(i))]) for i in range(3)))
        assert replies == [[b"0"], [b"1"], [b"2"]]
        # One connection kept of the four: the client's own commands still find three.
        assert await asyncio.gather(*(client.echo(str(i)) for i in range(3))) == [
            b"0",
            b"1",
            b"2",
        ]


async def test_a_round_trip_past_the_socket_timeout_fails_and_leaves_no_late_reply(
    redis_server: RedisServer,
) -> None:
    async with _client(redis_server, socket_timeout=0.2) as client:
        held = untraced(client)
        # A held round trip is bounded as a whole by the client's socket timeout; the retry
        # through redis-py's pipeline is bounded per read by it, and fails too.
        with pytest.raises((RedisTimeoutError, TimeoutError)):
            await held.execute([("BLPOP", "nothing-here", "1")])
        await asyncio.sleep(1.1)
        assert await held.execute([("ECHO", "after")]) == [b"after"]


async def test_connections_go_back_to_the_pool_with_its_socket_timeout(
    redis_server: RedisServer,
) -> None:
    async with _client(redis_server, socket_timeout=0.7) as client:
        held = untraced(client)
        replies = await asyncio.gather(*(held.execute([("ECHO", str(i))]) for i in range(12)))
        assert replies == [[str(i).encode()] for i in range(12)]
        pool = client.connection_pool
        handed_back = list(pool._available_connections)  # noqa: SLF001
        assert handed_back, "a burst beyond the kept connections hands the extra back"
        assert all(c.socket_timeout == 0.7 for c in handed_back)
        # A dropped held connection goes back the same way.
        await client.client_kill_filter(_type="normal", skipme=True)
        assert await held.execute([("ECHO", "again")]) == [b"again"]
        assert all(c.socket_timeout == 0.7 for c in pool._available_connections)  # noqa: SLF001


async def test_both_paths_give_redis_own_replies(redis: Redis) -> None:
    """A traced process's round trip through redis-py's pipeline answers as the held path does
    (no response callbacks: an XRANGE entry's fields stay Redis's flat list)."""
    entry = await redis.xadd("s", {"kind": "granted"})
    commands = [("XRANGE", "s", entry, entry), ("SET", "a", "x")]
    held = await untraced(redis).execute(commands)
    piped = await HeldConnections(redis, traced=lambda: True).execute(commands)
    assert held == piped == [[[entry, [b"kind", b"granted"]]], b"OK"]
