"""Publishing events: subject from the registry, CloudEvents headers, trace context, dedup id.

Nothing larger than the server's ``max_payload`` is ever handed to the connection: the server
answers such a message with ``-ERR 'Maximum Payload Violation'`` and closes the connection, and
nats-py does not reconnect after that (it checks only the payload against the limit, never the
headers). ``MessageTooLarge`` is raised instead, before anything is sent.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable, Mapping, Sequence
from typing import Any

import msgspec
from nats.aio.client import Client
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind

from xpupool.bus.acks import JetStreamAcks
from xpupool.bus.envelope import ce_headers
from xpupool.bus.semconv import producer_attributes
from xpupool.contracts import encode
from xpupool.contracts.subjects import Channel, dedup_id, deliveries
from xpupool.obs import get_logger, start_current_span

PUBLISH_TIMEOUT_S = 5.0

# How nats-py frames a header block: "NATS/1.0\r\n", one "key: value\r\n" per header, "\r\n".
_HEADER_FRAME = len(b"NATS/1.0\r\n\r\n")
_HEADER_LINE_OVERHEAD = len(b": \r\n")


class MessageTooLarge(ValueError):
    """A message (payload plus headers) larger than the server's ``max_payload``; not sent."""

    def __init__(self, subject: str, size: int, limit: int) -> None:
        super().__init__(f"message to {subject!r} is {size} bytes, server max_payload {limit}")
        self.subject = subject
        self.size = size
        self.limit = limit


def encoded_size(data: bytes, headers: Mapping[str, str] | None) -> int:
    """The bytes the server counts against ``max_payload``: payload plus header block."""
    if not headers:
        return len(data)
    size = len(data) + _HEADER_FRAME
    for key, value in headers.items():
        name = key.strip()
        if name:
            text = value.strip()
            size += _utf8_len(name) + _utf8_len(text) + _HEADER_LINE_OVERHEAD
    return size


def _utf8_len(text: str) -> int:
    # The headers an event carries are ASCII (CloudEvents attributes, W3C trace context), whose
    # UTF-8 length is their length: no copy to count them.
    return len(text) if text.isascii() else len(text.encode())


def check_size(nc: Client, subject: str, data: bytes, headers: Mapping[str, str] | None) -> None:
    """Raise ``MessageTooLarge`` if the server would refuse (and disconnect over) this message."""
    size = encoded_size(data, headers)
    if size > nc.max_payload:
        raise MessageTooLarge(subject, size, nc.max_payload)


Ack = Awaitable[Any]


async def await_acks(acks: Sequence[Ack], timeout_s: float = PUBLISH_TIMEOUT_S) -> None:
    """Wait until JetStream has stored every message whose acknowledgement is pending; raises
    the first failure, or ``TimeoutError`` when one did not come within ``timeout_s`` (what is
    still pending is cancelled, which frees its slot in the connection's window)."""
    if acks:
        await asyncio.wait_for(asyncio.gather(*acks), timeout_s)


class Publisher:
    """Publishes payload Structs where the subject registry says they go.

    Events on a JetStream subject are published with an acknowledgement (and a deterministic
    ``Nats-Msg-Id`` where the transition is once-only); the rest go over core NATS. ``send``
    hands events to the connection without waiting for JetStream, so a batch of events costs
    one round trip rather than one each; ``publish`` and ``publish_all`` wait for the
    acknowledgements before they return.
    """

    def __init__(self, nc: Client, source: str) -> None:
        self._nc = nc
        self._acks = JetStreamAcks(nc)
        self._source = source
        self._tracer = trace.get_tracer("xpupool.bus")
        self._log = get_logger()

    @property
    def nc(self) -> Client:
        """The connection events (and replies) go out on."""
        return self._nc

    @property
    def source(self) -> str:
        """The CloudEvents ``source`` of everything this publisher sends."""
        return self._source

    async def publish(self, event: msgspec.Struct, event_id: str | None = None) -> None:
        """Publish one event everywhere it goes (``subjects.deliveries``): its channel and, for a
        tenant's event, the tenant's own copy (the operator copy without secrets); returns once
        JetStream has stored them (or core NATS has them queued).

        Raises ``MessageTooLarge`` (and sends nothing more) if one would exceed ``max_payload``.
        """
        await await_acks(await self.send(event, event_id))

    async def send(self, event: msgspec.Struct, event_id: str | None = None) -> list[Ack]:
        """Hand one event (every delivery of it) to the connection, in order, and return the
        JetStream acknowledgements still to come: the caller awaits them (``await_acks``)
        before it treats the event as stored."""
        acks: list[Ack] = []
        for channel, subject, copy in deliveries(event):
            ack = await self.send_to(channel, subject, copy, event_id)
            if ack is not None:
                acks.append(ack)
        return acks

    async def publish_to(
        self,
        channel: Channel,
        subject: str,
        event: msgspec.Struct,
        event_id: str | None = None,
    ) -> None:
        """Publish ``event`` on a concrete ``subject`` of ``channel`` (``publish`` looks both up
        in the registry)."""
        ack = await self.send_to(channel, subject, event, event_id)
        if ack is not None:
            await await_acks([ack])

    async def send_to(
        self,
        channel: Channel,
        subject: str,
        event: msgspec.Struct,
        event_id: str | None = None,
    ) -> Ack | None:
        """Send ``event`` on ``subject`` of ``channel``; the pending JetStream acknowledgement,
        or None for core NATS."""
        headers = ce_headers(type(event), self._source, event_id or dedup_id(event))
        with start_current_span(
            self._tracer,
            f"send {channel.address}",
            kind=SpanKind.PRODUCER,
            attributes=lambda: producer_attributes(channel.address, subject, headers),
        ) as span:
            propagate.inject(headers)
            data = encode(event)
            span.set_attribute("messaging.message.body.size", len(data))
            try:
                check_size(self._nc, subject, data, headers)
            except MessageTooLarge as error:
                self._log.error(
                    "event_too_large",
                    subject=subject,
                    event_type=type(event).__name__,
                    size=error.size,
                    limit=error.limit,
                )
                raise
            if channel.stream is None:
                await self._nc.publish(subject, data, headers=headers)
                return None
            return await self._acks.publish(subject, data, headers)

    async def publish_all(self, events: Iterable[msgspec.Struct]) -> None:
        """Publish events in order (sent back to back, then every acknowledgement awaited)."""
        acks: list[Ack] = []
        for event in events:
            acks += await self.send(event)
        await await_acks(acks)
