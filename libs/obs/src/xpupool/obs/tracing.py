"""OpenTelemetry tracer provider: OTLP when an endpoint is configured, otherwise spans stay local.

Span names follow the messaging semantic conventions: ``send <subject-template>`` and
``process <subject-template>`` (see libs/bus).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.environment_variables import OTEL_PYTHON_TRACER_PROVIDER
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import Link, Span, SpanKind, Tracer
from opentelemetry.util.types import AttributeValue

#: Span attributes, or what makes them when the span records (they cost a dict per message).
Attributes = Mapping[str, AttributeValue] | Callable[[], Mapping[str, AttributeValue]] | None


def spans_exported() -> bool:
    """Whether this process exports its spans (``OTEL_EXPORTER_OTLP_ENDPOINT`` is set): a step
    that would read a trace context from the ledger only to parent a span may skip that read
    when nobody will see the span."""
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def configure_tracing(service: str) -> TracerProvider:
    """The tracer provider for ``service``; the caller shuts it down on exit.

    Spans are exported over OTLP/HTTP only when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (the
    exporter reads the other ``OTEL_*`` variables: headers, timeout, compression, and the batch
    processor ``OTEL_BSP_*``), and only then is the provider installed and are Redis calls
    instrumented. Otherwise the API's no-op provider is installed (unless
    ``OTEL_PYTHON_TRACER_PROVIDER`` names another): no span is made, and a job's trace
    context still travels on (a step continues the context it was given), so a run without a
    collector costs nothing but that propagation.
    """
    resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME", service)})
    provider = TracerProvider(resource=resource)
    if spans_exported():
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        _instrument_redis(provider)
        trace.set_tracer_provider(provider)
    elif OTEL_PYTHON_TRACER_PROVIDER not in os.environ:
        # Installed so that asking for the provider is an attribute read: while none is
        # installed, the API looks this variable up in the environment on every call (several a
        # message, 2.5 % of a lease-manager's CPU in the closed loop).
        trace.set_tracer_provider(trace.NoOpTracerProvider())
    return provider


def _instrument_redis(provider: TracerProvider) -> None:
    """Every Redis command (a ledger script is one EVALSHA) as a client span of the current
    trace; only when spans are exported, so an untraced run does not pay for the wrapping.
    The instrumentation records a command with its arguments replaced by ``?``: a lease secret
    passed to a script never reaches a span."""
    from opentelemetry.instrumentation.redis import RedisInstrumentor

    instrumentor = RedisInstrumentor()
    if not instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.instrument(tracer_provider=provider)


def spans_recorded() -> bool:
    """Whether a recording tracer provider is installed (``configure_tracing`` installs the
    SDK's only when spans are exported, and the API's no-op one otherwise; a test may install
    its own). Without one every span is the API's no-op, which only makes its parent's span
    current."""
    return not isinstance(
        trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
    )


def start_current_span(
    tracer: Tracer,
    name: str,
    *,
    context: Context | None = None,
    kind: SpanKind = SpanKind.INTERNAL,
    links: Callable[[], Sequence[Link]] | None = None,
    attributes: Attributes = None,
) -> AbstractContextManager[Span]:
    """``tracer.start_as_current_span``, with the links and attributes made only when the
    span is recorded. Without a tracer provider it only makes ``context``'s span current (the
    no-op tracer's whole effect), so a job's trace context still travels and an untraced
    service pays for no span it would throw away (several per message)."""
    if not spans_recorded():
        return _current_or(context)
    return tracer.start_as_current_span(
        name,
        context=context,
        kind=kind,
        links=links() if links is not None else None,
        attributes=attributes() if callable(attributes) else attributes,
    )


def _current_or(context: Context | None) -> AbstractContextManager[Span]:
    """What the no-op tracer's span amounts to: ``context``'s span made current, so that the
    trace it names travels on. Without a context the current span is current already, and
    attaching it again (a context switch in and out, several times a message) would change
    nothing."""
    if context is None:
        return nullcontext(trace.get_current_span())
    return trace.use_span(trace.get_current_span(context), end_on_exit=False)


def current_trace_id() -> str | None:
    """The current trace id as 32 hex digits, or None outside a span."""
    context = trace.get_current_span().get_span_context()
    return format(context.trace_id, "032x") if context.is_valid else None


def trace_carrier() -> dict[str, str]:
    """The current trace context as a W3C carrier (``traceparent``, ``tracestate``), to keep
    with a record whose later steps continue this trace; empty outside a span."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier


def continue_trace(
    name: str,
    carrier: Mapping[str, str],
    attributes: Mapping[str, AttributeValue] | None = None,
) -> AbstractContextManager[Span]:
    """A span in the trace that ``carrier`` names (a job's, kept in the ledger), as the current
    span; without a carrier, a child of the current span.

    A step of a job that someone else started (a holder's renewal with its own trace, a
    scheduling cycle serving many jobs) is a child of the job's trace and links the caller's
    span, so the job reads as one trace and the caller's stays reachable.
    """
    parent = propagate.extract(carrier) if carrier.get("traceparent") else None
    if not spans_recorded():
        return _current_or(parent)
    tracer = trace.get_tracer("xpupool.obs")
    if parent is None:
        return tracer.start_as_current_span(name, attributes=attributes)
    caller = trace.get_current_span().get_span_context()
    job = trace.get_current_span(parent).get_span_context()
    links = [Link(caller)] if caller.is_valid and caller.trace_id != job.trace_id else []
    return tracer.start_as_current_span(name, context=parent, links=links, attributes=attributes)


def links_to(carriers: list[Mapping[str, str]]) -> list[Link]:
    """Links to the traces ``carriers`` name (those without a valid context are left out): a
    span that serves many jobs at once links each job instead of joining one."""
    links = []
    for carrier in carriers:
        if carrier.get("traceparent"):
            context = trace.get_current_span(propagate.extract(carrier)).get_span_context()
            if context.is_valid:
                links.append(Link(context))
    return links
