"""Publishing events: subject from the registry, CloudEvents headers, trace context, dedup id."""

from __future__ import annotations

from collections.abc import Iterable

import msgspec
from nats.aio.client import Client
from nats.js import JetStreamContext
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind

from xpupool.bus.envelope import ce_headers
from xpupool.contracts import encode
from xpupool.contracts.subjects import channel_of, dedup_id, subject_of

PUBLISH_TIMEOUT_S = 5.0


class Publisher:
    """Publishes payload Structs where the subject registry says they go.

    Events on a JetStream subject are published with an acknowledgement (and a deterministic
    ``Nats-Msg-Id`` where the transition is once-only); the rest go over core NATS.
    """

    def __init__(self, nc: Client, js: JetStreamContext, source: str) -> None:
        self._nc = nc
        self._js = js
        self._source = source
        self._tracer = trace.get_tracer("xpupool.bus")

    async def publish(self, event: msgspec.Struct, event_id: str | None = None) -> None:
        """Publish one event; returns once JetStream has stored it (or core NATS has it queued)."""
        channel = channel_of(event)
        subject = subject_of(event)
        headers = ce_headers(type(event), self._source, event_id or dedup_id(event))
        with self._tracer.start_as_current_span(
            f"send {channel.address}",
            kind=SpanKind.PRODUCER,
            attributes={
                "messaging.system": "nats",
                "messaging.operation.name": "send",
                "messaging.operation.type": "send",
                "messaging.destination.name": subject,
                "messaging.message.id": headers["ce-id"],
            },
        ):
            propagate.inject(headers)
            data = encode(event)
            if channel.stream is not None:
                await self._js.publish(subject, data, headers=headers, timeout=PUBLISH_TIMEOUT_S)
            else:
                await self._nc.publish(subject, data, headers=headers)

    async def publish_all(self, events: Iterable[msgspec.Struct]) -> None:
        """Publish events in order."""
        for event in events:
            await self.publish(event)
