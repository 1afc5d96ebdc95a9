"""``round_trip``: when it returns, the server has read everything sent before it.

The property is about the order of commands on the wire (a SUB before the PING whose PONG ends
the wait), which a real nats-server does not expose; a recording server that speaks the few
protocol lines nats-py needs shows it exactly. The consequence on a real server (a request right
after ``serve_subject`` is answered, never "no responders") is tested in
``tests/integration/test_bus_hardening.py``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import nats
import pytest

from xpupool.bus import round_trip


@dataclass
class RecordingServer:
    """Answers CONNECT and PING as nats-server does and records every command line it reads."""

    lines: list[str] = field(default_factory=list)
    #: How many lines had been read when each PONG was sent.
    pongs_after: list[int] = field(default_factory=list)
    port: int = 0

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        info = {"server_id": "recorder", "version": "2.10.0", "proto": 1, "headers": True}
        info |= {"max_payload": 1 << 20, "host": "127.0.0.1", "port": self.port}
        writer.write(f"INFO {json.dumps(info)}\r\n".encode())
        await writer.drain()
        while line := await reader.readline():
            text = line.decode().rstrip("\r\n")
            self.lines.append(text)
            if text == "PING":
                self.pongs_after.append(len(self.lines))
                writer.write(b"PONG\r\n")
                await writer.drain()
        writer.close()


@pytest.fixture
async def recorder() -> AsyncIterator[RecordingServer]:
    server = RecordingServer()
    listener = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    server.port = listener.sockets[0].getsockname()[1]
    async with listener:
        yield server


def _sub_line(server: RecordingServer, subject: str) -> int:
    return next(i for i, line in enumerate(server.lines) if line.startswith(f"SUB {subject} "))


async def test_a_subscription_is_on_the_server_when_round_trip_returns(
    recorder: RecordingServer,
) -> None:
    nc = await nats.connect(f"nats://127.0.0.1:{recorder.port}", allow_reconnect=False)
    try:
        await nc.subscribe("jobs.answer")
        await round_trip(nc)
        # The PONG that ended the wait answered a PING read after the SUB.
        assert recorder.pongs_after[-1] > _sub_line(recorder, "jobs.answer") + 1
    finally:
        await nc.close()


async def test_a_single_flush_can_be_answered_before_the_subscription_is_sent(
    recorder: RecordingServer,
) -> None:
    """Why ``round_trip`` exists: nats-py's own flush lets its PING overtake a queued SUB. If
    nats-py stops doing that, this test fails and ``round_trip`` can become one flush."""
    nc = await nats.connect(f"nats://127.0.0.1:{recorder.port}", allow_reconnect=False)
    try:
        await nc.subscribe("jobs.answer")
        await nc.flush()
        pongs_so_far = list(recorder.pongs_after)
        await round_trip(nc)  # let the SUB arrive before looking for it
        assert pongs_so_far[-1] <= _sub_line(recorder, "jobs.answer")
    finally:
        await nc.close()
