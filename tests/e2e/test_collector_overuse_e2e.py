"""Over-use and metrics end to end: every service a subprocess, real NATS and Redis."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Callable

import pytest
from nats.aio.msg import Msg
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import eventually
from tests.e2e.conftest import Ready
from xpupool.client import connected
from xpupool.contracts import (
    AllocationGranted,
    DeviceDemand,
    JobRequested,
    LeaseOverused,
    decoder_for,
    subjects,
)
from xpupool.devstack.servers import free_port
from xpupool.devstack.stack import NodeSpec, Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


def scrape(port: int) -> dict[tuple[str, str], float]:
    """Every sample of the collector's exposition, keyed by (name, device label)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        (s.name, s.labels.get("device", "") + s.labels.get("state", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_overusing_share_raises_one_event_and_shows_in_metrics(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    """A granted share on a simulated device using 1.5x its memory raises exactly one
    LeaseOverused on the EVENTS stream, and the collector's /metrics shows the load."""
    port = free_port()
    stack = make_stack(
        [NodeSpec("node-u", "1xA100-80GB")],
        extra_env={
            "XPUPOOL_SIM_OVERUSE_FACTOR": "1.5",
            "XPUPOOL_SAMPLE_INTERVAL_S": "0.2",
            "XPUPOOL_METRICS_PORT": str(port),
            "XPUPOOL_METRICS_ADDR": "127.0.0.1",
        },
    )
    await ready(stack, 1)
    assert stack.nats_url
    seen: list[LeaseOverused] = []
    decoder = decoder_for((LeaseOverused,))
    async with connected(stack.nats_url) as client:

        async def on_event(msg: Msg) -> None:
            seen.append(decoder.decode(msg.data))

        await client.nc.subscribe(subjects.LEASE_OVERUSED.subject(), cb=on_event)
        granted = await client.submit_and_wait(
            JobRequested(job_id="greedy", tenant="t", device=DeviceDemand(memory_mib=20_000))
        )
        assert isinstance(granted, AllocationGranted)
        await eventually(lambda: seen)
        await asyncio.sleep(1.0)  # five more ticks, still over: no second event
    assert [(e.lease_id, e.job_id, e.device_id) for e in seen] == [
        (granted.lease_id, "greedy", "node-u/nvidia0")
    ]
    assert (seen[0].granted_memory_mib, seen[0].used_memory_mib) == (20_000, 30_000)

    metrics = await asyncio.to_thread(scrape, port)
    assert metrics[("DCGM_FI_DEV_FB_USED", "nvidia0")] == 30_000
    assert metrics[("xpupool_device_health", "nvidia0healthy")] == 1
    assert metrics[("xpupool_collector_samples_total", "")] >= 5
