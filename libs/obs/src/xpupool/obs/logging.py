"""structlog configured once: context variables first, JSON off a terminal, console on one."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog
from opentelemetry import trace


def _add_trace_ids(
    _: Any, __: str, event_dict: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    """Put the current span's trace and span id on every line, so logs join traces."""
    context = trace.get_current_span().get_span_context()
    if context.is_valid:
        event_dict["trace_id"] = format(context.trace_id, "032x")
        event_dict["span_id"] = format(context.span_id, "016x")
    return event_dict


def configure_logging(service: str, level: str = "info", json: bool | None = None) -> None:
    """Configure structlog for one process; ``json`` defaults to "stderr is not a terminal"."""
    render_json = (not sys.stderr.isatty()) if json is None else json
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if render_json
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_trace_ids,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(service=service)


def get_logger(name: str | None = None) -> Any:
    """A structlog logger; event names are constant snake_case strings, data goes in key/values."""
    return structlog.get_logger(name)


def bind_message_context(**context: Any) -> None:
    """Replace the per-message context (subject, event type, job, lease, device …).

    The service name bound at start-up stays; everything else from the previous message goes.
    """
    service = structlog.contextvars.get_contextvars().get("service")
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(
        service=service, **{k: v for k, v in context.items() if v is not None}
    )
