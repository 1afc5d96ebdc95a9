"""End-to-end fixtures: wait for a stack to be ready and read its ledger."""

from __future__ import annotations

import asyncio
import os
import sys
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from redis.asyncio import Redis

from tests.conftest import eventually
from xpupool.bus import round_trip
from xpupool.contracts import (
    AllocationGranted,
    JobCancelled,
    JobPending,
    JobRejected,
    JobTimedOut,
    LeaseEnded,
    LeaseEnding,
    LeaseRenewed,
    decoder_for,
    subjects,
)
from xpupool.devstack.stack import Stack
from xpupool.ledger import Ledger

Ready = Callable[[Stack, int], Awaitable[Ledger]]


def cli_env(stack: Stack, tenant: str) -> dict[str, str]:
    """The environment an ``xpupool`` command of ``tenant`` needs on ``stack``: the URLs, and on
    a secure stack the tenant's credentials and CA."""
    env = dict(os.environ, XPUPOOL_TENANT=tenant)
    if stack.material is not None:
        env.update(stack.tenant_env(tenant))
    else:
        env.update(XPUPOOL_NATS_URL=stack.nats_url or "", XPUPOOL_REDIS_URL=stack.redis_url or "")
    return env


async def start_runner(stack: Stack, tenant: str, *args: str) -> asyncio.subprocess.Process:
    """``xpupool run ARGS`` as ``tenant`` on ``stack``, a process of its own, output piped."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "xpupool.cli.main",
        "run",
        *args,
        env=cli_env(stack, tenant),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


EventT = TypeVar("EventT")
Event = (
    AllocationGranted
    | LeaseEnded
    | LeaseRenewed
    | JobRejected
    | JobPending
    | JobTimedOut
    | JobCancelled
    | LeaseEnding
)


class EventLog:
    """Every event on the public job and allocation subjects, decoded, in arrival order."""

    SUBJECTS = (
        "xpupool.alloc.v1.>",
        "xpupool.jobs.v1.rejected",
        "xpupool.jobs.v1.pending",
        "xpupool.jobs.v1.timed_out",
        "xpupool.jobs.v1.cancelled",
    )

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.event_ids: list[str] = []  # each event's ce-id, in the same order
        self._decoder: Any = decoder_for(
            (
                AllocationGranted,
                LeaseEnded,
                LeaseRenewed,
                JobRejected,
                JobPending,
                JobTimedOut,
                JobCancelled,
                LeaseEnding,
            )
        )

    async def attach(self, nc: Client) -> None:
        """Start recording (before submitting, so nothing is missed)."""

        async def on_message(msg: Msg) -> None:
            self.events.append(self._decoder.decode(msg.data))
            self.event_ids.append((msg.headers or {}).get("ce-id", ""))

        for subject in self.SUBJECTS:
            await nc.subscribe(subject, cb=on_message)
        await round_trip(nc)  # recording once this returns, whichever connection submits

    def of(self, kind: type[EventT], job_id: str | None = None) -> list[EventT]:
        """The recorded events of one type, optionally of one job."""
        return [
            e for e in self.events if isinstance(e, kind) and (job_id is None or e.job_id == job_id)
        ]

    def distinct(self, kind: type[EventT]) -> list[EventT]:
        """The recorded events of one type, each event once: after a fault a core NATS
        subscriber may get an event twice, each copy with the same ce-id, and deduplicates by
        it (the promise of ``subjects.DELIVERY``)."""
        first: dict[str, EventT] = {}
        for event_id, event in zip(self.event_ids, self.events, strict=True):
            if isinstance(event, kind):
                assert event_id, f"an event without a ce-id: {event!r}"
                first.setdefault(event_id, event)
        return list(first.values())

    def copies_that_differ(self) -> list[str]:
        """The ce-ids that came with more than one payload: a copy must be the same event."""
        seen: dict[str, Event] = {}
        differ: list[str] = []
        for event_id, event in zip(self.event_ids, self.events, strict=True):
            if seen.setdefault(event_id, event) != event and event_id not in differ:
                differ.append(event_id)
        return differ

    def decided(self) -> set[str]:
        """Job ids that got a first outcome: granted, pending or rejected."""
        return {
            e.job_id
            for e in self.events
            if isinstance(e, AllocationGranted | JobPending | JobRejected)
        }


@pytest.fixture
async def ready() -> AsyncIterator[Ready]:
    """``await ready(stack, n)``: wait until ``n`` devices are registered; returns the ledger."""
    clients: list[Redis] = []

    async def wait(stack: Stack, devices: int) -> Ledger:
        assert stack.redis_url
        redis = Redis.from_url(stack.redis_url)
        clients.append(redis)
        ledger = Ledger(redis, stack.namespace)

        async def registered() -> bool:
            return sum(len(n.devices) for n in await ledger.nodes()) >= devices

        await eventually(registered)
        return ledger

    yield wait
    for redis in clients:
        await redis.aclose()


# The events that end a job or its lease.
Terminal = AllocationGranted | LeaseEnded | JobRejected | JobCancelled | JobTimedOut
_TERMINAL = decoder_for((AllocationGranted, LeaseEnded, JobRejected, JobCancelled, JobTimedOut))

async def stored_terminals(nc: Client, stream: subjects.Stream) -> list[tuple[str, Terminal]]:
    """The terminal job and lease events ``stream`` holds, with their ids, in stored order."""
    js = nc.jetstream()
    state = (await js.stream_info(stream.name)).state
    stored: list[tuple[str, Terminal]] = []
    for seq in range(state.first_seq, state.last_seq + 1):
        msg = await js.get_msg(stream.name, seq)
        try:
            event = _TERMINAL.decode(msg.data or b"")
        except msgspec.ValidationError:
            continue  # not a terminal event (pending, renewed, ...)
        stored.append(((msg.headers or {}).get("Nats-Msg-Id", ""), event))
    return stored


async def terminal_counts(nc: Client, job_id: str) -> dict[str, Counter[str]]:
    """For each stream, how many of each terminal event of ``job_id`` it stored."""
    counts: dict[str, Counter[str]] = {}
    for stream in (subjects.EVENTS_STREAM, subjects.TENANT_EVENTS_STREAM):
        counts[stream.name] = Counter(
            type(event).__name__
            for _, event in await stored_terminals(nc, stream)
            if event.job_id == job_id
        )
    return counts
