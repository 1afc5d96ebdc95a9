"""`xpupool run -- CMD` at the edges: NATS away while CMD runs, a hang-up, a stop that comes
while the request is still being submitted."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from tests.conftest import eventually
from tests.e2e.conftest import Ready, start_runner
from xpupool.client import XpupoolClient
from xpupool.contracts import AllocationGranted, JobRequested, SubmitReply
from xpupool.devstack.stack import NodeSpec, Stack
from xpupool.ledger import Ledger, audit
from xpupool.runner import EXIT_INTERRUPTED, EXIT_LEASE_LOST, EXIT_NOT_GRANTED, RunOptions, run_job

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

TENANT = "research"

# CMD: says its pid and lease, then waits for ``marker`` to exist and exits 7 (or sleeps on).
_WAIT_FOR_MARKER = (
    "import os, sys, time\n"
    "print(os.getpid(), os.environ['XPUPOOL_LEASE_ID'], flush=True)\n"
    "while not os.path.exists(sys.argv[1]):\n"
    "    time.sleep(0.1)\n"
    "sys.exit(7)\n"
)


@asynccontextmanager
async def _runner(stack: Stack, *args: str) -> AsyncIterator[asyncio.subprocess.Process]:
    """``xpupool run ARGS`` as a process; on the way out it and CMD (its own process group,
    whose id the test reads from CMD's first line) are gone, whatever the test found."""
    process = await start_runner(stack, TENANT, *args)
    try:
        yield process
    finally:
        if process.returncode is None:
            process.kill()
            await process.wait()


async def _started(process: asyncio.subprocess.Process) -> tuple[int, str]:
    """CMD's pid and lease id, from its first line."""
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), 30)
    pid, lease_id = line.decode().split()
    return int(pid), lease_id


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


async def _finish(process: asyncio.subprocess.Process, timeout_s: float) -> tuple[int, str]:
    _, err = await asyncio.wait_for(process.communicate(), timeout_s)
    assert process.returncode is not None
    return process.returncode, err.decode()


async def _ended(ledger: Ledger, lease_id: str, reason: str) -> None:
    async def ended() -> bool:
        lease = await ledger.get_lease(lease_id)
        return lease is not None and lease.state == "ended" and lease.end_reason == reason

    await eventually(ended, timeout_s=30)


async def test_cmd_outlives_a_nats_outage_longer_than_a_client_s_reconnects(
    make_stack: Callable[..., Stack], ready: Ready, tmp_path: Path
) -> None:
    """NATS away for longer than a plain client's bounded reconnects (5 tries, 2 s apart) but
    well within the lease's term: the runner must still be connected when NATS is back, renew,
    release when CMD exits and exit with CMD's code. A runner whose connection gave up renewed
    no more (CMD would have run on past its term), could not release, and its exit drained a
    closed connection: exit 2 instead of CMD's 7."""
    stack = make_stack([NodeSpec("node-r", "1xA100-80GB")], tenants=[TENANT])
    ledger = await ready(stack, 1)
    assert stack.nats is not None
    marker = tmp_path / "finish"
    argv = ("--ttl", "40", "--", sys.executable, "-c", _WAIT_FOR_MARKER, str(marker))
    async with _runner(stack, *argv) as runner:
        pid, lease_id = await _started(runner)
        try:
            stack.nats.kill()
            await asyncio.sleep(14)
            stack.nats.start()
            # Back in time for the renewal due 13 s after the one before the outage at most.
            lease = await ledger.get_lease(lease_id)
            assert lease is not None and lease.state == "active"
            await asyncio.sleep(15)  # a renewal or two after the outage
            marker.touch()
            code, err = await _finish(runner, 60)
        finally:
            _kill_group(pid)
    assert code == 7, err
    await _ended(ledger, lease_id, "released")
    assert await audit(ledger) == []


async def test_cmd_is_stopped_once_its_term_passed_unrenewed_while_nats_is_away(
    make_stack: Callable[..., Stack], ready: Ready, tmp_path: Path
) -> None:
    """With NATS away, no renewal reaches the lease-manager and no ``LeaseEnded`` reaches the
    runner, while the lease-manager ends the lease at its term all the same (its expiry runs
    on Redis). The runner knows the term: past it unrenewed, the lease is gone, and CMD gets
    SIGTERM (then SIGKILL) rather than running on devices that may be someone else's."""
    stack = make_stack([NodeSpec("node-r", "1xA100-80GB")], tenants=[TENANT])
    ledger = await ready(stack, 1)
    assert stack.nats is not None
    marker = tmp_path / "never"
    argv = ("--ttl", "3", "--grace", "1", "--", sys.executable, "-c", _WAIT_FOR_MARKER, str(marker))
    async with _runner(stack, *argv) as runner:
        pid, lease_id = await _started(runner)
        try:
            stack.nats.kill()
            await _ended(ledger, lease_id, "expired")
            code, err = await _finish(runner, 20)  # NATS still away
        finally:
            _kill_group(pid)
            stack.nats.start()
    assert code == EXIT_LEASE_LOST, err
    assert f"lease {lease_id} ended" in err


async def test_a_hang_up_while_cmd_runs_reaches_cmd_and_the_lease_is_released(
    make_stack: Callable[..., Stack], ready: Ready, tmp_path: Path
) -> None:
    """SIGHUP (the terminal or ssh session gone, ``kill -HUP``) goes to the runner as SIGINT
    and SIGTERM do: forwarded to CMD's group, and the lease released. Left at its default, it
    killed the runner alone: the lease stayed held until its term and CMD, in its own group,
    ran on without a lease."""
    stack = make_stack([NodeSpec("node-r", "1xA100-80GB")], tenants=[TENANT])
    ledger = await ready(stack, 1)
    marker = tmp_path / "never"
    async with _runner(stack, "--", sys.executable, "-c", _WAIT_FOR_MARKER, str(marker)) as runner:
        pid, lease_id = await _started(runner)
        try:
            runner.send_signal(signal.SIGHUP)
            code, err = await _finish(runner, 30)
        finally:
            _kill_group(pid)
    assert code == 128 + signal.SIGHUP, err  # CMD's own death by SIGHUP
    await _ended(ledger, lease_id, "released")


async def test_a_hang_up_while_the_job_waits_cancels_it(
    make_stack: Callable[..., Stack], ready: Ready, tmp_path: Path
) -> None:
    stack = make_stack([NodeSpec("node-r", "1xA100-80GB")], tenants=[TENANT])
    ledger = await ready(stack, 1)
    marker = tmp_path / "ran"
    async with stack.client(TENANT) as tenant:
        holder = await tenant.submit_and_wait(JobRequested(job_id="holder", tenant=TENANT))
        assert isinstance(holder, AllocationGranted)
        command = ("--job-id", "run-hup", "--", sys.executable, "-c", f"open({str(marker)!r}, 'w')")
        async with _runner(stack, *command) as runner:
            assert runner.stderr is not None
            line = await asyncio.wait_for(runner.stderr.readline(), 30)
            assert b"waiting" in line, line
            runner.send_signal(signal.SIGHUP)
            code, err = await _finish(runner, 30)
    assert code == EXIT_INTERRUPTED and "run-hup cancelled" in err
    job = await ledger.get_job("run-hup")
    assert job is not None and job.state == "cancelled"
    assert not marker.exists()


class _StoppedWhileSubmitting(XpupoolClient):
    """A client whose user stops the runner (SIGTERM to this process, which the runner
    handles) while the request is on its way: the reply, a grant, comes after the stop."""

    async def submit_request(self, request: JobRequested) -> SubmitReply | None:
        os.kill(os.getpid(), signal.SIGTERM)
        await asyncio.sleep(0.05)  # the handler has run: the runner knows it is stopped
        return await super().submit_request(request)


async def test_a_stop_before_cmd_starts_never_starts_it_and_releases_the_grant(
    make_stack: Callable[..., Stack], ready: Ready, tmp_path: Path
) -> None:
    """Stopped while submitting (or just after the grant), the runner must not start CMD: it
    releases the lease the stop raced and exits ``EXIT_INTERRUPTED``. It started CMD and sent
    it the stop's signal at once, so CMD ran (for however long it took to die) after the user
    had stopped it."""
    stack = make_stack([NodeSpec("node-r", "1xA100-80GB")], tenants=[TENANT])
    ledger = await ready(stack, 1)
    marker = tmp_path / "ran"
    async with stack.client(TENANT) as tenant:
        client = _StoppedWhileSubmitting(tenant.nc, TENANT)
        await client.start()
        try:
            request = JobRequested(job_id="run-stopped", tenant=TENANT)
            argv = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
            code = await run_job(client, request, argv, RunOptions(grace_s=1), io.StringIO())
        finally:
            await client.close()
    assert code == EXIT_INTERRUPTED
    assert not marker.exists()
    job = await ledger.get_job("run-stopped")
    assert job is not None and job.lease_id
    await _ended(ledger, job.lease_id, "released")


class _AwayWhileGranted(XpupoolClient):
    """A client whose connection is down (``away``): it receives no event, as a core NATS
    subscriber gets nothing of that time; coming back counts as a reconnect."""

    away = False
    came_back = 0

    @property
    def reconnects(self) -> int:
        return self.came_back

    async def _on_event(self, msg: Msg) -> None:
        if not self.away:
            await super()._on_event(msg)


@asynccontextmanager
async def _behind_a_holder(
    make_stack: Callable[..., Stack], ready: Ready, node_id: str
) -> AsyncIterator[tuple[Ledger, Callable[[], Awaitable[object]], _AwayWhileGranted]]:
    """A one-GPU stack whose GPU a holder has leased, and a client that can be taken away
    (``_AwayWhileGranted``): yields the ledger, the holder's release and that client."""
    stack = make_stack([NodeSpec(node_id, "1xA100-80GB")], tenants=[TENANT])
    ledger = await ready(stack, 1)
    async with stack.client(TENANT) as holder, stack.client(TENANT) as tenant:
        held = await holder.submit_and_wait(JobRequested(job_id="holder", tenant=TENANT))
        assert isinstance(held, AllocationGranted)

        async def release() -> object:
            return await holder.release(held.lease_id, held.fencing_token)

        client = _AwayWhileGranted(tenant.nc, TENANT)
        await client.start()
        try:
            yield ledger, release, client
        finally:
            await client.close()


async def test_a_grant_published_while_the_runner_was_away_is_asked_for_again(
    make_stack: Callable[..., Stack], ready: Ready, tmp_path: Path
) -> None:
    """The runner waits; its job is granted while its connection is down, so the grant's event
    never reaches it. Back, it asks again (the same job id: no second grant) and is answered
    with the live grant, and CMD runs. It waited for ever before, and the lease ran out."""
    marker = tmp_path / "ran"
    async with _behind_a_holder(make_stack, ready, "node-r") as (ledger, release, client):
        request = JobRequested(job_id="run-away", tenant=TENANT)
        argv = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
        running = asyncio.ensure_future(
            run_job(client, request, argv, RunOptions(grace_s=1), io.StringIO())
        )
        await _away_while(ledger, client, "run-away", release)
        code = await asyncio.wait_for(running, 20)
    assert code == 0 and marker.exists()
    job = await ledger.get_job("run-away")
    assert job is not None and job.lease_id
    await _ended(ledger, job.lease_id, "released")
    assert await audit(ledger) == []


async def _away_while(
    ledger: Ledger,
    client: _AwayWhileGranted,
    job_id: str,
    then: Callable[[], Awaitable[object] | None],
) -> None:
    """Once ``job_id`` waits, take ``client`` away, run ``then`` (what ends the wait) and wait
    until the job has left the pending state and its event has come and gone; then bring the
    client back (a reconnect)."""

    async def state_is(wanted: Callable[[str | None], bool]) -> bool:
        job = await ledger.get_job(job_id)
        return wanted(None if job is None else job.state)

    await eventually(lambda: state_is(lambda state: state == "pending"))
    client.away = True
    ending = then()
    if ending is not None:
        await ending
    await eventually(lambda: state_is(lambda state: state not in (None, "pending")))
    await asyncio.sleep(0.5)  # the job's event has come and gone
    client.away, client.came_back = False, 1


async def test_submit_and_wait_asks_again_for_a_grant_published_while_it_was_away(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    """Any client waiting for an outcome, not only the runner: a grant published while its
    connection was down is asked for again once it is back (the same request: no second
    grant), and ``submit_and_wait`` returns it. It waited until its timeout before."""
    async with _behind_a_holder(make_stack, ready, "node-w") as (ledger, release, client):
        request = JobRequested(job_id="wait-away", tenant=TENANT)
        waiting = asyncio.ensure_future(client.submit_and_wait(request, timeout_s=15))
        await _away_while(ledger, client, "wait-away", release)
        grant = await asyncio.wait_for(waiting, 15)
    assert isinstance(grant, AllocationGranted) and grant.job_id == "wait-away"
    assert grant.lease_secret
    job = await ledger.get_job("wait-away")
    assert job is not None and job.lease_id == grant.lease_id
    assert await audit(ledger) == []


async def test_a_job_that_timed_out_while_the_runner_was_away_ends_the_runner(
    make_stack: Callable[..., Stack], ready: Ready, tmp_path: Path
) -> None:
    """The runner's job times out while its connection is down. Back, it asks again and is told
    the job is over, and exits ``EXIT_NOT_GRANTED`` saying how, without running CMD. It waited
    for ever before: the answer carried no grant and it kept waiting for an event gone by."""
    marker = tmp_path / "ran"
    out = io.StringIO()
    async with _behind_a_holder(make_stack, ready, "node-t") as (ledger, _, client):
        request = JobRequested(job_id="run-timeout", tenant=TENANT, max_wait_s=1.0)
        argv = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
        running = asyncio.ensure_future(run_job(client, request, argv, RunOptions(grace_s=1), out))
        await _away_while(ledger, client, "run-timeout", lambda: None)
        code = await asyncio.wait_for(running, 15)
    assert code == EXIT_NOT_GRANTED, out.getvalue()
    assert "it timed out waiting" in out.getvalue()
    assert not marker.exists()
    job = await ledger.get_job("run-timeout")
    assert job is not None and job.state == "timed_out"
