"""Scheduling policy end to end: quotas across scheduler replicas, preemption, explanations."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.e2e.conftest import EventLog, Ready
from xpupool.client import connected
from xpupool.contracts import (
    AllocationGranted,
    EndReason,
    JobPending,
    JobRejected,
    JobRequested,
    LeaseEnded,
    Priority,
)
from xpupool.devstack.stack import NodeSpec, Stack
from xpupool.ledger import audit

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

QUEUES = """
priority_classes: {low: 100, normal: 500, high: 900}
preemption: {enabled: true, min_runtime_s: 0}
queues:
  - {name: team-a, limit: {units: 2}}
  - {name: team-b, limit: {units: 1}}
  - {name: batch}
"""


def _config(tmp_path: Path) -> dict[str, str]:
    path = tmp_path / "queues.yaml"
    path.write_text(QUEUES)
    return {"XPUPOOL_QUEUE_CONFIG": str(path)}


async def test_two_replicas_never_exceed_a_queue_limit(
    make_stack: Callable[..., Stack], ready: Ready, tmp_path: Path
) -> None:
    """With two scheduler replicas racing, a queue never holds more than its limit, the
    ledger's quota counters agree with its leases, and no device is over-allocated."""
    stack = make_stack(
        [NodeSpec("node-q", "6xA100-80GB")], schedulers=2, extra_env=_config(tmp_path)
    )
    ledger = await ready(stack, 6)
    assert stack.nats_url
    log = EventLog()
    peak: dict[str, float] = {"team-a": 0.0, "team-b": 0.0}
    async with connected(stack.nats_url) as client:
        await log.attach(client.nc)
        requests = [
            JobRequested(job_id=f"q-{i}", tenant="team-a" if i % 2 else "team-b", lease_ttl_s=2.0)
            for i in range(40)
        ]
        await asyncio.gather(*(client.submit(r) for r in requests))
        deadline = asyncio.get_running_loop().time() + 12
        while asyncio.get_running_loop().time() < deadline:
            for queue in peak:
                units = (await ledger.usage(queue)).get("units", 0.0)
                peak[queue] = max(peak[queue], units)
            await asyncio.sleep(0.05)
        assert peak["team-a"] <= 2.0 + 1e-9 and peak["team-b"] <= 1.0 + 1e-9, peak
        assert peak["team-a"] > 0 and peak["team-b"] > 0
        assert await audit(ledger) == []
        held = {lease.queue: 0 for lease in await ledger.leases()}
        for lease in await ledger.leases():
            held[lease.queue] += 1
        assert held.get("team-a", 0) <= 2 and held.get("team-b", 0) <= 1
        # Leases expire every 2 s, so queued jobs keep flowing through the quota.
        assert len(log.of(AllocationGranted)) > 3


async def test_high_priority_job_preempts_the_youngest_low_priority_lease(
    make_stack: Callable[..., Stack], ready: Ready, tmp_path: Path
) -> None:
    """A high-priority request on a full pool preempts one low-priority lease (ended as
    preempted, exactly once) and is then granted."""
    stack = make_stack([NodeSpec("node-p", "2xA100-80GB")], extra_env=_config(tmp_path))
    await ready(stack, 2)
    assert stack.nats_url
    log = EventLog()
    async with connected(stack.nats_url) as client:
        await log.attach(client.nc)
        older = await client.submit_and_wait(
            JobRequested(job_id="low-1", tenant="batch", priority=Priority.LOW)
        )
        await asyncio.sleep(0.2)
        younger = await client.submit_and_wait(
            JobRequested(job_id="low-2", tenant="batch", priority=Priority.LOW)
        )
        assert isinstance(older, AllocationGranted) and isinstance(younger, AllocationGranted)
        urgent = await client.submit_and_wait(
            JobRequested(job_id="urgent", tenant="batch", priority=Priority.HIGH), timeout_s=30
        )
        assert isinstance(urgent, AllocationGranted), urgent
        ended = log.of(LeaseEnded)
        assert [e.job_id for e in ended] == ["low-2"]
        assert ended[0].reason is EndReason.PREEMPTED
        assert any(p.reason == "preemption_in_progress" for p in log.of(JobPending, "urgent"))


async def test_impossible_and_unknown_requests_are_rejected_with_reasons(
    make_stack: Callable[..., Stack], ready: Ready, tmp_path: Path
) -> None:
    """A request no node can ever hold, or naming an unknown priority, is rejected at once
    with a reason (and the field to blame), not left waiting."""
    stack = make_stack([NodeSpec("node-r", "2xA100-80GB")], extra_env=_config(tmp_path))
    await ready(stack, 2)
    assert stack.nats_url
    async with connected(stack.nats_url) as client:
        too_big = await client.submit_and_wait(JobRequested(job_id="big", tenant="batch", count=8))
        assert isinstance(too_big, JobRejected) and too_big.reason.startswith("exceeds")
        odd = await client.submit_and_wait(
            JobRequested(job_id="odd", tenant="batch", priority="urgent-ish")  # type: ignore[arg-type]
        )
        assert isinstance(odd, JobRejected) and odd.field_name == "priority", odd


async def test_max_wait_ends_a_waiting_job_with_one_terminal_event(
    make_stack: Callable[..., Stack], ready: Ready, tmp_path: Path
) -> None:
    """A job that waits past its max_wait_s ends with one JobTimedOut; it is never granted
    later, even when capacity frees."""
    from xpupool.contracts import JobTimedOut

    stack = make_stack([NodeSpec("node-w", "1xA100-80GB")], extra_env=_config(tmp_path))
    await ready(stack, 1)
    assert stack.nats_url
    log = EventLog()
    async with connected(stack.nats_url) as client:
        await log.attach(client.nc)
        holder = await client.submit_and_wait(JobRequested(job_id="holder", tenant="batch"))
        assert isinstance(holder, AllocationGranted)
        impatient = await client.submit_and_wait(
            JobRequested(job_id="impatient", tenant="batch", max_wait_s=1.0), timeout_s=30
        )
        assert isinstance(impatient, JobTimedOut), impatient
        assert impatient.last_reason == "insufficient_capacity"
        await client.release(holder.lease_id, holder.fencing_token)
        await asyncio.sleep(2.0)
        assert log.of(AllocationGranted, "impatient") == []
        assert len(log.of(JobTimedOut, "impatient")) == 1
