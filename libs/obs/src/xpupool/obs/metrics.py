"""Serving one service's Prometheus registry over HTTP, shared by every xpupool service.

Each service builds its own :class:`~prometheus_client.CollectorRegistry` (never the
process-wide default one) and serves it here. Conventional ports for deployments: collector
9400 (dcgm-exporter's), scheduler 9401, lease-manager 9402, autoscaler 9403. Port 0 in a
service's settings means no metrics endpoint; the address defaults to loopback in every
service so an endpoint is only exposed when a deployment asks for it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from prometheus_client import CollectorRegistry, start_http_server

__all__ = ["serve_metrics"]


@contextmanager
def serve_metrics(registry: CollectorRegistry, port: int, addr: str = "127.0.0.1") -> Iterator[int]:
    """Serve ``registry`` as Prometheus text on ``addr:port`` from a daemon thread.

    Yields the bound port (``port`` 0 binds any free one, which tests use) and shuts the
    server down on exit. Scrapes run on that thread: collectors must not touch the event loop.
    """
    server, thread = start_http_server(port, addr=addr, registry=registry)
    try:
        yield int(server.server_port)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
