"""A small asyncio client for upstream Python code, the CLI and the tests.

Other languages need only the AsyncAPI document in ``proto/``: this client does nothing a plain
NATS client could not.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import nats
from nats.aio.client import Client as Nats
from nats.aio.msg import Msg

from xpupool.bus.envelope import ce_headers
from xpupool.contracts import (
    AllocationGranted,
    JobRejected,
    JobRequested,
    JobTimedOut,
    LeaseEnded,
    LeaseReply,
    ReleaseLease,
    RenewLease,
    decoder_for,
    encode,
)
from xpupool.contracts import subjects as s

JobOutcome = AllocationGranted | JobRejected | JobTimedOut
_OUTCOME_DECODER = decoder_for((AllocationGranted, JobRejected, JobTimedOut))
_ENDED_DECODER = decoder_for((LeaseEnded,))
_REPLY_DECODER = decoder_for((LeaseReply,))


class XpupoolClient:
    """Submit jobs, wait for their outcome, renew and release leases."""

    def __init__(self, nc: Nats, source: str = "/clients/python") -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.source = source
        self._waiters: dict[str, asyncio.Future[JobOutcome]] = {}
        self._subscriptions: list[Any] = []

    async def start(self) -> None:
        """Listen for job outcomes (call before submitting, so no outcome is missed)."""
        for channel in (s.ALLOC_GRANTED, s.JOB_REJECTED, s.JOB_TIMED_OUT):
            self._subscriptions.append(
                await self.nc.subscribe(channel.address, cb=self._on_outcome)
            )

    async def _on_outcome(self, msg: Msg) -> None:
        try:
            outcome = _OUTCOME_DECODER.decode(msg.data)
        except msgspec.ValidationError:
            return
        waiter = self._waiters.get(outcome.job_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(outcome)

    def expect(self, job_id: str) -> asyncio.Future[JobOutcome]:
        """A future that resolves with the job's first outcome (granted, rejected, timed out)."""
        return self._waiters.setdefault(job_id, asyncio.get_running_loop().create_future())

    async def submit(self, request: JobRequested) -> None:
        """Publish a job request; ``Nats-Msg-Id = job_id`` makes a retried submit a no-op."""
        headers = ce_headers(JobRequested, self.source, event_id=request.job_id)
        await self.js.publish(s.JOB_REQUESTED.address, encode(request), headers=headers, timeout=5)

    async def submit_raw(self, payload: bytes, msg_id: str | None = None) -> None:
        """Publish arbitrary bytes as a job request (for tests of bad input)."""
        headers = {"Nats-Msg-Id": msg_id} if msg_id else None
        await self.js.publish(s.JOB_REQUESTED.address, payload, headers=headers, timeout=5)

    async def submit_and_wait(self, request: JobRequested, timeout_s: float = 30.0) -> JobOutcome:
        """Submit and wait for the first outcome."""
        future = self.expect(request.job_id)
        await self.submit(request)
        return await asyncio.wait_for(future, timeout_s)

    async def renew(self, lease_id: str, token: int, ttl_s: float | None = None) -> LeaseReply:
        """Renew a lease by request/reply."""
        reply = await self.nc.request(
            s.LEASE_RENEW.address,
            encode(RenewLease(lease_id=lease_id, fencing_token=token, ttl_s=ttl_s)),
            timeout=5,
        )
        result: LeaseReply = _REPLY_DECODER.decode(reply.data)
        return result

    async def release(self, lease_id: str, token: int) -> LeaseReply:
        """Release a lease by request/reply."""
        reply = await self.nc.request(
            s.LEASE_RELEASE.address,
            encode(ReleaseLease(lease_id=lease_id, fencing_token=token)),
            timeout=5,
        )
        result: LeaseReply = _REPLY_DECODER.decode(reply.data)
        return result

    async def close(self) -> None:
        """Stop listening."""
        for subscription in self._subscriptions:
            await subscription.unsubscribe()


@asynccontextmanager
async def connected(url: str) -> AsyncIterator[XpupoolClient]:
    """A started client on its own connection, drained on exit."""
    nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=5)
    client = XpupoolClient(nc)
    await client.start()
    try:
        yield client
    finally:
        await client.close()
        await nc.drain()


def decode_lease_ended(data: bytes) -> LeaseEnded:
    """Decode a lease-ended event."""
    ended: LeaseEnded = _ENDED_DECODER.decode(data)
    return ended
