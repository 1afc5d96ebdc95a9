"""A minimal OTLP/HTTP trace receiver: what an operator's collector would get from the services,
decoded with ``opentelemetry-proto``. The tracing tests check one connected trace per job with
it, and ``bench/e2e/anatomy.py`` times each step of a job from the same spans."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass(frozen=True)
class Received:
    """One exported span, flattened: ids as hex, attributes as Python values."""

    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, object]
    links: tuple[str, ...]
    """The trace ids the span links to."""
    start_ns: int = 0
    end_ns: int = 0


def _value(value: AnyValue) -> object:
    which = value.WhichOneof("value")
    if which == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, which) if which else None


@dataclass
class Receiver:
    """A minimal OTLP/HTTP trace receiver: ``POST /v1/traces`` with a protobuf body."""

    spans: list[Received] = field(default_factory=list)
    port: int = 0
    connections: set[asyncio.StreamWriter] = field(default_factory=set)

    def add(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        for resource in request.resource_spans:
            attributes = {a.key: _value(a.value) for a in resource.resource.attributes}
            service = str(attributes.get("service.name", ""))
            for scope in resource.scope_spans:
                for span in scope.spans:
                    self.spans.append(
                        Received(
                            service=service,
                            name=span.name,
                            kind=span.kind,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            links=tuple(link.trace_id.hex() for link in span.links),
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                        )
                    )

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections.add(writer)
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:  # the exporter keeps its connection alive between exports
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                method, path = lines[0].split(" ")[:2]
                headers = {
                    k.strip().lower(): v.strip()
                    for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)
                }
                body = await reader.readexactly(int(headers.get("content-length", "0")))
                if method == "POST" and path == "/v1/traces":
                    self.add(body)
                    status, answer = "200 OK", ExportTraceServiceResponse().SerializeToString()
                else:
                    status, answer = "404 Not Found", b""
                writer.write(
                    f"HTTP/1.1 {status}\r\nContent-Type: application/x-protobuf\r\n"
                    f"Content-Length: {len(answer)}\r\n\r\n".encode()
                    + answer
                )
                await writer.drain()
        self.connections.discard(writer)
        writer.close()

    async def close(self) -> None:
        """Drop the exporters' kept-alive connections (the services outlive the receiver)."""
        for writer in list(self.connections):
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    def of_trace(self, trace_id: str) -> list[Received]:
        return [s for s in self.spans if s.trace_id == trace_id]

    def named(self, trace_id: str, name: str) -> list[Received]:
        return [s for s in self.of_trace(trace_id) if s.name == name]


@contextlib.asynccontextmanager
async def serve_receiver() -> AsyncIterator[Receiver]:
    """A receiver listening on a free loopback port (``Receiver.port``) until the block ends."""
    received = Receiver()
    server = await asyncio.start_server(received.handle, "127.0.0.1", 0)
    received.port = server.sockets[0].getsockname()[1]
    try:
        yield received
    finally:
        server.close()  # first stop accepting: an exporter retrying now must not get in
        await received.close()
        await server.wait_closed()


def exporter_env(receiver: Receiver) -> dict[str, str]:
    """The standard ``OTEL_*`` variables that point a service's exporter at ``receiver``."""
    return {
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{receiver.port}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
        "OTEL_EXPORTER_OTLP_COMPRESSION": "none",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
