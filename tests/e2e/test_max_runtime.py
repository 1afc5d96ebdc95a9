"""Maximum run time: a warning, then the lease ends ``max_runtime`` whatever the renewals."""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import eventually
from tests.e2e.conftest import EventLog, Ready, cli_env
from xpupool.contracts import AllocationGranted, JobRequested, LeaseEnded, LeaseEnding
from xpupool.devstack.stack import NodeSpec, Stack
from xpupool.ledger import audit
from xpupool.runner import EXIT_LEASE_LOST

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

TENANT = "research"
QUEUES = """
queues:
  - {name: research, max_runtime_s: 2.5, tenants: [research]}
  - {name: long, tenants: [research]}
"""


@pytest.fixture(params=["plain", "secure"])
def stack_security(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def _stack(make_stack: Callable[..., Stack], tmp_path: Path) -> Stack:
    queues = tmp_path / "queues.yaml"
    queues.write_text(QUEUES)
    return make_stack(
        [NodeSpec("node-m", "2xA100-80GB")],
        tenants=[TENANT],
        # Warned 1 s before the end (the default is a minute), so a command has started by then.
        extra_env={"XPUPOOL_QUEUE_CONFIG": str(queues), "XPUPOOL_MAX_RUNTIME_WARNING_S": "1"},
    )


async def test_the_smaller_limit_ends_the_lease_after_a_warning_despite_renewals(
    make_stack: Callable[..., Stack], ready: Ready, tmp_path: Path
) -> None:
    stack = _stack(make_stack, tmp_path)
    ledger = await ready(stack, 2)
    async with stack.client() as operator, stack.client(TENANT) as client:
        log = EventLog()
        await log.attach(operator.nc)
        # The queue's 2.5 s beats the request's 60 s; the other queue has no limit, so the
        # request's 1.5 s applies there.
        by_queue = await client.submit_and_wait(
            JobRequested(job_id="mr-queue", tenant=TENANT, max_runtime_s=60, lease_ttl_s=30)
        )
        by_request = await client.submit_and_wait(
            JobRequested(
                job_id="mr-request", tenant=TENANT, queue="long", max_runtime_s=1.5, lease_ttl_s=30
            )
        )
        assert isinstance(by_queue, AllocationGranted)
        assert isinstance(by_request, AllocationGranted)
        assert (by_queue.expires_at - by_queue.granted_at).total_seconds() == pytest.approx(2.5)
        renewed = await client.renew(by_queue.lease_id, by_queue.fencing_token, 30)
        assert renewed.ok and renewed.expires_at is not None
        assert renewed.expires_at <= by_queue.expires_at  # capped at the deadline
        started = time.monotonic()

        async def both_ended() -> bool:
            return all(log.of(LeaseEnded, j) for j in ("mr-queue", "mr-request"))

        await eventually(both_ended, timeout_s=15)
        assert time.monotonic() - started < 10
        for job_id, grant in (("mr-queue", by_queue), ("mr-request", by_request)):
            (warning,) = log.of(LeaseEnding, job_id)
            (ended,) = log.of(LeaseEnded, job_id)
            assert warning.reason.value == "max_runtime" and ended.reason.value == "max_runtime"
            assert log.events.index(warning) < log.events.index(ended)
            assert ended.ended_at >= warning.deadline
            assert warning.lease_id == grant.lease_id
    assert await audit(ledger) == []


async def test_run_gives_cmd_sigterm_at_the_warning_and_exits_with_the_reason(
    make_stack: Callable[..., Stack], ready: Ready, tmp_path: Path
) -> None:
    stack = _stack(make_stack, tmp_path)
    await ready(stack, 2)
    marker = tmp_path / "terminated"
    script = (
        "import signal, sys, time\n"
        "def bye(*_):\n"
        f"    open({str(marker)!r}, 'w').write('term'); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "time.sleep(60)\n"
    )
    env = cli_env(stack, TENANT)
    runner = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "xpupool.cli.main",
        "run",
        "--",
        sys.executable,
        "-c",
        script,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(runner.communicate(), 60)
    assert runner.returncode == EXIT_LEASE_LOST, err.decode()
    assert "(max_runtime); sending SIGTERM" in err.decode()
    assert "stopped by max_runtime" in err.decode()
    assert marker.read_text() == "term"
