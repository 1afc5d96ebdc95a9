"""The outbox relay: publishes the events that ledger scripts queued in a Redis stream.

A script that changes state also XADDs an entry to its service's outbox in the same atomic step,
so an event can be late but never lost: a relay killed before publishing leaves the entry
pending, and the next relay (itself after a restart, or a peer via XAUTOCLAIM) publishes it.
Events carry deterministic ids, so a republish is deduplicated by JetStream.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
from redis.exceptions import ResponseError

from xpupool.ledger.ledger import Ledger
from xpupool.obs import get_logger

BuildEvents = Callable[[dict[str, str]], Awaitable[Sequence[msgspec.Struct]]]
Publish = Callable[[msgspec.Struct], Awaitable[None]]

GROUP = "relay"
STALE_AFTER_MS = 15_000


class OutboxRelay:
    """Relays one service's outbox stream to NATS."""

    def __init__(
        self,
        ledger: Ledger,
        service: str,
        build_events: BuildEvents,
        publish: Publish,
        consumer: str | None = None,
    ) -> None:
        self._ledger = ledger
        self._stream = ledger.key("outbox", service)
        self._build_events = build_events
        self._publish = publish
        self._consumer = consumer or f"{socket.gethostname()}-{id(self):x}"
        self._log = get_logger().bind(outbox=service)

    async def run(self, stop: asyncio.Event) -> None:
        """Relay until ``stop`` is set; transient failures are retried, never fatal."""
        redis = self._ledger.redis
        await self._ensure_group()
        backlog = True  # first drain what this consumer was given before a restart
        while not stop.is_set():
            try:
                if backlog:
                    entries = await self._claim_stale()
                    entries += await self._read("0")
                    backlog = False
                else:
                    entries = await self._read(">", block_ms=500)
                for entry_id, fields in entries:
                    for event in await self._build_events(fields):
                        await self._publish(event)
                    await redis.xack(self._stream, GROUP, entry_id)
                    await redis.xdel(self._stream, entry_id)
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001  (Redis or NATS down: retry the backlog)
                self._log.warning("outbox_relay_retrying", error=repr(error))
                backlog = True
                await asyncio.sleep(0.5)
                if "NOGROUP" in repr(error):
                    await self._ensure_group()

    async def _ensure_group(self) -> None:
        try:
            await self._ledger.redis.xgroup_create(self._stream, GROUP, id="0", mkstream=True)
        except ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise

    async def _read(
        self, start: str, block_ms: int | None = None
    ) -> list[tuple[str, dict[str, str]]]:
        reply: Any = await self._ledger.redis.xreadgroup(
            GROUP, self._consumer, {self._stream: start}, count=100, block=block_ms
        )
        return [(_s(i), _fields(f)) for _, entries in (reply or []) for i, f in entries if f]

    async def _claim_stale(self) -> list[tuple[str, dict[str, str]]]:
        reply: Any = await self._ledger.redis.xautoclaim(
            self._stream,
            GROUP,
            self._consumer,
            min_idle_time=STALE_AFTER_MS,
            start_id="0",
            count=100,
        )
        return [(_s(i), _fields(f)) for i, f in reply[1] if f]


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _fields(raw: dict[Any, Any]) -> dict[str, str]:
    return {_s(k): _s(v) for k, v in raw.items()}
