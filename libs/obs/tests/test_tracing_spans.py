"""``start_current_span`` and ``continue_trace``: a recorded span where a tracer provider is
installed, and otherwise only the parent's trace context made current (the no-op tracer's whole
effect), without building the attributes or links nobody would record."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Link, SpanKind

from xpupool.obs import tracing
from xpupool.obs.tracing import (
    continue_trace,
    current_trace_id,
    start_current_span,
    trace_carrier,
)

JOB_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CARRIER = {"traceparent": f"00-{JOB_TRACE}-00f067aa0ba902b7-01"}


def _unwanted() -> dict[str, str]:
    raise AssertionError("built for a span that is not recorded")


@pytest.fixture
def unrecorded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracing, "spans_recorded", lambda: False)


@pytest.fixture
def recorded(
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[tuple[trace.Tracer, InMemorySpanExporter]]:
    monkeypatch.setattr(tracing, "spans_recorded", lambda: True)
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("test"), exporter
    provider.shutdown()


@pytest.mark.usefixtures("unrecorded")
def test_an_unrecorded_step_continues_the_job_trace_without_building_its_span() -> None:
    assert current_trace_id() is None
    tracer = trace.get_tracer("test")
    with start_current_span(
        tracer,
        "process",
        context=propagate.extract(CARRIER),
        kind=SpanKind.CONSUMER,
        links=lambda: [Link(trace.INVALID_SPAN_CONTEXT)] + [_unwanted()],  # type: ignore[list-item]
        attributes=_unwanted,
    ) as span:
        span.set_attribute("size", 3)  # a no-op, as on the API's no-op span
        assert current_trace_id() == JOB_TRACE
        # What the step stores or sends on carries the job's trace.
        assert JOB_TRACE in trace_carrier()["traceparent"]
        with continue_trace("decide", {}, {"a": 1}):
            assert current_trace_id() == JOB_TRACE
        # A step without a context of its own (a publish) stays in the job's trace as well.
        with start_current_span(tracer, "send", kind=SpanKind.PRODUCER, attributes=_unwanted):
            assert current_trace_id() == JOB_TRACE
            assert JOB_TRACE in trace_carrier()["traceparent"]
        assert current_trace_id() == JOB_TRACE
    assert current_trace_id() is None


@pytest.mark.usefixtures("unrecorded")
def test_an_unrecorded_continued_trace_is_the_carrier_s() -> None:
    with continue_trace("lease end", CARRIER, {"xpupool.lease_id": "l1"}):
        assert current_trace_id() == JOB_TRACE
    with continue_trace("lease end", {}, None):
        assert current_trace_id() is None
    assert current_trace_id() is None


def test_a_recorded_step_has_its_attributes_links_and_parent(
    recorded: tuple[trace.Tracer, InMemorySpanExporter],
) -> None:
    tracer, exporter = recorded
    other = trace.SpanContext(
        int("1" * 32, 16), int("2" * 16, 16), is_remote=True, trace_flags=trace.TraceFlags(1)
    )
    with start_current_span(
        tracer,
        "process",
        context=propagate.extract(CARRIER),
        kind=SpanKind.CONSUMER,
        links=lambda: [Link(other)],
        attributes=lambda: {"messaging.system": "nats"},
    ):
        assert current_trace_id() == JOB_TRACE
    (span,) = exporter.get_finished_spans()
    assert span.name == "process"
    assert span.kind is SpanKind.CONSUMER
    assert span.attributes == {"messaging.system": "nats"}
    assert [link.context for link in span.links] == [other]
    assert span.parent is not None and format(span.context.trace_id, "032x") == JOB_TRACE


# Each case runs in a process of its own: a tracer provider can be installed once per process.
_PROVIDER_PROBE = """
import json
from opentelemetry import trace
from xpupool.obs.tracing import configure_tracing, spans_recorded
configure_tracing("probe")
print(json.dumps([type(trace.get_tracer_provider()).__name__, spans_recorded()]))
"""


@pytest.mark.parametrize(
    ("environment", "provider", "recorded"),
    [
        ({}, "NoOpTracerProvider", False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:9"}, "TracerProvider", True),
        # A provider named by OpenTelemetry's own variable is still loaded, not replaced.
        ({"OTEL_PYTHON_TRACER_PROVIDER": "sdk_tracer_provider"}, "TracerProvider", True),
    ],
)
def test_configured_tracing_installs_the_provider_that_says_whether_spans_are_recorded(
    environment: dict[str, str], provider: str, recorded: bool
) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    result = subprocess.run(
        [sys.executable, "-c", _PROVIDER_PROBE],
        env=clean | environment,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(result.stdout.splitlines()[-1]) == [provider, recorded]
