"""A small asyncio client for upstream Python code, the CLI and the tests.

Other languages need only the AsyncAPI document in ``proto/``: this client does nothing a plain
NATS client could not.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from typing import Any

import msgspec
from nats.aio.client import Client as Nats
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError
from opentelemetry import propagate

from xpupool.bus.connection import connect_client, round_trip
from xpupool.bus.envelope import ce_headers
from xpupool.contracts import (
    AllocationGranted,
    CancelJob,
    CancelReply,
    GetLease,
    JobCancelled,
    JobList,
    JobPending,
    JobRejected,
    JobRequested,
    JobState,
    JobTimedOut,
    LeaseEnded,
    LeaseEnding,
    LeaseList,
    LeaseRenewed,
    LeaseReply,
    ListJobs,
    ListLeases,
    ReleaseLease,
    RenewLease,
    SubmitOutcome,
    SubmitReply,
    decoder_for,
    encode_finite,
)
from xpupool.contracts import subjects as s
from xpupool.contracts.access import tenant_inbox

JobOutcome = AllocationGranted | JobRejected | JobTimedOut | JobCancelled
TenantEvent = JobOutcome | JobPending | LeaseRenewed | LeaseEnding | LeaseEnded
_EVENT_DECODER = decoder_for(
    (
        AllocationGranted,
        JobRejected,
        JobTimedOut,
        JobCancelled,
        JobPending,
        LeaseRenewed,
        LeaseEnding,
        LeaseEnded,
    )
)
_CANCEL_DECODER = decoder_for((CancelReply,))
_JOBS_DECODER = decoder_for((JobList,))
_LEASES_DECODER = decoder_for((LeaseList,))
_ENDED_DECODER = decoder_for((LeaseEnded,))
_REPLY_DECODER = decoder_for((LeaseReply,))
_SUBMIT_DECODER = decoder_for((SubmitReply,))

RECONNECT_CHECK_S = 1.0
"""How often a client waiting for a job's outcome looks whether its connection was made again
meanwhile (``XpupoolClient.ask_again_if_reconnected``)."""

_OVER = frozenset({JobState.ENDED, JobState.REJECTED, JobState.TIMED_OUT, JobState.CANCELLED})


class OutcomeMissed(Exception):
    """A job's outcome went out while this client's connection was down (core NATS keeps nothing
    for a subscriber while it is away), and the job is over by now: ``reply`` (a ``known``
    answer) says how it ended. A job whose lease is still live is answered with its grant
    instead, never with this."""

    def __init__(self, reply: SubmitReply) -> None:
        super().__init__(f"job {reply.job_id} is over ({reply.state}): {reply.detail}")
        self.reply = reply


KNOWN_SECRETS = 100_000
"""How many leases' secrets a client keeps for ``renew`` and ``release`` called without one: the
last this many grants it saw, the oldest forgotten first, so that a long-running client (a
gateway submitting for hours) does not grow without bound. A secret is not dropped when its
lease ends or is released: a holder that renews or releases again still hears the service's
answer (``lease_ended``). A caller holding more live leases than this passes the grant's secret
itself."""


class XpupoolClient:
    """Submit jobs as a tenant, wait for their outcome, renew and release leases.

    A client of one ``tenant`` uses only that tenant's subjects (what its credentials allow). A
    client without a tenant (insecure development stacks, tests, operator tools) listens to
    every tenant's events and submits each request on the subject of the tenant it names.
    """

    def __init__(
        self,
        nc: Nats,
        tenant: str | None = None,
        source: str = "/clients/python",
        request_timeout_s: float = 5.0,
        known_secrets: int = KNOWN_SECRETS,
    ) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.tenant = tenant
        self.source = source
        self.request_timeout_s = request_timeout_s
        self._waiters: dict[str, asyncio.Future[JobOutcome]] = {}
        # Lease id -> (secret, tenant) of the last grants seen (``KNOWN_SECRETS``), oldest first.
        self._secrets: dict[str, tuple[str, str]] = {}
        self._known_secrets = known_secrets
        self._listeners: list[Callable[[TenantEvent], None]] = []
        self._subscriptions: list[Any] = []

    def _space(self, tenant: str | None) -> str:
        name = tenant or self.tenant
        if not name:
            raise ValueError("no tenant: give the client one, or name it in the request")
        return name

    async def start(self) -> None:
        """Listen for the tenant's events (call before submitting, so no outcome is missed)."""
        events = f"{s.TENANT_SPACE}.{self.tenant or '*'}.events.>"
        self._subscriptions.append(await self.nc.subscribe(events, cb=self._on_event))
        await round_trip(self.nc)  # listening once this returns, even for a request sent elsewhere

    @property
    def reconnects(self) -> int:
        """How often the connection was made again since it opened: core NATS keeps nothing for
        a subscriber while it is away, so an event published then never reaches this client:
        a job waited for across a reconnect is asked about again
        (``ask_again_if_reconnected``)."""
        count: int = self.nc.stats["reconnects"]
        return count

    async def ask_again_if_reconnected(
        self, request: JobRequested, outcome: asyncio.Future[JobOutcome], reconnects: int
    ) -> int:
        """Where the connection was made again since ``reconnects`` (what ``reconnects`` read
        before ``request`` was submitted), ask about the job again (``submit_request``, the same
        request: the ledger keeps one job per id) and settle ``outcome`` from the answer: a job
        placed or refused meanwhile is answered with its grant or rejection, one that is over
        by now with ``OutcomeMissed``. Returns the count to pass next time: the one asked at,
        or the old one while no scheduler answered (to ask again at the next check)."""
        now = self.reconnects
        if outcome.done() or now == reconnects:
            return reconnects
        reply = await self.submit_request(request)
        if reply is None:
            return reconnects
        if not outcome.done():
            answered = reply.granted or reply.rejected
            if answered is not None:
                outcome.set_result(answered)
            elif reply.outcome is SubmitOutcome.KNOWN and reply.state in _OVER:
                outcome.set_exception(OutcomeMissed(reply))
        return now

    def listen(self, listener: Callable[[TenantEvent], None]) -> None:
        """Call ``listener`` with every tenant event this client receives."""
        self._listeners.append(listener)

    async def _on_event(self, msg: Msg) -> None:
        try:
            event = _EVENT_DECODER.decode(msg.data)
        except msgspec.ValidationError:
            return
        if isinstance(event, AllocationGranted):
            self._remember(event)
        for listener in self._listeners:
            listener(event)
        if isinstance(event, AllocationGranted | JobRejected | JobTimedOut | JobCancelled):
            waiter = self._waiters.get(event.job_id)
            if waiter is not None and not waiter.done():
                waiter.set_result(event)

    def expect(self, job_id: str) -> asyncio.Future[JobOutcome]:
        """A future that resolves with the job's first outcome (granted, rejected, timed out,
        cancelled)."""
        return self._waiters.setdefault(job_id, asyncio.get_running_loop().create_future())

    def _job_message(self, channel: s.Channel, request: JobRequested) -> tuple[str, dict[str, str]]:
        """A job request's subject on ``channel`` and its headers."""
        # A tenant's client always sends in its own space; the scheduler rejects a payload that
        # names another tenant (tenant_mismatch).
        subject = channel.subject(tenant=self.tenant or self._space(request.tenant))
        headers = ce_headers(JobRequested, self.source, event_id=request.job_id)
        # The caller's trace (if any) is the job's: every step of the job continues it.
        propagate.inject(headers)
        return subject, headers

    async def submit(self, request: JobRequested) -> None:
        """Publish a job request on the client's tenant subject (a tenant-less client: the
        request's tenant). Sending the same request again is a no-op: the ledger keeps one job
        per job id, and the same request again gets no second outcome."""
        subject, headers = self._job_message(s.JOB_REQUESTED, request)
        await self.js.publish(subject, encode_finite(request), headers=headers, timeout=5)

    async def submit_raw(
        self, payload: bytes, msg_id: str | None = None, tenant: str | None = None
    ) -> None:
        """Publish arbitrary bytes as a job request (for tests of bad input)."""
        headers = {"Nats-Msg-Id": msg_id} if msg_id else None
        subject = s.JOB_REQUESTED.subject(tenant=self._space(tenant))
        await self.js.publish(subject, payload, headers=headers, timeout=5)

    async def submit_request(self, request: JobRequested) -> SubmitReply | None:
        """Submit by request/reply (``jobs.submit``): where the job stands once the ledger has it
        (granted, with the grant; waiting; rejected, with why). None when no scheduler answered
        within ``request_timeout_s`` (none serves the subject, or a reply was lost): the request
        may or may not have been admitted, and sending it again, by either subject, is safe
        (the ledger deduplicates by job id)."""
        subject, headers = self._job_message(s.JOB_SUBMIT, request)
        try:
            msg = await self.nc.request(
                subject, encode_finite(request), timeout=self.request_timeout_s, headers=headers
            )
            reply: SubmitReply = _SUBMIT_DECODER.decode(msg.data)
        except (NoRespondersError, NatsTimeoutError, msgspec.DecodeError):
            # No scheduler, none in time, or a service error's empty body: the request may
            # not have been admitted.
            return None
        if reply.granted is not None:
            # Known before its event arrives: a release right after the reply finds the secret.
            self._remember(reply.granted)
        return reply

    async def submit_expecting(
        self, request: JobRequested, *, by_request: bool = True
    ) -> asyncio.Future[JobOutcome]:
        """Submit and return the future of the job's first outcome (``expect``).

        By request/reply (``submit_request``) a job placed or refused on arrival settles the
        future at once; one that waits, or whose reply did not come, settles it from the
        tenant's events, and a request no scheduler answered is published on the stream
        (``submit``) as well, where it waits for one. ``by_request=False``: on the stream only.
        """
        future = self.expect(request.job_id)
        reply = await self.submit_request(request) if by_request else None
        outcome: JobOutcome | None = None
        if reply is not None:
            outcome = reply.granted or reply.rejected
        if outcome is not None:
            if not future.done():
                future.set_result(outcome)
        elif reply is None:
            await self.submit(request)
        return future

    async def submit_and_wait(
        self, request: JobRequested, timeout_s: float = 30.0, *, by_request: bool = True
    ) -> JobOutcome:
        """Submit (``submit_expecting``) and wait for the first outcome; ``TimeoutError`` after
        ``timeout_s``. An outcome missed while the connection was down is asked for again
        (``ask_again_if_reconnected``): ``OutcomeMissed`` when the job is over by then."""
        reconnects = self.reconnects
        try:
            future = await self.submit_expecting(request, by_request=by_request)
            if future.done():
                # Placed or refused on arrival (or its event came first): no timer, and no
                # turn of the loop for the waiting, on the path every such job takes.
                return future.result()
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while not future.done():
                left = deadline - loop.time()
                if left <= 0:
                    raise TimeoutError(f"no outcome for job {request.job_id} in {timeout_s} s")
                await asyncio.wait({future}, timeout=min(left, RECONNECT_CHECK_S))
                reconnects = await self.ask_again_if_reconnected(request, future, reconnects)
            return future.result()
        finally:
            self._waiters.pop(request.job_id, None)

    def _remember(self, grant: AllocationGranted) -> None:
        """Keep a grant's secret and tenant for its holder's commands (``KNOWN_SECRETS``, oldest
        out); a copy without the secret (an operator's) does not replace one with it."""
        known = self._secrets.get(grant.lease_id)
        self._secrets[grant.lease_id] = (
            grant.lease_secret or (known[0] if known else ""),
            grant.tenant,
        )
        while len(self._secrets) > self._known_secrets:
            del self._secrets[next(iter(self._secrets))]

    def _holder(self, lease_id: str, secret: str | None, tenant: str | None) -> tuple[str, str]:
        known = self._secrets.get(lease_id)
        secret = secret or (known[0] if known else None)
        if not secret:
            raise ValueError(f"no lease secret known for {lease_id}: pass the grant's secret")
        return secret, self._space(tenant or (known[1] if known else None))

    async def _request(
        self, subject: str, command: msgspec.Struct, headers: dict[str, str] | None = None
    ) -> Msg:
        """One request/reply within ``request_timeout_s``.

        "No responders" means the server found nobody subscribed (a lease-manager or scheduler
        restarting, or not up yet): the command reached no service, so sending it again is
        safe, and it is sent again until the deadline rather than failing a renewal or a
        release over a service's restart. A timeout is not retried: that request may have run.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.request_timeout_s
        payload, pause = encode_finite(command), 0.02
        while True:
            try:
                return await self.nc.request(
                    subject, payload, timeout=max(0.01, deadline - loop.time()), headers=headers
                )
            except NoRespondersError:
                if loop.time() + pause >= deadline:
                    raise
                await asyncio.sleep(pause)
                pause = min(2 * pause, 0.5)

    async def _lease_request(self, subject: str, command: msgspec.Struct) -> LeaseReply:
        headers: dict[str, str] = {}
        propagate.inject(headers)  # the caller's trace; the lease manager links it to the job's
        reply = await self._request(subject, command, headers or None)
        result: LeaseReply = _REPLY_DECODER.decode(reply.data)
        return result

    async def renew(
        self,
        lease_id: str,
        token: int,
        ttl_s: float | None = None,
        *,
        secret: str | None = None,
        tenant: str | None = None,
    ) -> LeaseReply:
        """Renew a lease by request/reply (the secret of a grant this client saw is used
        unless one is given). A ``ttl_s`` that is no finite number is refused with a
        ``ValueError``, as every number this client sends (``encode_finite``): JSON has no NaN
        or infinity, and as ``null`` it would renew for the lease's own term."""
        secret, owner = self._holder(lease_id, secret, tenant)
        command = RenewLease(
            lease_id=lease_id, lease_secret=secret, fencing_token=token, ttl_s=ttl_s
        )
        return await self._lease_request(s.LEASE_RENEW.subject(tenant=owner), command)

    async def release(
        self, lease_id: str, token: int, *, secret: str | None = None, tenant: str | None = None
    ) -> LeaseReply:
        """Release a lease by request/reply."""
        secret, owner = self._holder(lease_id, secret, tenant)
        command = ReleaseLease(lease_id=lease_id, lease_secret=secret, fencing_token=token)
        return await self._lease_request(s.LEASE_RELEASE.subject(tenant=owner), command)

    async def cancel(self, job_id: str, *, tenant: str | None = None) -> CancelReply:
        """Cancel a job by request/reply: a waiting one ends ``JobCancelled``, a granted one's
        lease ends ``released``."""
        subject = s.JOB_CANCEL.subject(tenant=self.tenant or self._space(tenant))
        reply = await self._request(subject, CancelJob(job_id=job_id))
        result: CancelReply = _CANCEL_DECODER.decode(reply.data)
        return result

    async def _query(self, subject: str, command: msgspec.Struct) -> bytes:
        reply = await self._request(subject, command)
        data: bytes = reply.data
        return data

    async def jobs(self, limit: int = 50, *, tenant: str | None = None) -> JobList:
        """The tenant's latest jobs, newest first, with their state and why they wait."""
        subject = s.JOB_LIST.subject(tenant=self.tenant or self._space(tenant))
        result: JobList = _JOBS_DECODER.decode(await self._query(subject, ListJobs(limit=limit)))
        return result

    async def leases(self, limit: int = 50, *, tenant: str | None = None) -> LeaseList:
        """The tenant's live leases, newest first (no secrets)."""
        subject = s.LEASE_LIST.subject(tenant=self.tenant or self._space(tenant))
        data = await self._query(subject, ListLeases(limit=limit))
        result: LeaseList = _LEASES_DECODER.decode(data)
        return result

    async def lease(self, lease_id: str, *, tenant: str | None = None) -> LeaseList:
        """One of the tenant's leases by id (``error: unknown_lease`` if it is not one)."""
        subject = s.LEASE_GET.subject(tenant=self.tenant or self._space(tenant))
        data = await self._query(subject, GetLease(lease_id=lease_id))
        result: LeaseList = _LEASES_DECODER.decode(data)
        return result

    async def close(self) -> None:
        """Stop listening."""
        for subscription in self._subscriptions:
            await subscription.unsubscribe()


@asynccontextmanager
async def connected(
    url: str,
    tenant: str | None = None,
    *,
    creds: str | None = None,
    tls_ca: str | None = None,
    max_reconnect_attempts: int = 5,
) -> AsyncIterator[XpupoolClient]:
    """A started client on its own connection (as ``tenant``, with its credentials), drained on
    exit; closed instead when NATS is away then, so that the body's own result (a command's
    exit code) is not replaced by the connection's error. ``max_reconnect_attempts``: how often
    a lost connection is tried again before the client gives up (-1: as long as it lives)."""
    nc = await connect_client(
        url,
        name=f"xpupool-client-{tenant or 'any'}",
        creds=creds,
        tls_ca=tls_ca,
        inbox_prefix=tenant_inbox(tenant) if tenant else None,
        max_reconnect_attempts=max_reconnect_attempts,
    )
    client = XpupoolClient(nc, tenant)
    await client.start()
    try:
        yield client
    finally:
        if nc.is_connected:
            await client.close()
            await nc.drain()
        else:
            # Reconnecting or given up: there is nothing to drain to (drain() raises then), and
            # nats-py's close writes what was buffered meanwhile to the lost socket, which raises
            # once the connection is marked closed: nothing is left to lose.
            with suppress(OSError):
                await nc.close()


def decode_lease_ended(data: bytes) -> LeaseEnded:
    """Decode a lease-ended event."""
    ended: LeaseEnded = _ENDED_DECODER.decode(data)
    return ended
