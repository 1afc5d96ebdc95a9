"""CloudEvents binary mode over NATS headers, plus W3C trace context.

The payload stays the bare JSON Struct; ``ce-*`` headers carry the envelope attributes, and
``Nats-Msg-Id`` equals ``ce-id`` so JetStream deduplicates a republished event.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from urllib.parse import quote, unquote

from xpupool.contracts import ce_type

SPEC_VERSION = "1.0"
MSG_ID_HEADER = "Nats-Msg-Id"
# A received message's headers are the sender's text: what is read back (and bound into every
# log line of the message) is cut to this many characters.
ATTRIBUTE_LIMIT = 256


@dataclass(frozen=True)
class Envelope:
    """The CloudEvents attributes read back from a received message."""

    id: str
    source: str
    type: str
    time: str | None


def ce_headers(payload_type: type, source: str, event_id: str | None = None) -> dict[str, str]:
    """Binary-mode CloudEvents headers for one event; ``event_id`` defaults to a fresh UUID."""
    identifier = event_id or str(uuid.uuid4())
    return {
        "ce-specversion": SPEC_VERSION,
        "ce-id": quote(identifier, safe=":/@-._~"),
        "ce-source": quote(source, safe=":/@-._~"),
        "ce-type": ce_type(payload_type),
        "ce-time": datetime.now(UTC).isoformat(),
        "content-type": "application/json",
        MSG_ID_HEADER: identifier,
    }


def read_envelope(headers: dict[str, str] | None) -> Envelope | None:
    """The envelope of a received message, or None when the sender set no CloudEvents headers.

    Each attribute is cut to ``ATTRIBUTE_LIMIT`` characters (a sender may put a megabyte in a
    header; it must not reach the logs or any answer).
    """
    if not headers or "ce-id" not in headers:
        return None
    time = headers.get("ce-time")
    return Envelope(
        id=_bounded(unquote(headers["ce-id"][: 3 * ATTRIBUTE_LIMIT])),
        source=_bounded(unquote(headers.get("ce-source", "")[: 3 * ATTRIBUTE_LIMIT])),
        type=_bounded(headers.get("ce-type", "")),
        time=None if time is None else _bounded(time),
    )


def _bounded(value: str) -> str:
    return value[:ATTRIBUTE_LIMIT]
