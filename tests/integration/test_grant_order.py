"""A lease's later events are never stored ahead of its grant, on a real nats-server and Redis.

The scheduler answers a grant made on admission before it publishes the grant's event, so a
holder may renew or release before JetStream has the grant. Here the scheduler's publish is
held back on purpose (a stalled scheduler) while the holder acts, or while the control plane
ends the lease: the lease-manager's event waits until the grant is stored; when the grant never
comes, a copy of it goes first (and the scheduler's own, should it come late, is dropped by
JetStream as a duplicate).
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import msgspec
import nats
import pytest
from nats.aio.client import Client

from tests.conftest import eventually
from tests.integration.ledger_builders import (
    LEASE_EVENTS,
    LeaseEvent,
    device_spec,
    direct_entries,
    reservation,
    running_direct_outbox,
    stored_lease_events,
)
from xpupool.bus import Publisher, ensure_streams
from xpupool.contracts import (
    AllocationGranted,
    LeaseEnded,
    LeaseRenewed,
    ReleaseLease,
    RenewLease,
    subjects,
)
from xpupool.devstack.servers import NatsServer
from xpupool.lease_manager.grant_watch import StoredGrants
from xpupool.lease_manager.handlers import build_events, release_lease, renew_lease
from xpupool.lease_manager.metrics import LeaseManagerMetrics
from xpupool.ledger import (
    Admission,
    DirectOutbox,
    Holder,
    LeaseRecord,
    Ledger,
    OutboxRelay,
    SliceClaim,
    new_lease_secret,
)
from xpupool.ledger.events import granted_event
from xpupool.ledger.outbox import Send

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


async def _granted_unconfirmed(
    ledger: Ledger, job: str = "a", device: int = 0
) -> tuple[Holder, LeaseRecord, str]:
    """A lease granted on admission whose grant entry nobody has confirmed yet (the scheduler
    answered and then stalled before publishing), its holder and the entry."""
    devices = [device_spec("n1", i) for i in range(4)]
    if device == 0:
        assert (await ledger.register_node("n1", devices, 64_000, 256_000)).ok
    secret = new_lease_secret()
    placement = reservation(job, SliceClaim(f"n1/nvidia{device}", whole=True), secret=secret)
    [result] = await ledger.admit_many(
        [Admission(job, 500, b"{}", None, "queued", tenant="t", placement=placement)]
    )
    lease = ledger.granted_lease(result)
    assert lease is not None and lease.grant_entry == result.entry
    return Holder("t", secret, result.token), lease, result.entry


def _recording(publisher: Publisher, sent: list[msgspec.Struct]) -> Send:
    async def send(event: msgspec.Struct) -> Sequence[Awaitable[Any]]:
        sent.append(event)
        return await publisher.send(event)

    return send


@asynccontextmanager
async def _watching(
    nc: Client, wait_s: float = 5.0, metrics: LeaseManagerMetrics | None = None
) -> AsyncIterator[StoredGrants]:
    """The lease-manager's watch of the grants JetStream stores, running for the block."""
    grants = StoredGrants(wait_s=wait_s, metrics=metrics)
    stop = asyncio.Event()
    running = asyncio.create_task(grants.run(nc.jetstream(), stop))
    await eventually(lambda: grants.following, timeout_s=5)
    try:
        yield grants
    finally:
        stop.set()
        await asyncio.wait_for(running, 5)


async def _holder_command(
    kind: str,
    holder: Holder,
    lease: LeaseRecord,
    ledger: Ledger,
    outbox: DirectOutbox,
    grants: StoredGrants,
) -> Sequence[msgspec.Struct]:
    """The holder's renewal or release, as the lease-manager serves it."""
    if kind == "renewed":
        renewal = RenewLease(
            lease_id=lease.lease_id, lease_secret=holder.secret, fencing_token=holder.token
        )
        return await renew_lease(renewal, ledger, tenant="t", outbox=outbox, grants=grants)
    release = ReleaseLease(
        lease_id=lease.lease_id, lease_secret=holder.secret, fencing_token=holder.token
    )
    return await release_lease(release, ledger, tenant="t", outbox=outbox, grants=grants)


def _counted(metrics: LeaseManagerMetrics) -> dict[str, float | None]:
    """The watch's series as a scrape would read them."""
    return {
        name: metrics.registry.get_sample_value(f"xpupool_grant_{name}_total")
        for name in ("waits", "copies")
    }


async def _stored_in_both(nc: Client) -> list[list[type]]:
    return [
        [type(e) for e in await stored_lease_events(nc, stream)]
        for stream in (subjects.EVENTS_STREAM, subjects.TENANT_EVENTS_STREAM)
    ]


@pytest.mark.parametrize("kind", ["renewed", "ended"])
async def test_a_holder_acting_before_the_grant_is_stored_has_its_event_wait_for_it(
    ledger: Ledger, nc: Client, kind: str
) -> None:
    """The holder renews or releases on the answer while the scheduler has not yet published
    the grant: the lease-manager's event waits until JetStream holds the grant, then goes; no
    copy of the grant is sent, so both streams, and a core subscriber, see one grant, ahead of
    the later event."""
    holder, lease, entry = await _granted_unconfirmed(ledger)
    seen: list[type] = []

    async def subscriber(msg: Any) -> None:
        seen.append(type(LEASE_EVENTS.decode(msg.data)))

    await nc.subscribe("xpupool.alloc.v1.>", cb=subscriber)
    lm_sent: list[msgspec.Struct] = []
    lm = Publisher(nc, source="/lease-manager")
    metrics = LeaseManagerMetrics()
    async with (
        _watching(nc, metrics=metrics) as grants,
        running_direct_outbox(DirectOutbox(ledger), _recording(lm, lm_sent)) as outbox,
    ):
        command = asyncio.create_task(_holder_command(kind, holder, lease, ledger, outbox, grants))
        await asyncio.sleep(0.3)
        assert lm_sent == [] and not command.done()  # waiting for the grant
        scheduler = Publisher(nc, source="/scheduler")
        async with running_direct_outbox(DirectOutbox(ledger), scheduler.send) as late:
            await late.publish(entry, [granted_event(lease)])  # the stalled scheduler resumes
        [reply] = await asyncio.wait_for(command, 5)
    assert getattr(reply, "ok", False)
    later = LeaseRenewed if kind == "renewed" else LeaseEnded
    assert [type(e) for e in lm_sent] == [later] and grants.copies == 0
    assert _counted(metrics) == {"waits": 1.0, "copies": 0.0}
    assert await _stored_in_both(nc) == [[AllocationGranted, later]] * 2
    await nc.flush()
    await eventually(lambda: len(seen) >= 2, timeout_s=5)
    assert seen == [AllocationGranted, later]
    assert await direct_entries(ledger) == []


@pytest.mark.parametrize("kind", ["renewed", "ended"])
async def test_a_grant_that_never_comes_is_published_as_a_copy_ahead_of_the_later_event(
    ledger: Ledger, nc: Client, kind: str
) -> None:
    """The scheduler stalled between its answer and its publish: after the wait the
    lease-manager sends a copy of the grant (the term it was granted with, not a renewal's),
    then its event, and confirms the grant's entry (the sweep has nothing to publish again);
    the scheduler's own publish, when it wakes, is dropped by JetStream as a duplicate."""
    holder, lease, entry = await _granted_unconfirmed(ledger)
    await asyncio.sleep(0.01)  # a renewal lands on a later millisecond: another term
    lm_sent: list[msgspec.Struct] = []
    lm = Publisher(nc, source="/lease-manager")
    metrics = LeaseManagerMetrics()
    async with (
        _watching(nc, wait_s=0.3, metrics=metrics) as grants,
        running_direct_outbox(DirectOutbox(ledger), _recording(lm, lm_sent)) as outbox,
    ):
        [reply] = await _holder_command(kind, holder, lease, ledger, outbox, grants)
    assert getattr(reply, "ok", False)
    later = LeaseRenewed if kind == "renewed" else LeaseEnded
    assert [type(e) for e in lm_sent] == [AllocationGranted, later] and grants.copies == 1
    assert _counted(metrics) == {"waits": 1.0, "copies": 1.0}
    assert lm_sent[0] == granted_event(lease)
    assert await direct_entries(ledger) == []
    scheduler = Publisher(nc, source="/scheduler")
    async with running_direct_outbox(DirectOutbox(ledger), scheduler.send) as late:
        await late.publish(entry, [granted_event(lease)])
    assert await _stored_in_both(nc) == [[AllocationGranted, later]] * 2
    stored = await stored_lease_events(nc, subjects.EVENTS_STREAM)
    # The operator's copy goes without the secret; otherwise the grant as answered.
    unsecret = functools.partial(msgspec.structs.replace, lease_secret=None)
    assert unsecret(stored[0]) == unsecret(granted_event(lease))


async def test_a_grant_already_confirmed_is_neither_waited_for_nor_copied(
    ledger: Ledger, nc: Client
) -> None:
    """Once the scheduler's outbox confirmed the grant, a release sends its own event at once,
    even with no watch to ask."""
    holder, lease, entry = await _granted_unconfirmed(ledger)
    scheduler = Publisher(nc, source="/scheduler")
    async with running_direct_outbox(DirectOutbox(ledger), scheduler.send) as outbox:
        await outbox.publish(entry, [granted_event(lease)])
    assert await direct_entries(ledger) == []
    lm_sent: list[msgspec.Struct] = []
    lm = Publisher(nc, source="/lease-manager")
    grants = StoredGrants()  # not running: it would copy
    async with running_direct_outbox(DirectOutbox(ledger), _recording(lm, lm_sent)) as outbox:
        [reply] = await _holder_command("ended", holder, lease, ledger, outbox, grants)
    assert getattr(reply, "ok", False)
    assert [type(e) for e in lm_sent] == [LeaseEnded] and grants.copies == 0
    assert (await _stored_in_both(nc))[0] == [AllocationGranted, LeaseEnded]


async def test_an_end_the_relay_publishes_before_the_grant_is_stored_waits_for_it(
    ledger: Ledger, nc: Client
) -> None:
    """The control plane ends the lease (a preemption) while the grant is unconfirmed: the
    relay's ``LeaseEnded`` waits until JetStream holds the grant."""
    _, lease, entry = await _granted_unconfirmed(ledger)
    assert (await ledger.end(lease.lease_id, "preempted")).ok
    lm_sent: list[msgspec.Struct] = []
    lm = Publisher(nc, source="/lease-manager")
    stop = asyncio.Event()
    async with _watching(nc) as grants:
        relay = OutboxRelay(
            ledger,
            "lease-manager",
            functools.partial(build_events, ledger=ledger, grants=grants),
            _recording(lm, lm_sent),
        )
        relaying = asyncio.create_task(relay.run(stop))
        await asyncio.sleep(0.5)
        assert lm_sent == []
        scheduler = Publisher(nc, source="/scheduler")
        async with running_direct_outbox(DirectOutbox(ledger), scheduler.send) as late:
            await late.publish(entry, [granted_event(lease)])
        await eventually(lambda: lm_sent, timeout_s=5)
        stop.set()
        await asyncio.wait_for(relaying, 5)
    assert [type(e) for e in lm_sent] == [LeaseEnded] and grants.copies == 0
    assert await _stored_in_both(nc) == [[AllocationGranted, LeaseEnded]] * 2


async def test_the_relay_copies_a_grant_that_never_comes_ahead_of_an_end(
    ledger: Ledger, nc: Client
) -> None:
    """With no watch running (its lease-manager's bus is down), a relayed end of a lease whose
    grant is unconfirmed goes after a copy of the grant; once the grant is confirmed, alone."""
    _, lease, entry = await _granted_unconfirmed(ledger)
    assert (await ledger.end(lease.lease_id, "preempted")).ok
    entries = [{"kind": "ended", "lease_id": lease.lease_id}]
    grants = StoredGrants()
    [events] = await build_events(entries, ledger, grants=grants)
    assert [type(e) for e in events] == [AllocationGranted, LeaseEnded]
    assert events[0] == granted_event(lease) and grants.copies == 1
    await ledger.confirm_direct([entry])
    [[alone]] = await build_events(entries, ledger, grants=grants)
    assert isinstance(alone, LeaseEnded)


async def test_the_relay_waits_for_the_grants_of_a_batch_together(
    ledger: Ledger, nc: Client
) -> None:
    """Ends of several leases whose grants are unconfirmed, relayed in one batch, wait for
    their grants at once (a stalled scheduler costs the batch one wait, not one per lease),
    and go alone once the grants are stored."""
    granted = [await _granted_unconfirmed(ledger, f"job-{i}", i) for i in range(3)]
    for _, lease, _ in granted:
        assert (await ledger.end(lease.lease_id, "preempted")).ok
    entries = [{"kind": "ended", "lease_id": lease.lease_id} for _, lease, _ in granted]
    async with _watching(nc) as grants:
        building = asyncio.create_task(build_events(entries, ledger, grants=grants))
        await eventually(lambda: grants.waiting == 3, timeout_s=5)
        scheduler = Publisher(nc, source="/scheduler")
        async with running_direct_outbox(DirectOutbox(ledger), scheduler.send) as late:
            for _, lease, entry in granted:
                await late.publish(entry, [granted_event(lease)])
        built = await asyncio.wait_for(building, 5)
    assert [[type(e) for e in events] for events in built] == [[LeaseEnded]] * 3
    assert grants.copies == 0


async def test_a_watch_started_late_knows_the_grants_of_the_last_minute(
    ledger: Ledger, nc: Client
) -> None:
    """A lease-manager (re)started after a grant was stored still knows it (its consumer starts
    a minute back): a release then neither waits nor copies."""
    _, lease, entry = await _granted_unconfirmed(ledger)
    scheduler = Publisher(nc, source="/scheduler")
    await scheduler.publish(granted_event(lease))  # stored; its entry still unconfirmed
    async with _watching(nc) as grants:
        await eventually(lambda: grants.seen(lease.lease_id), timeout_s=5)
        assert await build_events([{"kind": "ended", "lease_id": lease.lease_id}], ledger) != []
        assert grants.waits == 0 and grants.copies == 0


async def test_a_grant_stored_before_its_writer_died_reaches_a_core_subscriber_once(
    ledger: Ledger, nc: Client
) -> None:
    """The scheduler published a grant (JetStream stored it) and died before deleting its
    direct-outbox entry: the lease-manager's sweep, with its watch running, deletes the entry
    without sending the grant again, so a core NATS subscriber gets it once."""
    _, lease, entry = await _granted_unconfirmed(ledger)
    seen: list[LeaseEvent] = []

    async def subscriber(msg: Any) -> None:
        seen.append(LEASE_EVENTS.decode(msg.data))

    await nc.subscribe("xpupool.alloc.v1.>", cb=subscriber)
    await Publisher(nc, source="/scheduler").publish(granted_event(lease))
    lm_sent: list[msgspec.Struct] = []
    lm = Publisher(nc, source="/lease-manager")
    stop = asyncio.Event()
    async with _watching(nc) as grants:
        await eventually(lambda: grants.seen(lease.lease_id), timeout_s=5)
        relay = OutboxRelay(
            ledger,
            "lease-manager",
            functools.partial(build_events, ledger=ledger, grants=grants),
            _recording(lm, lm_sent),
            sweep_direct=True,
            direct_stale_ms=0,
        )
        sweeping = asyncio.create_task(relay.run(stop))
        await eventually(lambda: _none_left(ledger, entry), timeout_s=5)
        stop.set()
        await asyncio.wait_for(sweeping, 5)
    await nc.flush()
    assert lm_sent == []
    assert [type(e) for e in seen] == [AllocationGranted]
    assert await _stored_in_both(nc) == [[AllocationGranted]] * 2


async def _none_left(ledger: Ledger, entry: str) -> bool:
    return entry not in await direct_entries(ledger)


@pytest.mark.timeout(90)
async def test_the_watch_follows_again_after_nats_restarts(
    ledger: Ledger, nats_server: NatsServer
) -> None:
    """NATS restarts under a running watch (its ephemeral consumer is lost with it): the
    ordered consumer is made again, and a grant stored after the restart is seen."""
    client = await nats.connect(nats_server.url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
    await ensure_streams(client.jetstream(), subjects.STREAMS)
    try:
        async with _watching(client) as grants:
            nats_server.restart()
            await eventually(lambda: client.is_connected, timeout_s=15)
            _, lease, _ = await _granted_unconfirmed(ledger)
            scheduler = Publisher(client, source="/scheduler")
            await scheduler.publish(granted_event(lease))
            await eventually(lambda: grants.seen(lease.lease_id), timeout_s=40)
    finally:
        await client.close()


async def _relay_granted(
    ledger: Ledger, job: str = "a", device: int = 0
) -> tuple[Holder, LeaseRecord, str]:
    """A lease a cycle reserved and the lease-manager then granted (``grant.lua``): its grant
    waits in the lease-manager's outbox for whichever replica's relay reads it."""
    if device == 0:
        devices = [device_spec("n1", i) for i in range(4)]
        assert (await ledger.register_node("n1", devices, 64_000, 256_000)).ok
    [waiting] = await ledger.admit_many([Admission(job, 500, b"{}", None, "queued", tenant="t")])
    assert waiting.outcome == "pending"
    assert (await ledger.reserve(reservation(job, SliceClaim(f"n1/nvidia{device}", whole=True)))).ok
    secret = new_lease_secret()
    granted = await ledger.grant(f"lease-{job}", secret)
    lease = await ledger.get_lease(f"lease-{job}")
    assert granted.ok and lease is not None and lease.grant_outbox == "lease-manager"
    return Holder("t", secret, granted.token), lease, lease.grant_entry


def _lease_manager_relay(
    ledger: Ledger, grants: StoredGrants, send: Send, consumer: str
) -> OutboxRelay:
    """One lease-manager replica's relay (``consumer`` names it in the group)."""
    build = functools.partial(build_events, ledger=ledger, grants=grants)
    return OutboxRelay(ledger, "lease-manager", build, send, consumer=consumer)


async def test_an_end_one_replica_relays_waits_for_the_grant_another_replica_holds(
    ledger: Ledger, nc: Client
) -> None:
    """Two lease-managers: one replica's relay has read a lease's grant and stalls before
    publishing it; the lease is then ended (a preemption) and the other replica's relay reads
    the end. The end waits until JetStream holds the grant, then goes alone."""
    _, lease, _ = await _relay_granted(ledger)
    resume = asyncio.Event()
    stalled_sent: list[msgspec.Struct] = []
    stalled_publisher = Publisher(nc, source="/lease-manager/a")

    async def stalled(event: msgspec.Struct) -> Sequence[Awaitable[Any]]:
        stalled_sent.append(event)
        await resume.wait()
        return await stalled_publisher.send(event)

    peer_sent: list[msgspec.Struct] = []
    peer_publisher = Publisher(nc, source="/lease-manager/b")
    stop = asyncio.Event()
    async with _watching(nc) as grants:
        replica_a = asyncio.create_task(
            _lease_manager_relay(ledger, grants, stalled, "lm-a").run(stop)
        )
        await eventually(lambda: stalled_sent, timeout_s=5)  # it holds the grant
        assert (await ledger.end(lease.lease_id, "preempted")).ok
        replica_b = asyncio.create_task(
            _lease_manager_relay(ledger, grants, _recording(peer_publisher, peer_sent), "lm-b").run(
                stop
            )
        )
        await eventually(lambda: grants.waiting == 1, timeout_s=5)
        assert peer_sent == []
        resume.set()
        await eventually(lambda: peer_sent, timeout_s=5)
        stop.set()
        await asyncio.wait_for(asyncio.gather(replica_a, replica_b), 5)
    assert [type(e) for e in peer_sent] == [LeaseEnded] and grants.copies == 0
    assert await _stored_in_both(nc) == [[AllocationGranted, LeaseEnded]] * 2


async def test_a_release_goes_after_a_copy_of_a_grant_a_dead_replica_held(
    ledger: Ledger, nc: Client
) -> None:
    """The replica that read a lease's grant died before publishing it (the entry waits for a
    peer to take it once stale): the holder's release goes after a copy of the grant, on the
    release's own entry; the grant's entry stays the relays' to publish again, and JetStream
    keeps one grant."""
    holder, lease, grant_entry = await _relay_granted(ledger)
    stream = ledger.key("outbox", "lease-manager")
    await ledger.redis.xgroup_create(stream, "relay", id="0")
    await ledger.redis.xreadgroup("relay", "lm-dead", {stream: ">"})  # read, never published
    lm_sent: list[msgspec.Struct] = []
    lm = Publisher(nc, source="/lease-manager")
    async with (
        _watching(nc, wait_s=0.3) as grants,
        running_direct_outbox(DirectOutbox(ledger), _recording(lm, lm_sent)) as outbox,
    ):
        [reply] = await _holder_command("ended", holder, lease, ledger, outbox, grants)
    assert getattr(reply, "ok", False)
    assert [type(e) for e in lm_sent] == [AllocationGranted, LeaseEnded] and grants.copies == 1
    assert lm_sent[0] == granted_event(lease)
    assert await direct_entries(ledger) == []
    held: Any = await ledger.redis.xrange(stream)  # the grant's entry stays the relays'
    assert [entry_id for entry_id, _ in held] == [grant_entry.encode()]
    await lm.publish(granted_event(lease))  # a peer relays the stale entry: a duplicate
    assert await _stored_in_both(nc) == [[AllocationGranted, LeaseEnded]] * 2


@pytest.mark.parametrize("traced", [False, True], ids=["held", "pipeline"])
async def test_unconfirmed_grants_are_found_in_either_outbox_through_either_round_trip(
    ledger: Ledger, traced: bool
) -> None:
    """A grant on admission (direct outbox) and a relayed one (the lease-manager's), read in one
    round trip on a held connection, or through redis-py's pipeline in a traced process."""
    _, direct, direct_entry = await _granted_unconfirmed(ledger)
    _, relayed, relay_entry = await _relay_granted(ledger, "b", 1)
    ledger._held._traced = lambda: traced  # noqa: SLF001
    found = await ledger.unconfirmed_grants([direct, relayed])
    assert {lease_id: fields["kind"] for lease_id, fields in found.items()} == {
        direct.lease_id: "granted",
        relayed.lease_id: "granted",
    }
    await ledger.confirm_direct([direct_entry])
    await ledger.redis.xdel(ledger.key("outbox", "lease-manager"), relay_entry)
    assert await ledger.unconfirmed_grants([direct, relayed]) == {}
