"""The event-loop lag probe: a callback that holds the loop shows as a late timer."""

from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

from xpupool.obs.metrics import LoopLag, watch_loop_lag


def _count_over(registry: CollectorRegistry, seconds: float) -> float:
    """Observations above ``seconds`` (the histogram's buckets are cumulative)."""
    total = registry.get_sample_value("xpupool_event_loop_lag_seconds_count") or 0.0
    within = registry.get_sample_value(
        "xpupool_event_loop_lag_seconds_bucket", {"le": str(seconds)}
    )
    return total - (within or 0.0)


async def test_a_stall_of_the_loop_is_observed_as_lag() -> None:
    registry = CollectorRegistry()
    lag = LoopLag(registry)
    stop = asyncio.Event()
    task = asyncio.create_task(lag.watch(stop, interval_s=0.005))
    await asyncio.sleep(0.05)
    before = _count_over(registry, 0.1)
    time.sleep(0.12)  # noqa: ASYNC251  (the point: it holds the loop, as a long computation does)
    await asyncio.sleep(0.03)
    stop.set()
    await task
    assert _count_over(registry, 0.1) >= before + 1
    assert (registry.get_sample_value("xpupool_event_loop_lag_seconds_count") or 0) >= 5


def test_no_probe_without_a_metrics_endpoint() -> None:
    assert watch_loop_lag(None, asyncio.Event()) == []
