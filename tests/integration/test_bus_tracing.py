"""Bus spans on a real nats-server: one connected trace per message chain, with the messaging
and CloudEvents semantic-convention attributes on both ends."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence

import msgspec
import pytest
from nats.aio.client import Client
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from tests.conftest import eventually
from xpupool.bus import InvalidMessage, Publisher, consume_stream
from xpupool.contracts import JobReason, JobRejected, JobRequested, subjects

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    """Every span ended in this process during the test.

    The bus takes its tracer from the global provider (as the services configure it), which can
    be installed only once per process: reuse it when something already did.
    """
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    processor = SimpleSpanProcessor(exporter)
    provider.add_span_processor(processor)
    yield exporter
    # A provider cannot drop a processor: a shut-down exporter ignores later spans.
    processor.shutdown()


def _named(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [span for span in exporter.get_finished_spans() if span.name == name]


async def test_send_process_send_is_one_trace_with_semantic_attributes(
    nc: Client, spans: InMemorySpanExporter
) -> None:
    publisher = Publisher(nc, source="/tests")
    stop = asyncio.Event()
    seen_in: list[int] = []

    async def handler(request: JobRequested, *, tenant: str) -> Sequence[msgspec.Struct]:
        seen_in.append(trace.get_current_span().get_span_context().span_id)
        return [JobRejected(job_id=request.job_id, tenant=tenant, reason=JobReason.INVALID_REQUEST)]

    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("submit") as root:
        await publisher.publish(JobRequested(job_id="tr1", tenant="t"))
    durable = subjects.Durable("test-tracing", subjects.JOB_REQUESTED, "tests")
    task = asyncio.create_task(consume_stream(nc.jetstream(), durable, handler, publisher, stop))
    rejected = f"send {subjects.JOB_REJECTED.address}"
    await eventually(lambda: _named(spans, rejected))
    stop.set()
    await task

    trace_id = root.get_span_context().trace_id
    [send] = _named(spans, f"send {subjects.JOB_REQUESTED.address}")
    [process] = _named(spans, f"process {subjects.JOB_REQUESTED.address}")
    replies = _named(spans, rejected)
    assert send.kind is SpanKind.PRODUCER and process.kind is SpanKind.CONSUMER
    assert {s.context.trace_id for s in [send, process, *replies]} == {trace_id}
    assert send.parent is not None and send.parent.span_id == root.get_span_context().span_id
    assert process.parent is not None and process.parent.span_id == send.context.span_id
    assert all(
        r.parent is not None and r.parent.span_id == process.context.span_id for r in replies
    )
    # The handler (and so its canonical log line) runs inside the CONSUMER span.
    assert seen_in == [process.context.span_id]

    expected = {
        "messaging.system": "nats",
        "messaging.destination.name": "xpupool.tenant.v1.t.jobs.requested",
        "messaging.destination.template": subjects.JOB_REQUESTED.address,
        "messaging.message.id": "tr1",
        "cloudevents.event_id": "tr1",
        "cloudevents.event_type": "xpupool.job.requested.v1",
        "cloudevents.event_source": "/tests",
        "cloudevents.event_spec_version": "1.0",
    }
    for span, operation in ((send, "send"), (process, "process")):
        attributes = dict(span.attributes or {})
        assert {k: attributes.get(k) for k in expected} == expected
        assert attributes["messaging.operation.type"] == operation
        assert isinstance(attributes["messaging.message.body.size"], int)
        assert attributes["messaging.message.body.size"] > 0


async def test_a_message_without_trace_context_starts_a_root(
    nc: Client, spans: InMemorySpanExporter
) -> None:
    """A bare message (no traceparent, no CloudEvents headers) is still traced, as a root, and
    its invalid payload is answered inside that trace."""
    publisher = Publisher(nc, source="/tests")
    stop = asyncio.Event()

    async def handler(request: JobRequested) -> Sequence[msgspec.Struct]:
        return []

    def on_invalid(invalid: InvalidMessage) -> Sequence[msgspec.Struct]:
        return [JobRejected(job_id="?", tenant="t", reason=JobReason.INVALID_REQUEST)]

    await nc.jetstream().publish("xpupool.tenant.v1.t.jobs.requested", b"{not json")
    durable = subjects.Durable("test-tracing-bare", subjects.JOB_REQUESTED, "tests")
    task = asyncio.create_task(
        consume_stream(nc.jetstream(), durable, handler, publisher, stop, on_invalid=on_invalid)
    )
    rejected = f"send {subjects.JOB_REJECTED.address}"
    await eventually(lambda: _named(spans, rejected))
    stop.set()
    await task
    [process] = _named(spans, f"process {subjects.JOB_REQUESTED.address}")
    assert process.parent is None
    attributes = dict(process.attributes or {})
    assert attributes["messaging.system"] == "nats"
    assert "cloudevents.event_id" not in attributes
    answer = _named(spans, rejected)[0]
    assert answer.context.trace_id == process.context.trace_id
    assert answer.parent is not None and answer.parent.span_id == process.context.span_id
