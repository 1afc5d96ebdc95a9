"""`xpupool run -- CMD` against a running stack, with a real child process."""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest

from tests.conftest import eventually
from tests.e2e.conftest import EventLog, Ready, start_runner
from xpupool.cli.main import build_parser
from xpupool.client import XpupoolClient
from xpupool.contracts import (
    AllocationGranted,
    JobCancelled,
    JobRequested,
    LeaseEnded,
    LeaseRenewed,
)
from xpupool.devstack.stack import NodeSpec, Stack
from xpupool.ledger import audit
from xpupool.runner import EXIT_INTERRUPTED, EXIT_LEASE_LOST, EXIT_NOT_GRANTED, parse_size_mib

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

TENANT = "research"


@pytest.fixture(params=["plain", "secure"])
def stack_security(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def _start(stack: Stack, *args: str) -> asyncio.subprocess.Process:
    return await start_runner(stack, TENANT, *args)


async def _finish(process: asyncio.subprocess.Process) -> tuple[int, str, str]:
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, out.decode(), err.decode()


@asynccontextmanager
async def _watching(stack: Stack) -> AsyncIterator[tuple[EventLog, XpupoolClient]]:
    """The operator's recorder of every event, and the tenant's own client (secrets seen)."""
    async with stack.client() as operator, stack.client(TENANT) as tenant:
        recorder = EventLog()
        await recorder.attach(operator.nc)
        yield recorder, tenant


async def test_cmd_gets_the_lease_env_is_renewed_and_its_exit_code_passes_through(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    stack = make_stack([NodeSpec("node-r", "1xA100-80GB")], tenants=[TENANT])
    ledger = await ready(stack, 1)
    script = (
        "import os, sys, time; "
        "print(os.environ['CUDA_VISIBLE_DEVICES'], os.environ['XPUPOOL_LEASE_ID'], flush=True); "
        "time.sleep(4); sys.exit(7)"
    )
    async with _watching(stack) as (recorder, _):
        runner = await _start(
            stack,
            "--share",
            "0.5",
            "--ttl",
            "1.5",
            "--job-id",
            "run-env",
            "--",
            sys.executable,
            "-c",
            script,
        )
        code, out, err = await _finish(runner)
        assert code == 7, err
        (grant,) = recorder.of(AllocationGranted, "run-env")
        assert out.split() == [grant.env["CUDA_VISIBLE_DEVICES"], grant.lease_id]
        assert grant.slices[0].compute_pct == 50
        # A 4 s run on a 1.5 s term lives only because it was renewed.
        assert len(recorder.of(LeaseRenewed, "run-env")) >= 2

        async def released() -> bool:
            return [e.reason.value for e in recorder.of(LeaseEnded, "run-env")] == ["released"]

        await eventually(released)
    assert await audit(ledger) == []
    (node,) = await ledger.nodes()
    assert node.devices[0].compute_free_pct == 100


async def test_sigterm_is_forwarded_to_cmd_and_the_lease_still_released(
    make_stack: Callable[..., Stack], ready: Ready, tmp_path: Path
) -> None:
    stack = make_stack([NodeSpec("node-r", "1xA100-80GB")], tenants=[TENANT])
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
    async with _watching(stack) as (recorder, _):
        runner = await _start(stack, "--job-id", "run-term", "--", sys.executable, "-c", script)
        assert runner.stdout is not None
        assert (await asyncio.wait_for(runner.stdout.readline(), 30)).strip() == b"ready"
        runner.send_signal(signal.SIGTERM)
        code, _, err = await _finish(runner)
        assert code == 0, err
        assert marker.read_text() == "term"

        async def released() -> bool:
            return [e.reason.value for e in recorder.of(LeaseEnded, "run-term")] == ["released"]

        await eventually(released)


async def test_a_lease_ended_under_cmd_stops_it_and_says_why(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    stack = make_stack([NodeSpec("node-r", "1xA100-80GB")], tenants=[TENANT])
    await ready(stack, 1)
    script = "import time; print('ready', flush=True); time.sleep(60)"
    async with _watching(stack) as (recorder, tenant):
        runner = await _start(
            stack, "--grace", "2", "--job-id", "run-lost", "--", sys.executable, "-c", script
        )
        assert runner.stdout is not None
        assert (await asyncio.wait_for(runner.stdout.readline(), 30)).strip() == b"ready"
        (grant,) = recorder.of(AllocationGranted, "run-lost")
        # Someone else holding the secret (the tenant's other client) ends the lease.
        assert (await tenant.release(grant.lease_id, grant.fencing_token)).ok
        code, _, err = await _finish(runner)
        assert code == EXIT_LEASE_LOST
        assert f"lease {grant.lease_id} ended: released" in err


async def test_stopping_the_runner_while_it_waits_cancels_the_job(
    make_stack: Callable[..., Stack], ready: Ready, tmp_path: Path
) -> None:
    stack = make_stack([NodeSpec("node-r", "1xA100-80GB")], tenants=[TENANT])
    await ready(stack, 1)
    marker = tmp_path / "ran"
    async with _watching(stack) as (recorder, tenant):
        holder = await tenant.submit_and_wait(JobRequested(job_id="holder", tenant=TENANT))
        assert isinstance(holder, AllocationGranted)
        runner = await _start(
            stack, "--job-id", "run-wait", "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"
        )
        assert runner.stderr is not None
        line = await asyncio.wait_for(runner.stderr.readline(), 30)
        assert b"waiting" in line, line
        runner.send_signal(signal.SIGINT)
        code, _, err = await _finish(runner)
        assert code == EXIT_INTERRUPTED and "run-wait cancelled" in err

        async def cancelled() -> bool:
            return len(recorder.of(JobCancelled, "run-wait")) == 1

        await eventually(cancelled)
        assert not marker.exists()


async def test_a_rejected_request_never_runs_cmd(
    make_stack: Callable[..., Stack], ready: Ready, tmp_path: Path
) -> None:
    stack = make_stack([NodeSpec("node-r", "1xA100-80GB")], tenants=[TENANT])
    await ready(stack, 1)
    marker = tmp_path / "ran"
    runner = await _start(
        stack, "--gpus", "8", "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')"
    )
    code, _, err = await _finish(runner)
    assert code == EXIT_NOT_GRANTED
    assert "rejected: exceeds_pool_capacity" in err
    assert not marker.exists()


async def test_usage_errors_are_one_line(make_stack: Callable[..., Stack]) -> None:
    stack = make_stack([NodeSpec("node-r", "1xA100-80GB")], tenants=[TENANT])
    no_command = await _start(stack, "--gpus", "1")
    code, _, err = await _finish(no_command)
    assert code == 2 and err.strip().count("\n") == 0 and "needs a command" in err
    bad_share = await _start(stack, "--share", "1.5", "--", "true")
    code, _, err = await _finish(bad_share)
    assert code == 2 and "--share" in err
    missing = await _start(stack, "--", "/nonexistent/xpupool-test-binary")
    code, _, err = await _finish(missing)
    assert code == 127 and "cannot start" in err


@pytest.mark.parametrize(
    ("text", "mib"),
    [("20GiB", 20480), ("20G", 20480), ("512MiB", 512), ("1.5T", 1572864), ("300", 300)],
)
def test_sizes_are_binary_units(text: str, mib: int) -> None:
    assert parse_size_mib(text) == mib


@pytest.mark.parametrize("text", ["", "20 parsecs", "-1G", "0.5MiB"])
def test_bad_sizes_are_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_size_mib(text)


@pytest.mark.parametrize("option", ["--ttl", "--max-wait", "--cpus", "--grace", "--share"])
@pytest.mark.parametrize("text", ["nan", "inf", "-inf"])
def test_a_number_option_that_is_no_finite_number_is_a_usage_error(
    option: str, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``float()`` takes ``nan`` and ``inf``; sent, JSON would carry them as "not given" (an
    infinite wait as none at all), and ``--cpus nan`` ended in a traceback."""
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["run", f"{option}={text}", "--", "true"])
    assert exit_.value.code == 2
    assert f"argument {option}: not a finite number: '{text}'" in capsys.readouterr().err
