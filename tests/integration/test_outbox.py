"""The outbox relay against a real redis-server it can lose and get back."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Sequence
from typing import Any

import msgspec
import pytest
import structlog
from redis.exceptions import NoPermissionError

from tests.conftest import eventually
from tests.integration.ledger_builders import (
    device_spec,
    direct_entries,
    reservation,
    running_direct_outbox,
)
from xpupool.contracts import (
    JobCancelled,
    LeaseEnded,
    LeaseRenewed,
    LeaseReply,
    ReleaseLease,
    RenewLease,
)
from xpupool.devstack.servers import RedisServer
from xpupool.lease_manager.grant_watch import StoredGrants
from xpupool.lease_manager.handlers import build_events, release_lease, renew_lease
from xpupool.lease_manager.metrics import OUTBOXES, outbox_lag
from xpupool.ledger import (
    Admission,
    DirectOutbox,
    Holder,
    Ledger,
    OutboxRelay,
    ScriptResult,
    SliceClaim,
    new_lease_secret,
)
from xpupool.ledger import outbox as outbox_module
from xpupool.ledger.events import granted_event
from xpupool.ledger.outbox import GROUP, STALE_AFTER_MS, Send

pytestmark = pytest.mark.integration


async def test_a_relay_started_while_redis_is_away_waits_for_it(
    ledger: Ledger, redis_server: RedisServer
) -> None:
    """A relay (re)started while Redis is down (a service restarting its bus after losing
    NATS) keeps retrying instead of failing its service, and relays once Redis is back."""
    sent: list[msgspec.Struct] = []

    async def build(entries: Sequence[dict[str, str]]) -> list[Sequence[msgspec.Struct]]:
        return [[JobCancelled(job_id=e["job_id"], tenant="t", waited_s=0.0)] for e in entries]

    async def send(event: msgspec.Struct) -> Sequence[Awaitable[Any]]:
        sent.append(event)
        return []

    redis_server.kill()
    stop = asyncio.Event()
    relay = asyncio.create_task(OutboxRelay(ledger, "test", build, send).run(stop))
    await asyncio.sleep(1.5)
    assert not relay.done()  # still retrying, not failed
    redis_server.restart()
    await ledger.redis.xadd(ledger.key("outbox", "test"), {"kind": "cancelled", "job_id": "j1"})
    await eventually(lambda: sent, timeout_s=10)
    assert [getattr(e, "job_id", None) for e in sent] == ["j1"]
    stop.set()
    await asyncio.wait_for(relay, 5)


# ---- the direct outbox: grants the scheduler made on admission and publishes itself ----------


async def _granted_on_admission(ledger: Ledger, job: str = "a") -> ScriptResult:
    """A job granted in its admission step, its grant queued in the direct outbox."""
    assert (await ledger.register_node("n1", [device_spec("n1", 0)], 64_000, 256_000)).ok
    placement = reservation(job, SliceClaim("n1/nvidia0", whole=True), secret=new_lease_secret())
    [result] = await ledger.admit_many(
        [Admission(job, 500, b"{}", None, "queued", tenant="t", placement=placement)]
    )
    assert result.ok and result.outcome == "granted" and result.entry
    return result


def _stored() -> asyncio.Future[None]:
    ack: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    ack.set_result(None)
    return ack


async def test_a_grant_published_by_its_writer_is_confirmed_and_never_relayed(
    ledger: Ledger,
) -> None:
    """The scheduler sends the grant its admission made, and deletes the entry once JetStream
    stored it: the lease-manager's sweep, however eager, has nothing left to publish."""
    result = await _granted_on_admission(ledger)
    lease = ledger.granted_lease(result)
    assert lease is not None
    sent: list[msgspec.Struct] = []

    async def send(event: msgspec.Struct) -> Sequence[Awaitable[Any]]:
        sent.append(event)
        return [_stored()]

    stop = asyncio.Event()
    direct = DirectOutbox(ledger)
    confirming = asyncio.create_task(direct.run(send, stop))
    await asyncio.sleep(0)
    await direct.publish(result.entry, [granted_event(lease)])
    assert sent == [granted_event(lease)]  # sent at once, not after the confirmation
    await eventually(lambda: _empty(direct_entries(ledger)), timeout_s=5)

    relayed: list[msgspec.Struct] = []

    async def relay_send(event: msgspec.Struct) -> Sequence[Awaitable[Any]]:
        relayed.append(event)
        return []

    relay = OutboxRelay(
        ledger,
        "lease-manager",
        functools.partial(build_events, ledger=ledger),
        relay_send,
        sweep_direct=True,
        direct_stale_ms=0,
    )
    sweeping = asyncio.create_task(relay.run(stop))
    await asyncio.sleep(1.5)
    assert relayed == []
    stop.set()
    await asyncio.wait_for(asyncio.gather(confirming, sweeping), 5)


async def _empty(entries: Awaitable[list[str]]) -> bool:
    return not await entries


async def test_a_grant_its_writer_did_not_get_stored_is_published_by_the_sweep(
    ledger: Ledger,
) -> None:
    """A grant whose publish JetStream never acknowledged (or whose scheduler died after its
    admission) stays in the direct outbox; the lease-manager's relay publishes it once it is
    older than the stale age, the same event the scheduler would have sent, then deletes it.
    Younger entries are left to their writer."""
    result = await _granted_on_admission(ledger)
    lease = ledger.granted_lease(result)
    assert lease is not None

    async def lost(event: msgspec.Struct) -> Sequence[Awaitable[Any]]:
        ack: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        ack.set_exception(TimeoutError("no acknowledgement"))
        return [ack]

    async def refused(event: msgspec.Struct) -> Sequence[Awaitable[Any]]:
        raise ConnectionError("the connection is closed")

    stop = asyncio.Event()
    direct = DirectOutbox(ledger)
    confirming = asyncio.create_task(direct.run(lost, stop))
    await asyncio.sleep(0)
    await direct.publish(result.entry, [granted_event(lease)])
    await asyncio.sleep(0.3)
    assert await direct_entries(ledger) == [result.entry]  # unconfirmed: kept
    entries, _ = await outbox_lag(ledger, "direct")  # what operators see of it
    assert entries == 1 and "direct" in OUTBOXES
    stop_refusing = asyncio.Event()
    failing = DirectOutbox(ledger)
    refusing = asyncio.create_task(failing.run(refused, stop_refusing))
    await asyncio.sleep(0)
    # A send that fails outright is no error of the (committed) admission: the entry stays.
    await failing.publish(result.entry, [granted_event(lease)])
    stop_refusing.set()
    await asyncio.wait_for(refusing, 5)
    assert await direct_entries(ledger) == [result.entry]

    relayed: list[msgspec.Struct] = []
    patient = asyncio.create_task(_relaying(ledger, relayed, stale_ms=60_000).run(stop))
    await asyncio.sleep(1.5)
    assert relayed == [] and await direct_entries(ledger) == [result.entry]
    eager = asyncio.create_task(_relaying(ledger, relayed, stale_ms=0).run(stop))
    await eventually(lambda: relayed, timeout_s=5)
    assert relayed == [granted_event(lease)]
    await eventually(lambda: _empty(direct_entries(ledger)), timeout_s=5)
    stop.set()
    await asyncio.wait_for(asyncio.gather(confirming, patient, eager), 5)


async def test_a_grant_seen_stored_is_not_published_again_by_the_sweep(ledger: Ledger) -> None:
    """A scheduler that published a grant and died before deleting its entry (or while holding
    the deletion back, ``BOOKKEEPING_LINGER_S``) leaves the entry to the sweep. A grant the
    lease-manager saw JetStream store (``StoredGrants``) is then only deleted: a copy would reach
    core NATS subscribers twice. One not seen stored is published as before."""
    devices = [device_spec("n1", 0), device_spec("n1", 1)]
    assert (await ledger.register_node("n1", devices, 64_000, 256_000)).ok
    results = []
    for job, device in (("stored", "n1/nvidia0"), ("lost", "n1/nvidia1")):
        placement = reservation(job, SliceClaim(device, whole=True), secret=new_lease_secret())
        [result] = await ledger.admit_many(
            [Admission(job, 500, b"{}", None, "queued", tenant="t", placement=placement)]
        )
        assert result.ok and result.outcome == "granted" and result.entry
        results.append(result)
    stored, lost = (ledger.granted_lease(r) for r in results)
    assert stored is not None and lost is not None
    grants = StoredGrants()
    grants.saw(stored.lease_id)

    relayed: list[msgspec.Struct] = []
    stop = asyncio.Event()
    relay = OutboxRelay(
        ledger,
        "lease-manager",
        functools.partial(build_events, ledger=ledger, grants=grants),
        _storing(relayed),
        sweep_direct=True,
        direct_stale_ms=0,
    )
    sweeping = asyncio.create_task(relay.run(stop))
    await eventually(lambda: _empty(direct_entries(ledger)), timeout_s=5)
    stop.set()
    await asyncio.wait_for(sweeping, 5)
    assert relayed == [granted_event(lost)]


# ---- a holder's renewal and release: the lease-manager publishes their events itself --------


async def _held_lease(ledger: Ledger) -> tuple[Holder, str]:
    """A lease granted on admission whose grant was published (its entry confirmed), and the
    holder that may renew or release it."""
    assert (await ledger.register_node("n1", [device_spec("n1", 0)], 64_000, 256_000)).ok
    secret = new_lease_secret()
    placement = reservation("a", SliceClaim("n1/nvidia0", whole=True), secret=secret)
    [result] = await ledger.admit_many(
        [Admission("a", 500, b"{}", None, "queued", tenant="t", placement=placement)]
    )
    assert result.ok and result.outcome == "granted"
    await ledger.confirm_direct([result.entry])
    return Holder("t", secret, result.token), result.lease_id


def _holder_command(kind: str, holder: Holder, lease_id: str) -> RenewLease | ReleaseLease:
    command = RenewLease if kind == "renewed" else ReleaseLease
    return command(lease_id=lease_id, lease_secret=holder.secret, fencing_token=holder.token)


async def _command(
    kind: str, command: RenewLease | ReleaseLease, ledger: Ledger, outbox: DirectOutbox | None
) -> Sequence[msgspec.Struct]:
    if isinstance(command, RenewLease):
        return await renew_lease(command, ledger, tenant="t", outbox=outbox)
    return await release_lease(command, ledger, tenant="t", outbox=outbox)


def _relaying(ledger: Ledger, sent: list[msgspec.Struct], stale_ms: int) -> OutboxRelay:
    """The lease-manager's relay, sweeping the direct outbox for entries older than
    ``stale_ms``, its sends kept in ``sent``."""
    return OutboxRelay(
        ledger,
        "lease-manager",
        functools.partial(build_events, ledger=ledger),
        _storing(sent),
        sweep_direct=True,
        direct_stale_ms=stale_ms,
    )


def _storing(sent: list[msgspec.Struct]) -> Send:
    """A send that JetStream acknowledges at once, keeping what it was given."""

    async def send(event: msgspec.Struct) -> Sequence[Awaitable[Any]]:
        sent.append(event)
        return [_stored()]

    return send


@pytest.mark.parametrize("kind", ["renewed", "ended"])
async def test_a_holder_command_publishes_its_event_before_its_reply_and_the_relay_never_does(
    ledger: Ledger, kind: str
) -> None:
    """A renewal or release with the direct outbox sends its event from the script's answer,
    before the handler returns its reply: the same event the relay would have built from the
    lease, with nothing queued for the relay and the entry deleted once stored."""
    holder, lease_id = await _held_lease(ledger)
    sent: list[msgspec.Struct] = []
    relayed: list[msgspec.Struct] = []
    async with running_direct_outbox(DirectOutbox(ledger), _storing(sent)) as direct:
        [reply] = await _command(kind, _holder_command(kind, holder, lease_id), ledger, direct)
        assert isinstance(reply, LeaseReply) and reply.ok
        [event] = sent  # sent before the reply was returned
        assert isinstance(event, LeaseRenewed if kind == "renewed" else LeaseEnded)
        # What the relay builds for the same entry from the lease (a sweep, had the publish
        # failed).
        [[rebuilt]] = await build_events([{"kind": kind, "lease_id": lease_id}], ledger)
        assert event == rebuilt
        assert await ledger.redis.xlen(ledger.key("outbox", "lease-manager")) == 0
        await eventually(lambda: _empty(direct_entries(ledger)), timeout_s=5)

        stop = asyncio.Event()
        sweeping = asyncio.create_task(_relaying(ledger, relayed, stale_ms=0).run(stop))
        await asyncio.sleep(1.5)
        stop.set()
        await asyncio.wait_for(sweeping, 5)
    assert relayed == []


@pytest.mark.parametrize("kind", ["renewed", "ended"])
async def test_a_holder_command_whose_event_was_not_stored_is_published_by_the_sweep(
    ledger: Ledger, kind: str
) -> None:
    """The command is committed even when its event cannot be sent (NATS away): the reply is
    still ok, the entry stays in the direct outbox, and the relay's sweep publishes the same
    event once the entry is stale, then deletes it."""
    holder, lease_id = await _held_lease(ledger)
    attempted: list[msgspec.Struct] = []

    async def refused(event: msgspec.Struct) -> Sequence[Awaitable[Any]]:
        attempted.append(event)
        raise ConnectionError("the connection is closed")

    relayed: list[msgspec.Struct] = []
    async with running_direct_outbox(DirectOutbox(ledger), refused) as direct:
        [reply] = await _command(kind, _holder_command(kind, holder, lease_id), ledger, direct)
        assert isinstance(reply, LeaseReply) and reply.ok
        [entry] = await direct_entries(ledger)

        stop = asyncio.Event()
        sweeping = asyncio.create_task(_relaying(ledger, relayed, stale_ms=0).run(stop))
        await eventually(lambda: relayed, timeout_s=5)
        assert relayed == attempted
        await eventually(lambda: _empty(direct_entries(ledger)), timeout_s=5)
        stop.set()
        await asyncio.wait_for(sweeping, 5)


async def test_a_refused_holder_command_queues_and_publishes_nothing(ledger: Ledger) -> None:
    """A release with a stale token changes nothing: no event, no entry, the refusal replied."""
    holder, lease_id = await _held_lease(ledger)
    sent: list[msgspec.Struct] = []
    stale = Holder(holder.tenant, holder.secret, holder.token + 1)
    async with running_direct_outbox(DirectOutbox(ledger), _storing(sent)) as direct:
        [reply] = await _command("ended", _holder_command("ended", stale, lease_id), ledger, direct)
        assert isinstance(reply, LeaseReply) and not reply.ok and reply.error == "stale_token"
    assert sent == [] and await direct_entries(ledger) == []


# ---- bookkeeping: the ids of stored entries are deleted together, never before ---------------


async def _calls(ledger: Ledger, command: str) -> int:
    stats = await ledger.redis.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


async def test_the_direct_outbox_deletes_the_entries_of_its_linger_in_one_command(
    ledger: Ledger,
) -> None:
    """Grants published one after the other within the linger are confirmed by one XDEL, after
    JetStream stored them all; none is deleted before its acknowledgement."""
    specs = [device_spec("n1", i) for i in range(3)]
    assert (await ledger.register_node("n1", specs, 64_000, 256_000)).ok
    acks: list[asyncio.Future[None]] = []

    async def send(event: msgspec.Struct) -> Sequence[Awaitable[Any]]:
        acks.append(asyncio.get_running_loop().create_future())
        return [acks[-1]]

    stop = asyncio.Event()
    direct = DirectOutbox(ledger, linger_s=0.3)
    confirming = asyncio.create_task(direct.run(send, stop))
    await asyncio.sleep(0)
    before = await _calls(ledger, "xdel")
    entries = []
    for i, spec in enumerate(specs):
        placement = reservation(
            f"j{i}", SliceClaim(spec.device_id, whole=True), secret=new_lease_secret()
        )
        [result] = await ledger.admit_many(
            [Admission(f"j{i}", 500, b"{}", None, "queued", tenant="t", placement=placement)]
        )
        lease = ledger.granted_lease(result)
        assert lease is not None
        await direct.publish(result.entry, [granted_event(lease)])
        entries.append(result.entry)
    await asyncio.sleep(0.5)
    assert await direct_entries(ledger) == entries  # nothing stored yet: nothing deleted
    for ack in acks:
        ack.set_result(None)
    await eventually(lambda: _empty(direct_entries(ledger)), timeout_s=5)
    assert await _calls(ledger, "xdel") - before == 1
    stop.set()
    await asyncio.wait_for(confirming, 5)


async def test_the_direct_outbox_deletes_what_it_holds_when_stopped(ledger: Ledger) -> None:
    """A clean stop confirms the stored entries it still holds, however long its linger."""
    result = await _granted_on_admission(ledger)
    lease = ledger.granted_lease(result)
    assert lease is not None

    async def send(event: msgspec.Struct) -> Sequence[Awaitable[Any]]:
        return [_stored()]

    stop = asyncio.Event()
    direct = DirectOutbox(ledger, linger_s=60)
    confirming = asyncio.create_task(direct.run(send, stop))
    await asyncio.sleep(0)
    await direct.publish(result.entry, [granted_event(lease)])
    await asyncio.sleep(0.3)
    assert await direct_entries(ledger) == [result.entry]  # stored, held for the linger
    stop.set()
    await asyncio.wait_for(confirming, 5)
    assert await direct_entries(ledger) == []


def _relay(
    ledger: Ledger,
    sent: list[str],
    linger_s: float,
    consumer: str = "relay-1",
    stale_after_ms: int = STALE_AFTER_MS,
) -> OutboxRelay:
    async def build(entries: Sequence[dict[str, str]]) -> list[Sequence[msgspec.Struct]]:
        return [[JobCancelled(job_id=e["job_id"], tenant="t", waited_s=0.0)] for e in entries]

    async def send(event: msgspec.Struct) -> Sequence[Awaitable[Any]]:
        sent.append(getattr(event, "job_id", ""))
        return [_stored()]

    return OutboxRelay(
        ledger,
        "test",
        build,
        send,
        consumer=consumer,
        linger_s=linger_s,
        stale_after_ms=stale_after_ms,
    )


async def test_a_relay_acks_the_batches_of_its_linger_together(ledger: Ledger) -> None:
    """Entries relayed one by one within the linger stay pending until one XACK and XDEL."""
    stream = ledger.key("outbox", "test")
    sent: list[str] = []
    stop = asyncio.Event()
    relay = asyncio.create_task(_relay(ledger, sent, linger_s=0.5).run(stop))
    await asyncio.sleep(0.3)  # the group is made
    before = await _calls(ledger, "xack")
    await ledger.redis.xadd(stream, {"kind": "cancelled", "job_id": "j1"})
    await eventually(lambda: sent == ["j1"], timeout_s=5)
    await ledger.redis.xadd(stream, {"kind": "cancelled", "job_id": "j2"})
    await eventually(lambda: sent == ["j1", "j2"], timeout_s=5)
    assert await ledger.redis.xlen(stream) == 2  # published, not yet acked: still pending
    await eventually(lambda: _is(ledger.redis.xlen(stream), 0), timeout_s=5)
    assert await _calls(ledger, "xack") - before == 1
    stop.set()
    await asyncio.wait_for(relay, 5)


async def _is(count: Awaitable[int], expected: int) -> bool:
    return await count == expected


async def test_entries_a_relay_held_when_it_died_are_published_again_and_a_stop_acks_them(
    ledger: Ledger,
) -> None:
    """A relay killed while it holds published entries unacked leaves them pending: the next
    relay publishes them again (a duplicate JetStream drops, never a loss). One stopped cleanly
    acks what it holds on its way out."""
    stream = ledger.key("outbox", "test")
    sent: list[str] = []
    crashed = asyncio.create_task(_relay(ledger, sent, linger_s=60).run(asyncio.Event()))
    await ledger.redis.xadd(stream, {"kind": "cancelled", "job_id": "j1"})
    await eventually(lambda: sent == ["j1"], timeout_s=5)
    crashed.cancel()
    with pytest.raises(asyncio.CancelledError):
        await crashed
    assert await ledger.redis.xlen(stream) == 1

    stop = asyncio.Event()
    restarted = asyncio.create_task(_relay(ledger, sent, linger_s=60).run(stop))
    await eventually(lambda: sent == ["j1", "j1"], timeout_s=5)
    assert await ledger.redis.xlen(stream) == 1  # held for the linger
    stop.set()
    await asyncio.wait_for(restarted, 5)
    assert await ledger.redis.xlen(stream) == 0
    pending: Any = await ledger.redis.xpending(stream, "relay")
    assert pending["pending"] == 0


async def test_entries_a_dead_relay_held_are_published_by_a_peer_that_keeps_running(
    ledger: Ledger,
) -> None:
    """A replica killed while it holds entries leaves them pending under its own name, which
    nobody takes again (a restarted process names itself anew): a peer already running, or one
    started before they grew stale, publishes them once they have been idle that long."""
    stream = ledger.key("outbox", "test")
    sent: list[str] = []
    dead = _relay(ledger, sent, linger_s=60, consumer="relay-a", stale_after_ms=600)
    crashed = asyncio.create_task(dead.run(asyncio.Event()))
    await ledger.redis.xadd(stream, {"kind": "cancelled", "job_id": "j1"})
    await eventually(lambda: sent == ["j1"], timeout_s=5)
    crashed.cancel()
    with pytest.raises(asyncio.CancelledError):
        await crashed

    stop = asyncio.Event()
    peer = _relay(ledger, sent, linger_s=0.05, consumer="relay-b", stale_after_ms=600)
    running = asyncio.create_task(peer.run(stop))
    await asyncio.sleep(0.3)
    assert sent == ["j1"]  # not stale yet: its holder might still be at work
    await ledger.redis.xadd(stream, {"kind": "cancelled", "job_id": "j2"})
    await eventually(lambda: sent == ["j1", "j2", "j1"], timeout_s=5)
    await eventually(lambda: _is(ledger.redis.xlen(stream), 0), timeout_s=5)
    pending: Any = await ledger.redis.xpending(stream, "relay")
    assert pending["pending"] == 0
    stop.set()
    await asyncio.wait_for(running, 5)


async def _consumers(ledger: Ledger, service: str = "test") -> dict[str, int]:
    """The relay group's consumers of ``service``'s outbox, with the entries each holds."""
    found: Any = await ledger.redis.xinfo_consumers(ledger.key("outbox", service), GROUP)
    return {_text(c["name"]): int(c["pending"]) for c in found}


async def _holds_nothing(ledger: Ledger, relay: OutboxRelay) -> bool:
    return (await _consumers(ledger)).get(relay.consumer) == 0


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def test_reaping_deletes_only_consumers_that_hold_nothing(ledger: Ledger) -> None:
    """A consumer holding entries is kept however long it has been idle (deleting it would drop
    them from the group for good); one holding nothing goes once idle that long; the caller's
    own name is kept. A group that is not there yet is no error."""
    assert await ledger.reap_relay_consumers("test", GROUP, "relay-b", 0) == []
    stream = ledger.key("outbox", "test")
    await ledger.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
    for job in ("j1", "j2"):
        await ledger.redis.xadd(stream, {"kind": "cancelled", "job_id": job})
    await ledger.redis.xreadgroup(GROUP, "holds-one", {stream: ">"}, count=1)
    read: Any = await ledger.redis.xreadgroup(GROUP, "held-one", {stream: ">"})
    [(_, [(done, _)])] = read
    await ledger.redis.xack(stream, GROUP, done)
    await ledger.redis.xreadgroup(GROUP, "relay-b", {stream: "0"})
    assert await _consumers(ledger) == {"holds-one": 1, "held-one": 0, "relay-b": 0}

    assert await ledger.reap_relay_consumers("test", GROUP, "relay-b", 60_000) == []
    await asyncio.sleep(0.05)
    assert await ledger.reap_relay_consumers("test", GROUP, "relay-b", 30) == ["held-one"]
    assert await ledger.reap_relay_consumers("test", GROUP, "relay-b", 0) == []
    assert await _consumers(ledger) == {"holds-one": 1, "relay-b": 0}
    pending: Any = await ledger.redis.xpending(stream, GROUP)
    assert pending["pending"] == 1


async def test_a_relay_deletes_the_consumers_of_relays_that_died_once_their_entries_are_out(
    ledger: Ledger,
) -> None:
    """Each restart of a relay adds a consumer to its group (a process names itself anew): a
    running relay deletes those of relays that died, holding nothing or once it has published
    what they held, so a group keeps about one consumer per live relay, and nothing is lost."""
    stream = ledger.key("outbox", "test")
    sent: list[str] = []

    async def crash(relay: OutboxRelay, job: str, acked: bool) -> None:
        crashed = asyncio.create_task(relay.run(asyncio.Event()))
        await ledger.redis.xadd(stream, {"kind": "cancelled", "job_id": job})
        await eventually(lambda: sent[-1:] == [job], timeout_s=5)
        if acked:
            await eventually(lambda: _holds_nothing(ledger, relay), timeout_s=5)
        crashed.cancel()
        with pytest.raises(asyncio.CancelledError):
            await crashed

    await crash(_relay(ledger, sent, linger_s=60, consumer="relay-a"), "j1", acked=False)
    await crash(_relay(ledger, sent, linger_s=0, consumer="relay-c"), "j2", acked=True)
    assert await _consumers(ledger) == {"relay-a": 1, "relay-c": 0}

    stop = asyncio.Event()
    peer = _relay(ledger, sent, linger_s=0.05, consumer="relay-b", stale_after_ms=600)
    running = asyncio.create_task(peer.run(stop))
    await eventually(lambda: sent == ["j1", "j2", "j1"], timeout_s=5)
    await ledger.redis.xadd(stream, {"kind": "cancelled", "job_id": "j3"})
    await eventually(lambda: sent[-1:] == ["j3"], timeout_s=5)

    async def only_the_peer_left() -> bool:
        return await _consumers(ledger) == {"relay-b": 0}

    await eventually(only_the_peer_left, timeout_s=5)
    assert await ledger.redis.xlen(stream) == 0
    stop.set()
    await asyncio.wait_for(running, 5)


async def test_a_relay_whose_reaping_is_refused_says_so_once_and_keeps_relaying(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A role whose ACL predates the reaping script is refused at every claim: the relay says
    so once per run of failures, not every few seconds, and relays all the same."""
    attempts: list[str] = []

    async def refused(service: str, group: str, own: str, min_idle_ms: int) -> list[str]:
        attempts.append(own)
        raise NoPermissionError("this user has no permissions to run the 'xinfo' command")

    monkeypatch.setattr(ledger, "reap_relay_consumers", refused)
    stream = ledger.key("outbox", "test")
    sent: list[str] = []
    stop = asyncio.Event()
    with structlog.testing.capture_logs() as logs:
        relay = _relay(ledger, sent, linger_s=0.05, stale_after_ms=150)
        running = asyncio.create_task(relay.run(stop))
        await eventually(lambda: len(attempts) >= 3, timeout_s=5)
        await ledger.redis.xadd(stream, {"kind": "cancelled", "job_id": "j1"})
        await eventually(lambda: sent == ["j1"], timeout_s=5)
        await eventually(lambda: _is(ledger.redis.xlen(stream), 0), timeout_s=5)
        stop.set()
        await asyncio.wait_for(running, 5)
    warned = [entry for entry in logs if entry["event"] == "relay_consumers_not_reaped"]
    assert len(warned) == 1 and "NoPermissionError" in warned[0]["error"]


async def test_the_direct_outbox_confirms_an_entry_only_once_every_event_of_it_was_stored(
    ledger: Ledger, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The acknowledgements of what was sent are awaited together, at most the send timeout:
    an entry whose every event was stored is deleted; one with an event refused, or never
    acknowledged, stays for the relay's sweep, and the acknowledgement still pending is
    cancelled (which frees its slot in the connection's window)."""
    monkeypatch.setattr(outbox_module, "SEND_TIMEOUT_S", 0.3)
    stream = ledger.key("outbox", "direct")
    entries = [_text(await ledger.redis.xadd(stream, {"kind": "cancelled"})) for _ in range(3)]
    loop = asyncio.get_running_loop()
    stored, refused, silent = loop.create_future(), loop.create_future(), loop.create_future()
    stored.set_result(None)
    refused.set_exception(RuntimeError("the stream refused it"))
    # Per entry, the acknowledgements of its two events, in the order they are sent.
    acks = iter([stored, stored, stored, refused, stored, silent])

    async def send(event: msgspec.Struct) -> Sequence[Awaitable[Any]]:
        return [next(acks)]

    stop = asyncio.Event()
    direct = DirectOutbox(ledger, linger_s=0.05)
    confirming = asyncio.create_task(direct.run(send, stop))
    await asyncio.sleep(0)
    event = JobCancelled(job_id="j", tenant="t", waited_s=0.0)
    for entry in entries:
        await direct.publish(entry, [event, event])
    await eventually(lambda: silent.cancelled(), timeout_s=5)
    await eventually(lambda: _is(ledger.redis.xlen(stream), 2), timeout_s=5)
    assert await direct_entries(ledger) == entries[1:]
    stop.set()
    await asyncio.wait_for(confirming, 5)


async def test_a_live_relay_whose_name_a_peer_deleted_goes_on_relaying(ledger: Ledger) -> None:
    """Two live relays with nothing to do: each deletes the other's name once it has been idle
    the stale period (Redis 7.0 refreshes a consumer's idle time only by a delivery, so a quiet
    live relay looks like a dead one), but only a name holding nothing; a relay so deleted is
    made again by its next delivery, and every entry is published and acked all the same."""
    stream = ledger.key("outbox", "test")
    names = ("relay-a", "relay-b")
    await ledger.redis.xgroup_create(stream, GROUP, id="0", mkstream=True)
    for name in names:
        await ledger.redis.xgroup_createconsumer(stream, GROUP, name)
    assert await _consumers(ledger) == {"relay-a": 0, "relay-b": 0}
    sent: list[str] = []
    stop = asyncio.Event()
    relays = [
        _relay(ledger, sent, linger_s=0.05, consumer=name, stale_after_ms=300) for name in names
    ]
    running = [asyncio.create_task(relay.run(stop)) for relay in relays]

    async def a_name_was_deleted() -> bool:
        return len(await _consumers(ledger)) < 2

    await eventually(a_name_was_deleted, timeout_s=5)
    jobs = [f"j{i}" for i in range(10)]
    for job in jobs:
        await ledger.redis.xadd(stream, {"kind": "cancelled", "job_id": job})
    await eventually(lambda: set(jobs) <= set(sent), timeout_s=5)
    await eventually(lambda: _is(ledger.redis.xlen(stream), 0), timeout_s=5)
    pending: Any = await ledger.redis.xpending(stream, GROUP)
    assert pending["pending"] == 0
    stop.set()
    await asyncio.wait_for(asyncio.gather(*running), 5)
