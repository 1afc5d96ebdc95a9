"""Span attributes of the OpenTelemetry messaging and CloudEvents semantic conventions.

Pure functions of what a message carries, so the PRODUCER span of ``send`` and the CONSUMER
span of ``process`` name the same message the same way: ``messaging.message.id`` and
``cloudevents.event_id`` are both the CloudEvents id (which is also the ``Nats-Msg-Id``).
What a received message's headers say comes from ``read_envelope``, already bounded: a sender
cannot put a megabyte into a span attribute.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final
from urllib.parse import unquote

from xpupool.bus.envelope import ATTRIBUTE_LIMIT, SPEC_VERSION, Envelope

SYSTEM: Final = "nats"

AttributeValue = str | int


def producer_attributes(
    template: str, subject: str, headers: Mapping[str, str]
) -> dict[str, AttributeValue]:
    """Attributes of the ``send <template>`` span of one message about to go out with
    ``headers`` (as made by ``ce_headers``) on the concrete ``subject``."""
    event_id = unquote(headers.get("ce-id", ""))
    attributes: dict[str, AttributeValue] = {
        "messaging.system": SYSTEM,
        "messaging.operation.name": "send",
        "messaging.operation.type": "send",
        "messaging.destination.name": subject,
        "messaging.destination.template": template,
        "messaging.message.id": event_id,
        "cloudevents.event_id": event_id,
        "cloudevents.event_source": unquote(headers.get("ce-source", "")),
        "cloudevents.event_type": headers.get("ce-type", ""),
        "cloudevents.event_spec_version": headers.get("ce-specversion", SPEC_VERSION),
    }
    return attributes


def consumer_attributes(
    template: str, subject: str, envelope: Envelope | None, body_size: int
) -> dict[str, AttributeValue]:
    """Attributes of the ``process <template>`` span of one received message; the CloudEvents
    ones only where the sender set the envelope (a bare message is still traced)."""
    attributes: dict[str, AttributeValue] = {
        "messaging.system": SYSTEM,
        "messaging.operation.name": "process",
        "messaging.operation.type": "process",
        "messaging.destination.name": subject[:ATTRIBUTE_LIMIT],
        "messaging.destination.template": template,
        "messaging.message.body.size": body_size,
    }
    if envelope is not None:
        attributes |= {
            "messaging.message.id": envelope.id,
            "cloudevents.event_id": envelope.id,
            "cloudevents.event_source": envelope.source,
            "cloudevents.event_type": envelope.type,
            "cloudevents.event_spec_version": SPEC_VERSION,
        }
    return attributes


__all__ = ["SYSTEM", "consumer_attributes", "producer_attributes"]
