"""A scheduler replica is delivered lease ends only while jobs wait (``CapacityWatch``), against
a real nats-server and redis-server: nothing waiting, no lease end reaches it; a job waiting,
the next lease end wakes a cycle; once none wait, they stop coming."""

from __future__ import annotations

import asyncio

import nats
import pytest

from tests.conftest import eventually
from tests.integration.ledger_builders import device_spec, reservation
from xpupool.bus import Publisher
from xpupool.bus.connection import round_trip
from xpupool.contracts import JobRequested, encode, subjects
from xpupool.devstack.servers import NatsServer
from xpupool.ledger import Ledger, SliceClaim
from xpupool.scheduler import handlers
from xpupool.scheduler.capacity_watch import CapacityWatch
from xpupool.scheduler.config_source import ConfigSource
from xpupool.scheduler.main import CycleLock, cycle_loop
from xpupool.scheduler.settings import SchedulerSettings

pytestmark = pytest.mark.integration

ENDED = subjects.ALLOC_ENDED.subject(reason="released")


async def test_lease_ends_reach_a_watch_only_while_it_follows(nats_server: NatsServer) -> None:
    watcher = await nats.connect(nats_server.url)
    operator = await nats.connect(nats_server.url)
    woken: list[int] = []
    watch = CapacityWatch(watcher, lambda: woken.append(1))
    try:
        await operator.publish(ENDED, b"{}")
        await round_trip(operator)
        await watch.follow()
        await watch.follow()  # following already: no second subscription
        await operator.publish(ENDED, b"{}")
        await round_trip(operator)
        await eventually(lambda: woken == [1], timeout_s=5)
        await watch.rest()
        await watch.rest()
        assert not watch.following
        await operator.publish(ENDED, b"{}")
        await round_trip(operator)
        await round_trip(watcher)  # anything delivered to it would be in by now
        await asyncio.sleep(0.05)
        assert woken == [1]
    finally:
        await watcher.close()
        await operator.close()


async def test_a_replica_follows_lease_ends_while_jobs_wait_and_wakes_its_cycle(
    nats_server: NatsServer, ledger: Ledger
) -> None:
    nc = await nats.connect(nats_server.url)
    operator = await nats.connect(nats_server.url)
    # No periodic wake within the test: a cycle runs only when something wakes it.
    settings = SchedulerSettings(retry_interval_s=60)
    deps = handlers.SchedulerDeps(ledger=ledger, settings=settings, config=ConfigSource(None))
    watch = CapacityWatch(nc, lambda: handlers.wake_for_capacity(deps))
    stop = asyncio.Event()
    loop = asyncio.create_task(cycle_loop(deps, Publisher(nc, "/test"), stop, watch))
    try:
        deps.wake.set()
        await asyncio.sleep(0.2)
        assert not watch.following  # nothing waits
        # The pool's one device is held: a job that wants it waits.
        assert (await ledger.register_node("n1", [device_spec("n1", 0)], 64_000, 256_000)).ok
        assert (await ledger.reserve(reservation("x", SliceClaim("n1/nvidia0", whole=True)))).ok
        request = JobRequested(job_id="w", tenant="t")
        pended = await ledger.pend("w", 500, encode(request), None, "no_capacity", tenant="t")
        assert pended.ok
        deps.wake.set()
        await eventually(lambda: watch.following and deps.last_pending == 1, timeout_s=5)
        # Its replica's cycles are woken by a lease end now.
        await asyncio.sleep(0.3)  # its cycle gave the lock back; nothing else wakes it
        before = _cycles(deps)
        await asyncio.sleep(0.3)
        assert _cycles(deps) == before
        await operator.publish(ENDED, b"{}")
        await round_trip(operator)
        await eventually(lambda: _cycles(deps) > before, timeout_s=5)
        assert (await ledger.cancel_job("w", "t")).ok
        deps.wake.set()
        await eventually(lambda: not watch.following, timeout_s=5)
    finally:
        stop.set()
        deps.wake.set()
        await asyncio.wait_for(loop, 5)
        await nc.close()
        await operator.close()


def _cycles(deps: handlers.SchedulerDeps) -> float:
    """The cycles this replica ran so far (each one decides the waiting job)."""
    registry = deps.metrics.registry
    return registry.get_sample_value("xpupool_scheduler_cycle_duration_seconds_count") or 0.0


async def test_a_replica_whose_peer_holds_the_cycle_lock_reports_no_queue_of_its_own(
    nats_server: NatsServer, ledger: Ledger
) -> None:
    """A replica's queue gauges are those of its last cycle: while a peer holds the cycle lock
    and decides the waiting jobs, they would stay as they were for as long (a backlog long
    drained, under ``max by (queue)``). Finding the lock taken, it reports none."""
    nc = await nats.connect(nats_server.url)
    settings = SchedulerSettings(retry_interval_s=0.05)
    deps = handlers.SchedulerDeps(ledger=ledger, settings=settings, config=ConfigSource(None))
    watch = CapacityWatch(nc, lambda: handlers.wake_for_capacity(deps))
    stop = asyncio.Event()
    assert (await ledger.register_node("n1", [device_spec("n1", 0)], 64_000, 256_000)).ok
    assert (await ledger.reserve(reservation("x", SliceClaim("n1/nvidia0", whole=True)))).ok
    request = JobRequested(job_id="w", tenant="t")
    assert (await ledger.pend("w", 500, encode(request), None, "no_capacity", tenant="t")).ok
    loop = asyncio.create_task(cycle_loop(deps, Publisher(nc, "/test"), stop, watch))

    def pending() -> float | None:
        return deps.metrics.registry.get_sample_value(
            "xpupool_scheduler_queue_pending_requests", {"queue": "t"}
        )

    try:
        await eventually(lambda: pending() == 1, timeout_s=5)
        stop.set()
        deps.wake.set()
        await asyncio.wait_for(loop, 5)  # gives its lock back
        peer = CycleLock(ledger, "peer", ttl_ms=60_000)
        assert await peer.take()
        stop = asyncio.Event()
        loop = asyncio.create_task(cycle_loop(deps, Publisher(nc, "/test"), stop, watch))
        await eventually(lambda: pending() == 0, timeout_s=5)
    finally:
        stop.set()
        deps.wake.set()
        await asyncio.wait_for(loop, 5)
        await nc.close()
