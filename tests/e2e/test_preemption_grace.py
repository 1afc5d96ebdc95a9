"""Preemption with a grace period: the victim is warned, keeps its slices until the deadline,
and ends ``preempted`` then, or ``released`` if it gives them back in time."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import eventually
from tests.e2e.conftest import EventLog, Ready, cli_env
from xpupool.contracts import (
    AllocationGranted,
    EndReason,
    JobPending,
    JobRequested,
    LeaseEnded,
    LeaseEnding,
    Priority,
)
from xpupool.devstack.stack import NodeSpec, Stack
from xpupool.ledger import audit
from xpupool.runner import EXIT_LEASE_LOST

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

GRACE_S = 2.0
QUEUES = f"""
priority_classes: {{low: 100, normal: 500, high: 900}}
preemption: {{enabled: true, min_runtime_s: 0, grace_s: {GRACE_S}}}
queues:
  - {{name: batch, tenants: [batch]}}
"""


@pytest.fixture(params=["plain", "secure"])
def stack_security(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _stack(make_stack: Callable[..., Stack], tmp_path: Path) -> Stack:
    queues = tmp_path / "queues.yaml"
    queues.write_text(QUEUES)
    return make_stack(
        [NodeSpec("node-g", "1xA100-80GB")],
        tenants=["batch"],
        extra_env={"XPUPOOL_QUEUE_CONFIG": str(queues)},
    )


@pytest.mark.parametrize("releases_in_time", [False, True])
async def test_the_victim_is_warned_and_keeps_its_slices_for_the_grace(
    make_stack: Callable[..., Stack], ready: Ready, tmp_path: Path, releases_in_time: bool
) -> None:
    stack = _stack(make_stack, tmp_path)
    ledger = await ready(stack, 1)
    async with stack.client() as operator, stack.client("batch") as client:
        log = EventLog()
        await log.attach(operator.nc)
        victim = await client.submit_and_wait(
            JobRequested(job_id="victim", tenant="batch", priority=Priority.LOW, lease_ttl_s=60)
        )
        assert isinstance(victim, AllocationGranted)
        urgent = client.expect("urgent")
        await client.submit(JobRequested(job_id="urgent", tenant="batch", priority=Priority.HIGH))

        async def warned() -> list[LeaseEnding]:
            return log.of(LeaseEnding, "victim")

        (warning,) = await eventually(warned)
        warned_at = time.monotonic()
        assert warning.reason is EndReason.PREEMPTED and warning.lease_id == victim.lease_id
        # Renewing cannot outlive the deadline, and the holder still holds its device.
        renewed = await client.renew(victim.lease_id, victim.fencing_token, 60)
        assert renewed.ok and renewed.expires_at is not None
        assert renewed.expires_at <= warning.deadline
        assert not log.of(LeaseEnded, "victim")
        if releases_in_time:
            assert (await client.release(victim.lease_id, victim.fencing_token)).ok
        granted = await urgent
        assert isinstance(granted, AllocationGranted), granted
        (ended,) = log.of(LeaseEnded, "victim")
        if releases_in_time:
            assert ended.reason is EndReason.RELEASED
        else:
            assert ended.reason is EndReason.PREEMPTED
            assert ended.ended_at >= warning.deadline
            assert time.monotonic() - warned_at >= GRACE_S - 0.5
        assert any(p.reason == "preemption_in_progress" for p in log.of(JobPending, "urgent"))
        assert len(log.of(LeaseEnding, "victim")) == 1
    assert await audit(ledger) == []


async def test_run_passes_the_preemption_warning_to_cmd_and_exits_with_the_reason(
    make_stack: Callable[..., Stack], ready: Ready, tmp_path: Path
) -> None:
    """``xpupool run`` on a preempted lease: CMD gets SIGTERM at the warning, the runner exits
    75 saying why, and the preempting job is granted."""
    stack = _stack(make_stack, tmp_path)
    await ready(stack, 1)
    marker = tmp_path / "terminated"
    script = (
        "import signal, sys, time\n"
        "def bye(*_):\n"
        f"    open({str(marker)!r}, 'w').write('term'); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    runner = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "xpupool.cli.main",
        "run",
        "--priority",
        "low",
        "--",
        sys.executable,
        "-c",
        script,
        env=cli_env(stack, "batch"),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert runner.stdout is not None
    assert (await asyncio.wait_for(runner.stdout.readline(), 30)).strip() == b"ready"
    async with stack.client("batch") as client:
        urgent = await client.submit_and_wait(
            JobRequested(job_id="urgent", tenant="batch", priority=Priority.HIGH), timeout_s=30
        )
        assert isinstance(urgent, AllocationGranted), urgent
    _, err = await asyncio.wait_for(runner.communicate(), 30)
    assert runner.returncode == EXIT_LEASE_LOST, err.decode()
    assert "(preempted); sending SIGTERM" in err.decode()
    assert marker.read_text() == "term"
