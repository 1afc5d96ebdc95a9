"""Serving one service's Prometheus registry over HTTP, shared by every xpupool service.

Each service builds its own :class:`~prometheus_client.CollectorRegistry` (never the
process-wide default one) and serves it here. Conventional ports for deployments: collector
9400 (dcgm-exporter's), scheduler 9401, lease-manager 9402, autoscaler 9403. Port 0 in a
service's settings means no metrics endpoint; the address defaults to loopback in every
service so an endpoint is only exposed when a deployment asks for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from typing import Any, Final

from prometheus_client import CollectorRegistry, Histogram, start_http_server

__all__ = ["LOOP_LAG_PROBE_S", "LoopLag", "serve_metrics", "watch_loop_lag"]

LOOP_LAG_PROBE_S: Final = 0.02
"""How often the probe's timer is due: a stall of the loop this long or longer is always seen,
a shorter one in proportion. (A timer every 20 ms cost 0.35-0.7 % of a core in an otherwise idle
process on the dev machine, ``just bench-stalls``; one every 10 ms more, for stalls that short.)"""
_LOOP_LAG_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


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


class LoopLag:
    """``xpupool_event_loop_lag_seconds``: how late the service's event loop ran a timer that
    was due every ``LOOP_LAG_PROBE_S``. A callback that holds the loop (a long computation, a
    large read decoded at once) delays every message the service serves by as much, and shows
    here as a late timer; the histogram's upper buckets are those stalls."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.lag = Histogram(
            "xpupool_event_loop_lag_seconds",
            "How late the event loop ran a timer due every 20 ms (a stall of every message)",
            buckets=_LOOP_LAG_BUCKETS,
            registry=registry,
        )

    async def watch(self, stop: asyncio.Event, interval_s: float = LOOP_LAG_PROBE_S) -> None:
        """Observe the lag of one timer after another until ``stop``: a bare timer chain, no
        task or future per tick, since it runs on the same loop as the work it watches."""
        loop = asyncio.get_running_loop()
        handle: asyncio.TimerHandle | None = None

        def tick(due: float) -> None:
            nonlocal handle
            now = loop.time()
            self.lag.observe(max(0.0, now - due))
            handle = loop.call_at(now + interval_s, tick, now + interval_s)

        start = loop.time() + interval_s
        handle = loop.call_at(start, tick, start)
        try:
            await stop.wait()
        finally:
            handle.cancel()


def watch_loop_lag(lag: LoopLag | None, stop: asyncio.Event) -> list[Coroutine[Any, Any, None]]:
    """The probe to run beside a service's loops: none where the service serves no metrics
    (``lag`` None), since nobody would read what it observes."""
    return [] if lag is None else [lag.watch(stop)]
