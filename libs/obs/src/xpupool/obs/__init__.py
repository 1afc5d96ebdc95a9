"""Logging and tracing set-up shared by every xpupool service."""

from xpupool.obs.logging import bind_message_context, configure_logging, get_logger
from xpupool.obs.settings import load_settings
from xpupool.obs.tracing import (
    configure_tracing,
    continue_trace,
    current_trace_id,
    links_to,
    spans_exported,
    spans_recorded,
    start_current_span,
    trace_carrier,
)

__all__ = [
    "bind_message_context",
    "configure_logging",
    "configure_tracing",
    "continue_trace",
    "current_trace_id",
    "get_logger",
    "links_to",
    "load_settings",
    "spans_exported",
    "spans_recorded",
    "start_current_span",
    "trace_carrier",
]
