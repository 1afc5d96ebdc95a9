"""``xpupool run -- CMD``: one command from request to release.

The runner submits a job request as its tenant (by request/reply, answered at once when the job
fits; on the job stream when no scheduler answers), shows why the job waits while it waits, starts
``CMD`` with the grant's environment (the vendors' visible-device variables and limits, plus
``XPUPOOL_JOB_ID`` and ``XPUPOOL_LEASE_ID``), renews the lease while ``CMD`` runs, releases it
when ``CMD`` exits and exits with ``CMD``'s code. ``CMD`` runs in its own process group, which
holds the terminal's foreground when there is one (so Ctrl-C, a REPL or a debugger behave as if
``CMD`` had been started directly); SIGINT, SIGTERM and SIGHUP sent to the runner are forwarded
to that group, and the lease is still released. If the lease ends under ``CMD`` (preempted,
expired, lost with its node, released by someone holding its secret), ``CMD``'s group gets
SIGTERM, then SIGKILL after the grace period, and the runner exits with
:data:`EXIT_LEASE_LOST`; that includes a term that passed with no renewal answered (NATS away),
which the runner sees on its own clock, since no event can then tell it. Stopped while the job
waits, the runner cancels it; stopped once granted but before ``CMD`` started, it releases the
lease and never starts ``CMD``.

Exit codes: ``CMD``'s own (``128 + N`` when signal ``N`` killed it); :data:`EXIT_NOT_GRANTED`
when the request was rejected or timed out (``CMD`` never ran); :data:`EXIT_LEASE_LOST`;
:data:`EXIT_INTERRUPTED` when stopped before the grant.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from xpupool.client import RECONNECT_CHECK_S, OutcomeMissed, TenantEvent, XpupoolClient
from xpupool.contracts import (
    AllocationGranted,
    CancelOutcome,
    JobCancelled,
    JobPending,
    JobRejected,
    JobRequested,
    JobTimedOut,
    LeaseEnded,
    LeaseEnding,
)

__all__ = [
    "EXIT_INTERRUPTED",
    "EXIT_LEASE_LOST",
    "EXIT_NOT_GRANTED",
    "RunOptions",
    "parse_size_mib",
    "run_job",
]

#: The request was rejected or waited past its ``max_wait_s``: ``CMD`` never ran.
EXIT_NOT_GRANTED = 3
#: The lease ended while ``CMD`` ran (``EX_TEMPFAIL``: running again may well succeed).
EXIT_LEASE_LOST = 75
#: Stopped (SIGINT/SIGTERM/SIGHUP) before ``CMD`` started.
EXIT_INTERRUPTED = 130

# The signals that stop the runner: each is forwarded to ``CMD``'s group once it runs. SIGHUP
# too: left at its default (the terminal or ssh session gone, ``kill -HUP``) it killed the
# runner alone, with the lease held until its term and ``CMD`` running on in its own group.
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_MIB_PER_UNIT = {"": 1.0, "b": 1 / 2**20, "k": 1 / 1024, "m": 1.0, "g": 1024.0, "t": 1024.0**2}


def parse_size_mib(text: str) -> int:
    """``20GiB``, ``20G``, ``512MiB``, ``1.5T`` or a plain number of MiB, as MiB (powers of 1024:
    device memory is counted in binary units)."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"not a size: {text!r} (examples: 20GiB, 512MiB, 1.5T)")
    value, unit = float(match.group(1)), (match.group(2) or "").lower()
    mib = value * _MIB_PER_UNIT[unit[:1]]
    if mib < 1:
        raise ValueError(f"size {text!r} is under 1 MiB")
    return round(mib)


@dataclass(frozen=True)
class RunOptions:
    """How the runner behaves around ``CMD``."""

    #: Seconds ``CMD`` gets between SIGTERM and SIGKILL when its lease ends under it.
    grace_s: float = 10.0
    #: Seconds between renewals (None: a third of the lease term).
    renew_every_s: float | None = None


class _Status:
    """The waiting line: rewritten in place on a terminal, one line per change otherwise."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.live = out.isatty()
        self.started = time.monotonic()
        self.reason = "submitted"
        self._shown = ""

    def waiting(self, event: JobPending) -> None:
        self.reason = event.reason.value + (f": {event.detail}" if event.detail else "")
        self.show()

    def show(self) -> None:
        waited = time.monotonic() - self.started
        if self.live:
            line = f"xpupool: waiting {waited:5.0f}s  {self.reason}"
            self.out.write("\r\x1b[2K" + line[:200])
            self.out.flush()
        elif self.reason != self._shown:
            self.out.write(f"xpupool: waiting ({self.reason})\n")
            self.out.flush()
        self._shown = self.reason

    def done(self, text: str) -> None:
        prefix = "\r\x1b[2K" if self.live else ""
        self.out.write(f"{prefix}xpupool: {text}\n")
        self.out.flush()


def _exit_code(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


def _terminal() -> int | None:
    """stdin's terminal when this process holds its foreground (so ``CMD`` can take it)."""
    try:
        fd = sys.stdin.fileno()
        if os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp():
            return fd
    except (OSError, ValueError):
        pass
    return None


def _give_terminal(fd: int, pgrp: int) -> None:
    # A background process group that sets the foreground would get SIGTTOU and stop.
    previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        os.tcsetpgrp(fd, pgrp)
    except OSError:
        pass
    finally:
        signal.signal(signal.SIGTTOU, previous)


class _Run:
    def __init__(
        self,
        client: XpupoolClient,
        request: JobRequested,
        argv: Sequence[str],
        options: RunOptions,
        out: TextIO,
    ) -> None:
        self.client = client
        self.request = request
        self.argv = list(argv)
        self.options = options
        self.status = _Status(out)
        self.stop = asyncio.Event()
        self.stop_signal = signal.SIGTERM
        self.lease_ended = asyncio.Event()
        self.end_reason = ""
        self.warning: LeaseEnding | None = None
        self.warned = asyncio.Event()
        self.grant: AllocationGranted | None = None

    def on_event(self, event: TenantEvent) -> None:
        if event.job_id != self.request.job_id:
            return
        if isinstance(event, JobPending) and self.grant is None:
            self.status.waiting(event)
        # The job's lease events may arrive before ``wait_for_grant`` has resumed with the grant
        # (a short maximum run time is warned right away): they are the job's, whatever came first.
        elif isinstance(event, LeaseEnding) and self.warning is None:
            self.warning = event
            self.warned.set()
        elif isinstance(event, LeaseEnded):
            self.end_reason = event.reason.value + (f" ({event.detail})" if event.detail else "")
            self.lease_ended.set()

    def on_signal(self, signum: int) -> None:
        self.stop_signal = signal.Signals(signum)
        self.stop.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for signum in _STOP_SIGNALS:
            loop.add_signal_handler(signum, self.on_signal, signum)
        try:
            outcome = await self.wait_for_grant()
            if not isinstance(outcome, AllocationGranted):
                return outcome
            self.grant = outcome
            if self.stop.is_set():
                # Stopped while the request was on its way, or as the grant came: a command its
                # user has stopped is not started; the lease goes back at once.
                await self.release(outcome)
                self.status.done(f"stopped; {outcome.lease_id} released, CMD not started")
                return EXIT_INTERRUPTED
            # The lease's end on this process's clock, counted from the grant's arrival (later
            # than the ledger's start by the grant's delivery only; both ends of the granted
            # term are the ledger's, so no clock skew between the machines enters it).
            term = (outcome.expires_at - outcome.granted_at).total_seconds()
            return await self.run_command(outcome, loop.time() + term)
        finally:
            for signum in _STOP_SIGNALS:
                loop.remove_signal_handler(signum)

    async def wait_for_grant(self) -> AllocationGranted | int:
        reconnects = self.client.reconnects
        outcome = await self.client.submit_expecting(self.request)
        self.status.show()
        stopped = asyncio.ensure_future(self.stop.wait())
        try:
            while not outcome.done():
                waiters: set[asyncio.Future[Any]] = {outcome, stopped}
                await asyncio.wait(waiters, timeout=RECONNECT_CHECK_S)
                if stopped.done() and not outcome.done():
                    await self.cancel()
                    return EXIT_INTERRUPTED
                # The job's outcome may have gone out while the connection was down, and would
                # never come: asked for again.
                reconnects = await self.client.ask_again_if_reconnected(
                    self.request, outcome, reconnects
                )
                if not outcome.done():
                    self.status.show()
        finally:
            stopped.cancel()
        try:
            result = outcome.result()
        except OutcomeMissed as missed:
            job_id, how = self.request.job_id, missed.reply.detail
            self.status.done(f"{job_id} was over by the time the connection came back: {how}")
            return EXIT_NOT_GRANTED
        if isinstance(result, JobRejected):
            where = f" ({result.field_name})" if result.field_name else ""
            detail = f": {result.detail}" if result.detail else ""
            self.status.done(f"rejected: {result.reason.value}{where}{detail}")
            return EXIT_NOT_GRANTED
        if isinstance(result, JobCancelled):
            self.status.done(f"{self.request.job_id} was cancelled")
            return EXIT_NOT_GRANTED
        if isinstance(result, JobTimedOut):
            last = result.last_reason.value if result.last_reason else "unknown"
            self.status.done(f"timed out after {result.waited_s:.0f}s waiting ({last})")
            return EXIT_NOT_GRANTED
        devices = ", ".join(f"{s.node_id}/{s.device_id}" for s in result.slices) or "host only"
        self.status.done(f"granted {result.lease_id} on {devices}")
        return result

    async def run_command(self, grant: AllocationGranted, held_until: float) -> int:
        env = dict(os.environ)
        env.update(grant.env)
        env.update(XPUPOOL_JOB_ID=grant.job_id, XPUPOOL_LEASE_ID=grant.lease_id)
        terminal = _terminal()

        def into_own_group() -> None:
            os.setpgid(0, 0)
            if terminal is not None:
                _give_terminal(terminal, os.getpgrp())

        try:
            child = await asyncio.create_subprocess_exec(
                *self.argv, env=env, preexec_fn=into_own_group
            )
        except OSError as error:
            await self.release(grant)
            self.status.done(f"cannot start {self.argv[0]!r}: {error.strerror or error}")
            return 127 if isinstance(error, FileNotFoundError) else 126
        renewing = asyncio.ensure_future(self.renew_loop(grant, held_until))
        exited = asyncio.ensure_future(child.wait())
        try:
            return await self.supervise(grant, child, exited, renewing)
        finally:
            renewing.cancel()
            if terminal is not None:
                _give_terminal(terminal, os.getpgrp())

    async def supervise(
        self,
        grant: AllocationGranted,
        child: asyncio.subprocess.Process,
        exited: asyncio.Future[int],
        renewing: asyncio.Future[None],
    ) -> int:
        ended = asyncio.ensure_future(self.lease_ended.wait())
        try:
            while not exited.done():
                stopped = asyncio.ensure_future(self.stop.wait())
                warned = asyncio.ensure_future(self.warned.wait())
                waiters: set[asyncio.Future[Any]] = {exited, stopped, ended, warned}
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
                stopped.cancel()
                warned.cancel()
                if exited.done():
                    break
                if self.stop.is_set():
                    self.stop.clear()
                    _signal_group(child.pid, self.stop_signal)
                    continue
                if self.warned.is_set() and not self.lease_ended.is_set():
                    # Warned before the lease ends (maximum run time): CMD gets SIGTERM now and
                    # the time until the deadline to finish; the run counts as cut short.
                    self.warned.clear()
                    assert self.warning is not None
                    self.status.done(
                        f"lease {grant.lease_id} ends at {self.warning.deadline:%H:%M:%S} "
                        f"({self.warning.reason.value}); sending SIGTERM"
                    )
                    _signal_group(child.pid, signal.SIGTERM)
                    continue
                # The lease ended under CMD (or a renewal found it gone).
                self.status.done(f"lease {grant.lease_id} ended: {self.end_reason}; stopping")
                _signal_group(child.pid, signal.SIGTERM)
                try:
                    await asyncio.wait_for(asyncio.shield(exited), self.options.grace_s)
                except TimeoutError:
                    _signal_group(child.pid, signal.SIGKILL)
                    await exited
                return EXIT_LEASE_LOST
        finally:
            ended.cancel()
        renewing.cancel()
        code = _exit_code(exited.result())
        if not self.lease_ended.is_set():
            await self.release(grant)
        if self.warning is not None:
            self.status.done(f"stopped by {self.warning.reason.value} (command exited {code})")
            return EXIT_LEASE_LOST
        return code

    async def renew_loop(self, grant: AllocationGranted, held_until: float) -> None:
        """Renew every third of the term until cancelled; end the run when a renewal is
        refused, or when ``held_until`` (the lease's end on the loop's clock; after a renewal,
        counted from when it was sent, so never later than the ledger's) passes with no renewal
        answered: with NATS away no ``LeaseEnded`` can come, while the lease-manager ends the
        lease at its term all the same."""
        loop = asyncio.get_running_loop()
        term = self.request.lease_ttl_s
        every = self.options.renew_every_s or max(0.2, term / 3)
        while True:
            await asyncio.sleep(min(every, max(0.0, held_until - loop.time())))
            sent = loop.time()
            if sent >= held_until:
                self.end_reason = self.end_reason or "its term passed with no renewal answered"
                self.lease_ended.set()
                return
            try:
                # Bounded by the term: an answer after it would come too late to keep CMD on.
                reply = await asyncio.wait_for(
                    self.client.renew(grant.lease_id, grant.fencing_token, term),
                    held_until - sent,
                )
            except Exception as error:  # noqa: BLE001  (NATS away: retried while the term runs)
                if loop.time() < held_until:
                    self.status.done(f"renewal failed ({error!r}); retrying")
                continue
            if not reply.ok:
                refusal = reply.error.value if reply.error else "refused"
                self.end_reason = self.end_reason or f"renewal refused: {refusal}"
                self.lease_ended.set()
                return
            # The ledger renewed from when it ran the renewal, after it was sent.
            held_until = sent + term

    async def cancel(self) -> None:
        """Stopped before the grant: take the request back (a grant that raced the cancel is
        released by the scheduler)."""
        job_id = self.request.job_id
        try:
            reply = await self.client.cancel(job_id)
        except Exception as error:  # noqa: BLE001  (the request then waits; its grant expires)
            self.status.done(f"stopped; cancelling {job_id} failed ({error!r})")
            return
        if reply.ok and reply.outcome is CancelOutcome.CANCELLED:
            self.status.done(f"stopped; {job_id} cancelled")
        elif reply.ok:
            self.status.done(f"stopped; {job_id} was being granted, its lease is released")
        else:
            refusal = reply.error.value if reply.error else "refused"
            self.status.done(f"stopped; cancelling {job_id} refused: {refusal} {reply.detail}")

    async def release(self, grant: AllocationGranted) -> None:
        try:
            reply = await self.client.release(grant.lease_id, grant.fencing_token)
        except Exception as error:  # noqa: BLE001  (the lease then ends at its term)
            self.status.done(f"release failed ({error!r}); the lease ends at its term")
            return
        if not reply.ok and reply.error is not None:
            self.status.done(f"release refused: {reply.error.value}")


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


async def run_job(
    client: XpupoolClient,
    request: JobRequested,
    argv: Sequence[str],
    options: RunOptions | None = None,
    out: TextIO | None = None,
) -> int:
    """Run ``argv`` on a lease for ``request`` (see the module docstring); returns the exit
    code. ``client`` must be started (listening) and allowed to act for the request's tenant."""
    if not argv:
        raise ValueError("no command to run (xpupool run [options] -- CMD ARGS...)")
    run = _Run(client, request, argv, options or RunOptions(), out or sys.stderr)
    client.listen(run.on_event)
    return await run.run()
