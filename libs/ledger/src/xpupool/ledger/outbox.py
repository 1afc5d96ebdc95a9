"""The outbox relay: publishes the events that ledger scripts queued in a Redis stream.

A script that changes state also XADDs an entry to its service's outbox in the same atomic step,
so an event can be late but never lost: a relay killed before publishing leaves the entry
pending, and the next relay publishes it: any relay of the group, running or starting, takes
the entries that stayed unacked for ``STALE_AFTER_MS`` (XAUTOCLAIM, looked for every few
seconds), and a relay restarted under the same name reads its own at once. The consumers of
relays that died or restarted are deleted from the group once they hold nothing and have been
idle that long (``reap_consumers.lua``): a group keeps about one consumer per live relay.
Events carry deterministic ids, so a republish is deduplicated by JetStream.

A batch of entries read together is sent back to back and its JetStream acknowledgements are
awaited together (one round trip per batch, not per event); only then are the entries acked and
deleted from the stream, with those of the batches that follow within ``BOOKKEEPING_LINGER_S``,
in one round trip. A failure anywhere leaves the entries not yet acked pending to be sent again:
a duplicate, never a loss.

A service that publishes an event itself, right after the script that queued it returned,
queues it in the direct outbox instead (``DirectOutbox``; the scheduler's grants on admission):
one hop less between the grant and its subscribers. It deletes the entry once JetStream stored
the event. The lease-manager's relay sweeps that outbox too, and publishes what stayed there
longer than ``DIRECT_STALE_MS`` (its writer died, or NATS did not answer it): late, never lost.

Each entry is relayed inside a span that continues the job's trace: the entry's own
``traceparent``/``tracestate`` when the script wrote them, else the ones its lease (or job) keeps
(``reserve.lua`` copies the job's onto the lease). A relay never starts a trace of its own for an
event of a traced job; an entry of an untraced job gets a root span.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import suppress
from typing import Any

import msgspec
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from redis.exceptions import ResponseError

from xpupool.ledger.ledger import DIRECT_OUTBOX, Ledger
from xpupool.obs import get_logger, spans_exported, start_current_span

# The events for each entry of a batch (a builder may read what they need in one round trip).
BuildEvents = Callable[[Sequence[dict[str, str]]], Awaitable[Sequence[Sequence[msgspec.Struct]]]]
BuildEntryEvents = Callable[[dict[str, str]], Awaitable[Sequence[msgspec.Struct]]]
# Hands one event to the bus and returns what is still to be awaited before it counts as stored
# (its JetStream acknowledgements): ``xpupool.bus.Publisher.send``.
Send = Callable[[msgspec.Struct], Awaitable[Sequence[Awaitable[Any]]]]
SEND_TIMEOUT_S = 5.0

DIRECT_STALE_MS = 10_000
"""How long a direct-outbox entry may wait for its writer before the relay publishes it: past the
writer's own publish timeout (``SEND_TIMEOUT_S``), well inside JetStream's duplicate window (two
minutes), which drops the copy should the writer's event have been stored after all."""
SWEEP_INTERVAL_S = 1.0

BOOKKEEPING_LINGER_S = 0.05
"""How long a relay or the direct outbox may hold the ids of entries whose events JetStream
stored before deleting them (and, for a relay, acking them) in one command: the ledger fsyncs
every write, and at a few jobs per batch a deletion per batch was one more fsync per job. Held
ids are only ever published again (a relay's restart re-reads them, the sweep takes direct
entries after ``DIRECT_STALE_MS``), and JetStream drops those copies."""
BOOKKEEPING_BATCH = 256
"""Deleted at once when this many are held, however young."""

GROUP = "relay"
# Entry fields that name what an event is about, as span attributes operators search by.
_IDS = ("job_id", "lease_id", "node_id")
STALE_AFTER_MS = 15_000
"""How long an entry read by a relay may stay unacked before another relay of the group takes
it: its holder died (a process that restarts names itself anew, so only a peer takes them)."""


def each_entry(build: BuildEntryEvents) -> BuildEvents:
    """A batch builder that builds entry by entry (for outboxes with no shared reads)."""

    async def build_batch(entries: Sequence[dict[str, str]]) -> list[Sequence[msgspec.Struct]]:
        return [await build(fields) for fields in entries]

    return build_batch


class OutboxRelay:
    """Relays one service's outbox stream to NATS."""

    def __init__(
        self,
        ledger: Ledger,
        service: str,
        build_events: BuildEvents,
        send: Send,
        consumer: str | None = None,
        sweep_direct: bool = False,
        direct_stale_ms: int = DIRECT_STALE_MS,
        linger_s: float = BOOKKEEPING_LINGER_S,
        stale_after_ms: int = STALE_AFTER_MS,
    ) -> None:
        self._ledger = ledger
        self._linger_s = linger_s
        self._stale_after_ms = stale_after_ms
        # Looked for a few times per stale period: a dead peer's entries go out at most a third
        # of it late.
        self._claim_every_s = stale_after_ms / 3000
        self._stream = ledger.key("outbox", service)
        self._direct = ledger.key("outbox", DIRECT_OUTBOX) if sweep_direct else None
        self._direct_stale_ms = direct_stale_ms
        self._swept_at = 0.0
        self._build_events = build_events
        self._send = send
        self._consumer = consumer or f"{socket.gethostname()}-{id(self):x}"
        self._log = get_logger().bind(outbox=service)
        self._service = service
        self._tracer = trace.get_tracer("xpupool.ledger")
        self._reap_failing = False  # the last reaping failed (and was logged)

    @property
    def consumer(self) -> str:
        """This relay's name in its consumer group."""
        return self._consumer

    async def run(self, stop: asyncio.Event) -> None:
        """Relay until ``stop`` is set; transient failures are retried, never fatal.

        The entries of the batches JetStream stored are acked and deleted together, at most
        ``BOOKKEEPING_LINGER_S`` after the first of them (or per ``BOOKKEEPING_BATCH``): until
        then they are pending in the group, so a restart publishes them again, a duplicate."""
        grouped = False  # the consumer group is made once Redis answers (it may be away now)
        backlog = True  # first drain what this consumer was given before a restart
        published: list[str] = []  # stored by JetStream, not yet acked
        ack_by = 0.0  # monotonic time by which they are acked
        claimed_at = time.monotonic()  # when stale entries of the group were last taken
        while not stop.is_set():
            try:
                if not grouped:
                    await self._ensure_group()
                    grouped = True
                if backlog:
                    entries = await self._claim_stale()
                    entries += await self._read("0")
                    backlog = False
                    claimed_at = time.monotonic()
                else:
                    # Awake in time to ack what it holds (a block of 0 would wait forever).
                    due_ms = int(1000 * (ack_by - time.monotonic())) if published else 500
                    entries = await self._read(">", block_ms=max(1, min(500, due_ms)))
                    # A peer that died holding entries left them pending under its name.
                    if time.monotonic() - claimed_at >= self._claim_every_s:
                        entries += await self._claim_stale()
                        claimed_at = time.monotonic()
                        await self._reap_consumers()
                # Entries taken from a peer were queued before those just read: a batch goes
                # out in the order the ledger queued it, so a lease's grant taken from a dead
                # peer is not published after its end read in the same turn (``build_events``
                # waits only for grants outside the batch).
                entries.sort(key=_stream_order)
                if self._direct is not None and time.monotonic() - self._swept_at >= (
                    SWEEP_INTERVAL_S
                ):
                    await self._sweep_direct(self._direct)
                if entries:
                    await self._publish(entries)
                    if not published:
                        ack_by = time.monotonic() + self._linger_s
                    published += [entry_id for entry_id, _ in entries]
                if published and (
                    time.monotonic() >= ack_by or len(published) >= BOOKKEEPING_BATCH
                ):
                    await self._ack(published)
                    published = []
            except asyncio.CancelledError:
                raise
            except Exception as error:  # noqa: BLE001  (Redis or NATS down: retry the backlog)
                self._log.warning("outbox_relay_retrying", error=repr(error))
                backlog = True  # what was published and not acked is read again from "0"
                published = []
                await asyncio.sleep(0.5)
                if "NOGROUP" in repr(error):
                    grouped = False  # Redis lost the group (a flush, a restart): make it again
        if published:
            with suppress(Exception):  # left pending: the next relay publishes them again
                await self._ack(published)

    async def _ack(self, ids: Sequence[str]) -> None:
        """Ack and delete relayed entries in one round trip."""
        async with self._ledger.redis.pipeline(transaction=False) as pipe:
            pipe.xack(self._stream, GROUP, *ids)
            pipe.xdel(self._stream, *ids)
            await pipe.execute()

    async def _publish(self, entries: Sequence[tuple[str, dict[str, str]]]) -> None:
        """Send a batch's events and wait until JetStream stored them all."""
        built = await self._build_events([fields for _, fields in entries])
        acks: list[Awaitable[Any]] = []
        for (_, fields), events in zip(entries, built, strict=True):
            acks += await self._relay(fields, events)
        # Still pending after the timeout: cancelled, and the batch is sent again.
        await asyncio.wait_for(asyncio.gather(*acks), SEND_TIMEOUT_S)

    async def _sweep_direct(self, stream: str) -> None:
        """Publish (then delete) the direct-outbox entries their writers left behind."""
        now_ms = await self._ledger.now_ms()
        reply: Any = await self._ledger.redis.xrange(
            stream, "-", str(now_ms - self._direct_stale_ms), count=100
        )
        entries = [(_s(i), _fields(f)) for i, f in reply or [] if f]
        if entries:
            self._log.warning("direct_outbox_swept", entries=len(entries))
            await self._publish(entries)
            await self._ledger.redis.xdel(stream, *(entry_id for entry_id, _ in entries))
        self._swept_at = time.monotonic()

    async def _relay(
        self, fields: dict[str, str], events: Sequence[msgspec.Struct]
    ) -> list[Awaitable[Any]]:
        """Send one entry's events under the trace of the job the entry is about; returns their
        pending acknowledgements."""
        kind = fields.get("kind", "")
        with start_current_span(
            self._tracer,
            f"relay {kind}",
            context=await self._trace_context(fields),
            attributes=lambda: (
                {"xpupool.outbox": self._service, "xpupool.outbox.kind": kind}
                | {f"xpupool.{name}": fields[name] for name in _IDS if fields.get(name)}
            ),
        ):
            acks: list[Awaitable[Any]] = []
            for event in events:
                acks += await self._send(event)
            return acks

    async def _trace_context(self, fields: dict[str, str]) -> Context:
        if fields.get("traceparent"):
            return propagate.extract(fields)
        if not spans_exported():
            # No span goes anywhere: two ledger reads per entry (a job that came without trace
            # context has none to find) would buy nothing.
            return Context()
        for kind in ("lease", "job"):
            record_id = fields.get(f"{kind}_id")
            if record_id:
                carrier = await self._ledger.trace_of(kind, record_id)
                if carrier:
                    return propagate.extract(carrier)
        return Context()  # untraced: a root, never the relay loop's own context

    async def _ensure_group(self) -> None:
        try:
            await self._ledger.redis.xgroup_create(self._stream, GROUP, id="0", mkstream=True)
        except ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise

    async def _read(
        self, start: str, block_ms: int | None = None
    ) -> list[tuple[str, dict[str, str]]]:
        reply: Any = await self._ledger.redis.xreadgroup(
            GROUP, self._consumer, {self._stream: start}, count=100, block=block_ms
        )
        return [(_s(i), _fields(f)) for _, entries in (reply or []) for i, f in entries if f]

    async def _reap_consumers(self) -> None:
        """Delete the group's consumers that hold nothing and have been idle past the stale
        period (the names of relays that died or restarted; ``Ledger.reap_relay_consumers``).
        A failure here never holds up relaying: it is tried again at the next claim, and logged
        once until it succeeds (a role whose ACL predates the script is refused every time)."""
        try:
            reaped = await self._ledger.reap_relay_consumers(
                self._service, GROUP, self._consumer, self._stale_after_ms
            )
        except Exception as error:  # noqa: BLE001  (tried again at the next claim)
            if not self._reap_failing:
                self._log.warning("relay_consumers_not_reaped", error=repr(error))
            self._reap_failing = True
            return
        self._reap_failing = False
        if reaped:
            self._log.info("relay_consumers_reaped", consumers=reaped)

    async def _claim_stale(self) -> list[tuple[str, dict[str, str]]]:
        reply: Any = await self._ledger.redis.xautoclaim(
            self._stream,
            GROUP,
            self._consumer,
            min_idle_time=self._stale_after_ms,
            start_id="0",
            count=100,
        )
        return [(_s(i), _fields(f)) for i, f in reply[1] if f]


def _acknowledged(ack: asyncio.Future[Any]) -> bool:
    """Whether a JetStream acknowledgement came back without error (retrieving the error, so
    that none is reported as never retrieved)."""
    return ack.done() and not ack.cancelled() and ack.exception() is None


def _stream_order(entry: tuple[str, dict[str, str]]) -> tuple[int, int]:
    """Where an entry stands in its stream: its id, ``<ms>-<seq>``, as numbers."""
    ms, _, seq = entry[0].partition("-")
    return int(ms), int(seq or 0)


def _s(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _fields(raw: dict[Any, Any]) -> dict[str, str]:
    return {_s(k): _s(v) for k, v in raw.items()}


class DirectOutbox:
    """Publishes the events of the direct-outbox entries its own service's scripts just wrote,
    and confirms (deletes) each entry once JetStream stored its events.

    ``publish`` hands the events to the connection at once; ``run``, alive while the bus is
    open, awaits their acknowledgements in the background and confirms the stored entries in one
    command at most every ``BOOKKEEPING_LINGER_S`` (or per ``BOOKKEEPING_BATCH``). Without a
    bus, or when NATS does not acknowledge, the entry stays: the lease-manager's relay publishes
    it after ``DIRECT_STALE_MS``.
    """

    def __init__(self, ledger: Ledger, linger_s: float = BOOKKEEPING_LINGER_S) -> None:
        self._ledger = ledger
        self._send: Send | None = None
        self._sent: list[tuple[str, Sequence[Awaitable[Any]]]] = []
        self._stored: list[str] = []  # entries JetStream stored, not yet deleted
        self._delete_by = 0.0  # loop time by which they are deleted
        self._linger_s = linger_s
        self._wake = asyncio.Event()
        self._log = get_logger().bind(outbox=DIRECT_OUTBOX)

    async def publish(self, entry_id: str, events: Sequence[msgspec.Struct]) -> None:
        """Send one entry's events now (they are confirmed in the background)."""
        if self._send is None:
            return  # no bus now: the relay's sweep publishes them
        acks: list[Awaitable[Any]] = []
        try:
            for event in events:
                acks += await self._send(event)
        except Exception as error:  # noqa: BLE001  (committed already: the sweep publishes it)
            self._log.warning("direct_publish_failed", entry=entry_id, error=repr(error))
            return
        self._sent.append((entry_id, acks))
        self._wake.set()

    async def run(self, send: Send, stop: asyncio.Event) -> None:
        """Publish with ``send`` and confirm what JetStream stored, until ``stop``."""
        self._send = send
        loop = asyncio.get_running_loop()
        # A stop wakes the loop at once, so what it holds is deleted before the bus closes.
        waker = asyncio.create_task(self._wake_on(stop))
        try:
            while not stop.is_set():
                wait_s = SWEEP_INTERVAL_S
                if self._stored:
                    wait_s = max(0.0, self._delete_by - loop.time())
                with suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait_s)
                if self._wake.is_set():
                    self._wake.clear()
                    await self._await_stored()
                if self._stored and (
                    loop.time() >= self._delete_by or len(self._stored) >= BOOKKEEPING_BATCH
                ):
                    await self._confirm()
            await self._confirm()  # a clean stop leaves nothing stored behind
        finally:
            waker.cancel()
            self._send = None
            if self._sent or self._stored:
                # Stored or not, the sweep publishes them (JetStream drops copies).
                self._log.info("direct_left_to_sweep", entries=len(self._sent) + len(self._stored))
                self._sent, self._stored = [], []

    async def _wake_on(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self._wake.set()

    async def _await_stored(self) -> None:
        """Wait (at most ``SEND_TIMEOUT_S``) for the acknowledgements of what was sent, all in
        one wait: no task or timer per entry. An entry counts as stored when every one of its
        acknowledgements came back without error; one still pending is cancelled (which frees
        its slot in the connection's window) and its entry left to the sweep."""
        sent, self._sent = self._sent, []
        futures = [[asyncio.ensure_future(ack) for ack in acks] for _, acks in sent]
        pending = {future for entry_futures in futures for future in entry_futures}
        if pending:
            _, late = await asyncio.wait(pending, timeout=SEND_TIMEOUT_S)
            for future in late:
                future.cancel()
        confirmed = [
            entry
            for (entry, _), entry_futures in zip(sent, futures, strict=True)
            if all(map(_acknowledged, entry_futures))
        ]
        if len(confirmed) < len(sent):
            self._log.warning("direct_publish_unconfirmed", entries=len(sent) - len(confirmed))
        if confirmed and not self._stored:
            self._delete_by = asyncio.get_running_loop().time() + self._linger_s
        self._stored += confirmed

    async def _confirm(self) -> None:
        stored, self._stored = self._stored, []
        try:
            await self._ledger.confirm_direct(stored)
        except Exception as error:  # noqa: BLE001  (the sweep publishes them again: a duplicate)
            self._log.warning("direct_confirm_failed", error=repr(error))
