"""A thin, typed adapter over nats-py: connect, declare streams, publish events, run handlers."""

from xpupool.bus.connection import BusSettings, connect, ensure_streams, round_trip
from xpupool.bus.consumer import (
    INVALID_REQUEST,
    MAX_MESSAGE_BYTES,
    PAYLOAD_TOO_LARGE,
    DispatchStats,
    EarlyReply,
    GiveUpHandler,
    Handler,
    InvalidHandler,
    InvalidMessage,
    TooLargeReply,
    consume_stream,
    delivered_message,
    early_reply,
    serve_subject,
)
from xpupool.bus.envelope import Envelope, ce_headers
from xpupool.bus.lifecycle import BusClosed, freeze_heap, supervise, watch_bus
from xpupool.bus.publisher import MessageTooLarge, Publisher
from xpupool.bus.ratelimit import TenantRateLimit

__all__ = [
    "INVALID_REQUEST",
    "MAX_MESSAGE_BYTES",
    "PAYLOAD_TOO_LARGE",
    "BusClosed",
    "freeze_heap",
    "BusSettings",
    "DispatchStats",
    "EarlyReply",
    "Envelope",
    "GiveUpHandler",
    "Handler",
    "InvalidHandler",
    "InvalidMessage",
    "MessageTooLarge",
    "Publisher",
    "TenantRateLimit",
    "TooLargeReply",
    "ce_headers",
    "connect",
    "consume_stream",
    "delivered_message",
    "early_reply",
    "ensure_streams",
    "round_trip",
    "serve_subject",
    "supervise",
    "watch_bus",
]
