"""Connections the ledger keeps for its script round trips, written to and read directly.

redis-py's pipeline takes a connection from the pool under the pool's lock, probes it for
unread data with a non-blocking read, builds a command stack, runs it under its retry wrapper
and its own metrics, and hands the connection back under the lock again: 40-70 µs of client
CPU per round trip on the 2-core machine (``bench/e2e/PROFILE.md``), on every admission,
release, renewal and heartbeat, whose server side takes tens of µs. The ledger's script calls
go out instead on a few connections it keeps checked out of the same pool: packed, written and
their replies read, nothing else.

What the pool's path gave is kept:

- a connection that fails in flight (dropped, timed out, or its caller cancelled with replies
  unread) is disconnected and handed back to the pool, never used again with a reply pending;
- the client's socket timeout bounds each round trip as a whole (redis-py bounds each write
  and each read by it, the write with a task of its own, 30 µs of client CPU and a loop turn
  per round trip on the 2-core machine); a connection handed back bounds its own again;
- after a dropped or timed-out connection the round trip is made again through redis-py's
  pipeline and its retry policy: the same at-least-once sending as redis-py's own retries gave
  before (a script whose reply was lost may run again, and answers as it would to a caller
  that sent it twice);
- while Redis calls are traced (the instrumentation wraps redis-py's pipeline), the pipeline
  is used, so that every script call keeps its span;
- the connections are the pool's, checked out: closing the client (``Redis.aclose``)
  disconnects them with the rest.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from typing import Any

from redis import exceptions as redis_errors
from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection

from xpupool.obs.tracing import spans_recorded

__all__ = ["HELD_CONNECTIONS", "HeldConnections", "raise_first_error"]

#: Connections kept between round trips; a burst of concurrent callers beyond it checks more
#: out and hands the extra back once done. The services make a few concurrent ledger calls at
#: most (an admission batch, a follower's read, a periodic sweep).
HELD_CONNECTIONS = 4

Command = tuple[Any, ...]


class HeldConnections:
    """Pipelined round trips on connections checked out of ``redis``'s pool and kept."""

    def __init__(
        self,
        redis: Redis,
        keep: int = HELD_CONNECTIONS,
        traced: Callable[[], bool] = spans_recorded,
    ) -> None:
        self._redis = redis
        # Never more than a quarter of a bounded pool (redis-py's default bound is 100): the
        # client's other commands and the change feed's subscription take theirs from it too.
        self._keep = min(keep, redis.connection_pool.max_connections // 4)
        self._traced = traced
        self._idle: list[AbstractConnection] = []
        # On Python 3.11 redis-py's bound on a write is a task of its own (``asyncio.wait_for``)
        # and each read's a timer: held connections drop theirs for one per round trip.
        timeout = redis.connection_pool.connection_kwargs.get("socket_timeout")
        self._round_trip_timeout: float | None = timeout

    async def execute(self, commands: Sequence[Command]) -> list[Any]:
        """Send ``commands`` in one write and read their replies in order, as Redis gives them
        (no redis-py response callbacks, whichever path the round trip takes); an error reply
        is its exception in the list, as redis-py's pipeline gives it with ``raise_on_error``
        off."""
        if self._traced():
            return await self._through_pipeline(commands)
        pool = self._redis.connection_pool
        if self._idle:
            connection = self._idle.pop()
        else:
            connection = await pool.get_connection()  # type: ignore[no-untyped-call]
            connection.socket_timeout = None
        try:
            async with asyncio.timeout(self._round_trip_timeout):
                await connection.send_packed_command(connection.pack_commands(commands))
                replies: list[Any] = []
                for _ in commands:
                    try:
                        replies.append(await connection.read_response())
                    except redis_errors.ResponseError as refusal:
                        replies.append(refusal)
        # The round trip's own bound is a TimeoutError, an OSError.
        except (redis_errors.ConnectionError, redis_errors.TimeoutError, OSError):
            await self._discard(connection)
            return await self._through_pipeline(commands)
        except BaseException:
            # Cancelled or broken with replies possibly unread: the connection is not reused.
            await self._discard(connection)
            raise
        if len(self._idle) < self._keep:
            self._idle.append(connection)
        else:
            await self._hand_back(connection)
        return replies

    async def _discard(self, connection: AbstractConnection) -> None:
        await connection.disconnect()
        await self._hand_back(connection)

    async def _hand_back(self, connection: AbstractConnection) -> None:
        """Back to the pool, bounded per write and read again as the pool's others are."""
        connection.socket_timeout = self._round_trip_timeout
        await self._redis.connection_pool.release(connection)

    async def _through_pipeline(self, commands: Sequence[Command]) -> list[Any]:
        async with self._redis.pipeline(transaction=False) as pipe:
            # Redis's own replies, as the held path reads them (an XRANGE entry's fields stay
            # a flat list): this pipeline's, not the client's, callbacks are dropped.
            pipe.response_callbacks = {}
            for command in commands:
                pipe.execute_command(*command)
            return list(await pipe.execute(raise_on_error=False))


def raise_first_error(replies: Sequence[Any]) -> list[Any]:
    """``replies`` as they are, or the first error reply among them raised."""
    for reply in replies:
        if isinstance(reply, Exception):
            raise reply
    return list(replies)
