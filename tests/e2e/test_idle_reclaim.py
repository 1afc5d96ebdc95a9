"""Idle reclaim (opt-in per queue): a lease whose devices do no work for the queue's
``idle_reclaim_s`` is warned, then ends ``idle``; busy leases and other queues' are left alone."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import eventually
from tests.e2e.conftest import EventLog, Ready
from xpupool.client import XpupoolClient
from xpupool.contracts import AllocationGranted, EndReason, JobRequested, LeaseEnded, LeaseEnding
from xpupool.devstack.stack import NodeSpec, Stack
from xpupool.ledger import audit

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

TENANT = "lab"
QUEUES = """
queues:
  - {name: lab, idle_reclaim_s: 3.0, tenants: [lab]}
  - {name: keep, tenants: [lab]}
"""


@pytest.fixture(params=["plain", "secure"])
def stack_security(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _stack(make_stack: Callable[..., Stack], tmp_path: Path, busy_factor: float) -> Stack:
    queues = tmp_path / "queues.yaml"
    queues.write_text(QUEUES)
    env = {
        "XPUPOOL_QUEUE_CONFIG": str(queues),
        "XPUPOOL_IDLE_WARNING_S": "1",
        # Simulated devices are as busy as leased times this (0: every lease idles).
        "XPUPOOL_SIM_BUSY_FACTOR": str(busy_factor),
    }
    return make_stack([NodeSpec("node-i", "2xA100-80GB")], tenants=[TENANT], extra_env=env)


async def _grant(client: XpupoolClient, job_id: str, queue: str) -> AllocationGranted:
    request = JobRequested(job_id=job_id, tenant=TENANT, queue=queue, lease_ttl_s=60)
    outcome = await client.submit_and_wait(request)
    assert isinstance(outcome, AllocationGranted), outcome
    return outcome


async def test_an_idle_lease_of_an_opted_in_queue_is_warned_then_reclaimed(
    make_stack: Callable[..., Stack], ready: Ready, tmp_path: Path
) -> None:
    stack = _stack(make_stack, tmp_path, busy_factor=0.0)
    ledger = await ready(stack, 2)
    async with stack.client() as operator, stack.client(TENANT) as client:
        log = EventLog()
        await log.attach(operator.nc)
        idle = await _grant(client, "idle-1", "lab")
        kept = await _grant(client, "kept-1", "keep")

        async def reclaimed() -> bool:
            return bool(log.of(LeaseEnded, "idle-1"))

        await eventually(reclaimed, timeout_s=20)
        (warning,) = log.of(LeaseEnding, "idle-1")
        (ended,) = log.of(LeaseEnded, "idle-1")
        assert warning.reason is EndReason.IDLE and ended.reason is EndReason.IDLE
        assert warning.lease_id == idle.lease_id and ended.ended_at >= warning.deadline
        # The queue that did not opt in keeps its idle lease.
        assert not log.of(LeaseEnding, "kept-1") and not log.of(LeaseEnded, "kept-1")
        assert (await client.release(kept.lease_id, kept.fencing_token)).ok
    assert await audit(ledger) == []


async def test_a_busy_lease_is_not_reclaimed(
    make_stack: Callable[..., Stack], ready: Ready, tmp_path: Path
) -> None:
    stack = _stack(make_stack, tmp_path, busy_factor=1.0)
    await ready(stack, 2)
    async with stack.client() as operator, stack.client(TENANT) as client:
        log = EventLog()
        await log.attach(operator.nc)
        busy = await _grant(client, "busy-1", "lab")
        await asyncio.sleep(
            7.0
        )  # over twice the queue's idle_reclaim_s (the collector samples each second)
        assert not log.of(LeaseEnding, "busy-1") and not log.of(LeaseEnded, "busy-1")
        assert (await client.release(busy.lease_id, busy.fencing_token)).ok
