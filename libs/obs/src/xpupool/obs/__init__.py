"""Logging and tracing set-up shared by every xpupool service."""

from xpupool.obs.logging import bind_message_context, configure_logging, get_logger
from xpupool.obs.settings import load_settings
from xpupool.obs.tracing import configure_tracing, current_trace_id

__all__ = [
    "bind_message_context",
    "configure_logging",
    "configure_tracing",
    "current_trace_id",
    "get_logger",
    "load_settings",
]
