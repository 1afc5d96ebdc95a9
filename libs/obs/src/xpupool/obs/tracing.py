"""OpenTelemetry tracer provider: OTLP when an endpoint is configured, otherwise spans stay local.

Span names follow the messaging semantic conventions: ``send <subject-template>`` and
``process <subject-template>`` (see libs/bus).
"""

from __future__ import annotations

import os

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor


def configure_tracing(service: str) -> TracerProvider:
    """Install a tracer provider for ``service``; the caller shuts it down on exit.

    Spans are exported over OTLP/HTTP only when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set, so a dev
    run without a collector costs nothing but context propagation.
    """
    resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME", service)})
    provider = TracerProvider(resource=resource)
    if os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    return provider


def current_trace_id() -> str | None:
    """The current trace id as 32 hex digits, or None outside a span."""
    context = trace.get_current_span().get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else None
