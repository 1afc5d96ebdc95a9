"""A thin, typed adapter over nats-py: connect, declare streams, publish events, run handlers."""

from xpupool.bus.connection import BusSettings, connect, ensure_streams
from xpupool.bus.consumer import Handler, InvalidHandler, consume_stream, serve_subject
from xpupool.bus.envelope import Envelope, ce_headers
from xpupool.bus.publisher import Publisher

__all__ = [
    "BusSettings",
    "Envelope",
    "Handler",
    "InvalidHandler",
    "Publisher",
    "ce_headers",
    "connect",
    "consume_stream",
    "ensure_streams",
    "serve_subject",
]
