"""The scheduler's admission on its kept copy of the ledger (``admit_arrivals``) against a real
redis-server: a lone arrival is placed on the copy without a read while the change feed says it
is current, and one placed on a copy the ledger has moved past is decided again on a read and
still granted at admission, never left to a cycle."""

from __future__ import annotations

import asyncio

import pytest
import uvloop
from redis.asyncio import Redis

from tests.conftest import eventually
from tests.integration.ledger_builders import device_spec, reservation
from xpupool.contracts import (
    DeviceDemand,
    DeviceSample,
    JobRequested,
    SubmitOutcome,
    SubmitReply,
)
from xpupool.devstack.servers import RedisServer
from xpupool.ledger import AdmissionLimits, Ledger, SliceClaim, audit
from xpupool.scheduler import main as scheduler_main
from xpupool.scheduler.config_source import ConfigSource
from xpupool.scheduler.handlers import (
    Arrival,
    SchedulerDeps,
    admit_arrivals,
    submit_job,
    submit_reply_too_large,
    wake_for_capacity,
)
from xpupool.scheduler.settings import SchedulerSettings
from xpupool.scheduler.snapshot_cache import RECENT_READ_S

pytestmark = pytest.mark.integration


def _arrival(job_id: str) -> Arrival:
    request = JobRequested(job_id=job_id, tenant="t", device=DeviceDemand(memory_mib=1024))
    return Arrival(request, 500, AdmissionLimits(), {})


def _views(deps: SchedulerDeps, view: str) -> float:
    value = deps.metrics.registry.get_sample_value(
        "xpupool_scheduler_admission_views_total", {"view": view}
    )
    return value or 0.0


async def _deps_on_a_current_copy(ledger: Ledger) -> SchedulerDeps:
    """Deps whose kept copy is current and whose feed counts as live (no follower runs here,
    so what the test changes next goes unannounced, as a change still on its way would)."""
    specs = [device_spec("n1", i) for i in range(2)]
    assert (await ledger.register_node("n1", specs, 64_000, 256_000)).ok
    deps = SchedulerDeps(ledger=ledger, settings=SchedulerSettings(), config=ConfigSource(None))
    deps.snapshots.note_change(True)
    await deps.snapshots.read_pool(ledger, deps.config.current())
    assert await deps.snapshots.kept_pool(deps.config.current()) is not None
    return deps


async def test_a_lone_arrival_is_placed_on_the_current_kept_copy(ledger: Ledger) -> None:
    deps = await _deps_on_a_current_copy(ledger)
    reads = deps.snapshots.last
    [result] = await admit_arrivals([_arrival("a")], deps)
    assert result.ok and result.outcome == "granted"
    assert deps.snapshots.last is reads  # no read of its own
    assert (_views(deps, "kept"), _views(deps, "changed")) == (1.0, 0.0)


async def test_a_placement_on_a_stale_copy_is_decided_again_on_a_read(ledger: Ledger) -> None:
    deps = await _deps_on_a_current_copy(ledger)
    # Another scheduler takes a whole device behind this one's back (unannounced here).
    taken = reservation("other", SliceClaim("n1/nvidia0", whole=True))
    assert (await ledger.reserve(taken)).ok
    [result] = await admit_arrivals([_arrival("b")], deps)
    assert result.ok and result.outcome == "granted", result
    assert (_views(deps, "kept"), _views(deps, "changed")) == (0.0, 1.0)
    lease = await ledger.get_lease(result.lease_id)
    assert lease is not None and [s.device_id for s in lease.slices] == ["n1/nvidia1"]
    assert await ledger.pending_jobs() == [] and deps.last_pending == 0


async def test_live_load_alone_leaves_the_kept_copy_in_use(ledger: Ledger) -> None:
    """Utilisation samples land between the read and the arrival (announced as live load, as
    the feed does): the arrival is still placed on the kept copy, and the ledger takes it."""
    deps = await _deps_on_a_current_copy(ledger)
    assert (await ledger.heartbeat("n1", [DeviceSample(device_id="n1/nvidia0", util_pct=61.0)])).ok
    seq = await ledger.redis.get(ledger.key("changes-seq"))
    assert seq is not None
    deps.snapshots.note_change(True, int(seq), True)
    assert deps.snapshots.wants_read()  # a warm read is wanted, at the telemetry's pace
    reads = deps.snapshots.last
    [result] = await admit_arrivals([_arrival("c")], deps)
    assert result.ok and result.outcome == "granted", result
    assert deps.snapshots.last is reads  # no read of its own
    assert (_views(deps, "kept"), _views(deps, "changed")) == (1.0, 0.0)


def test_an_idle_replica_reads_live_load_in_at_its_own_pace(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Following the feed, an idle replica reads a capacity change in at once, but live load
    alone at most every ``LOAD_CATCH_UP_S`` (a fleet reports it many times a second), and then
    all of it in one read. On uvloop, as the services run (``run_service``): its timer handles
    are not asyncio's."""
    monkeypatch.setattr(scheduler_main, "LOAD_CATCH_UP_S", 1.5)
    uvloop.run(_idle_replica_reads_live_load_in_at_its_own_pace(redis_server.url))


async def _idle_replica_reads_live_load_in_at_its_own_pace(redis_url: str) -> None:
    redis = Redis.from_url(redis_url)
    ledger = Ledger(redis, "test")
    specs = [device_spec("n1", i) for i in range(2)]
    assert (await ledger.register_node("n1", specs, 64_000, 256_000)).ok
    deps = SchedulerDeps(ledger=ledger, settings=SchedulerSettings(), config=ConfigSource(None))
    cache, stop = deps.snapshots, asyncio.Event()
    loops = [asyncio.create_task(c) for c in scheduler_main.warm_copy_loops(deps, stop)]
    try:
        await eventually(lambda: cache._feed_live, timeout_s=3.0, interval_s=0.01)  # noqa: SLF001
        await cache.read_pool(ledger, deps.config.current())
        # The feed's coming up wakes a warm read too: let it land before counting.
        await asyncio.sleep(0.2)
        assert not cache.wants_read()
        reads = cache.reads
        for k in range(20):
            assert (
                await ledger.heartbeat(
                    "n1", [DeviceSample(device_id="n1/nvidia0", util_pct=40.0 + k)]
                )
            ).ok
            await asyncio.sleep(0.02)
        assert cache.wants_read() and cache.load_only_unread()
        assert cache.reads == reads  # none yet: under LOAD_CATCH_UP_S since the last
        assert await cache.kept_pool(deps.config.current()) is not None  # and the copy stands
        await eventually(
            lambda: cache.reads == reads + 1 and not cache.wants_read(), 3.0, interval_s=0.01
        )
        # More load after the catch-up: it waits for the next one, and comes in with it.
        assert (
            await ledger.heartbeat("n1", [DeviceSample(device_id="n1/nvidia0", util_pct=99.0)])
        ).ok
        await eventually(
            lambda: cache.reads == reads + 2 and not cache.wants_read(), 3.0, interval_s=0.01
        )
        assert all(not task.done() for task in loops)  # nothing in them failed
        assert (await ledger.reserve(reservation("x", SliceClaim("n1/nvidia1", 1024, 10)))).ok
        await eventually(lambda: cache.reads == reads + 3, 1.0, interval_s=0.01)  # at once
    finally:
        stop.set()
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)
        await redis.aclose()


async def test_a_starting_replica_warms_its_placement_before_the_first_arrival(
    ledger: Ledger,
) -> None:
    """The read the feed's coming up wakes also builds what the first decision would: the
    default policy's node view of the kept pool, and its learner seeded from the live leases
    (at 10,000 devices the first decision takes 44 ms cold against 4-5 ms so warmed:
    ``just bench-serial-decide [--warm]``)."""
    specs = [device_spec("n1", i) for i in range(2)]
    assert (await ledger.register_node("n1", specs, 64_000, 256_000)).ok
    assert (await ledger.reserve(reservation("x", SliceClaim("n1/nvidia0", whole=True)))).ok
    deps = SchedulerDeps(ledger=ledger, settings=SchedulerSettings(), config=ConfigSource(None))
    policy, stop = deps.default_policy, asyncio.Event()
    assert policy.online.learner.observed == 0
    loops = [asyncio.create_task(c) for c in scheduler_main.warm_copy_loops(deps, stop)]
    try:
        await eventually(lambda: policy.online.learner.observed == 1, 3.0, interval_s=0.01)
        kept = await deps.snapshots.kept_pool(deps.config.current())
        assert kept is not None
        assert policy.view(kept[2]).matches(kept[2])
    finally:
        stop.set()
        for task in loops:
            task.cancel()
        await asyncio.gather(*loops, return_exceptions=True)


async def test_freed_capacity_wakes_a_cycle_only_while_jobs_wait(ledger: Ledger) -> None:
    """A lease end with nothing waiting wakes nothing (no cycle, no read of the queue); with
    jobs waiting, and once one has had to wait at admission, it wakes a cycle."""
    deps = await _deps_on_a_current_copy(ledger)
    wake_for_capacity(deps)
    assert not deps.wake.is_set()
    # The only two devices taken behind the copy's back: the next arrival waits.
    for name, device in (("x", "n1/nvidia0"), ("y", "n1/nvidia1")):
        assert (await ledger.reserve(reservation(name, SliceClaim(device, whole=True)))).ok
    waiting = Arrival(JobRequested(job_id="w", tenant="t"), 500, AdmissionLimits(), {})
    [result] = await admit_arrivals([waiting], deps)
    assert result.ok and result.outcome == "pending"
    deps.wake.clear()
    wake_for_capacity(deps)
    assert deps.wake.is_set()


async def test_a_submission_is_answered_with_where_the_job_stands(ledger: Ledger) -> None:
    """``submit_job`` without a requester to answer early (a bare call): its own answer is the
    grant, then a job that waits, then a job that went further; a reply too large for the
    requester keeps only the outcome."""
    deps = await _deps_on_a_current_copy(ledger)
    whole = JobRequested(job_id="s1", tenant="t")
    [granted] = await submit_job(whole, deps, tenant="t")
    assert isinstance(granted, SubmitReply) and granted.outcome is SubmitOutcome.GRANTED
    assert granted.granted is not None and granted.granted.job_id == "s1"
    lease = await ledger.get_lease(granted.granted.lease_id)
    assert lease is not None and lease.state == "active"
    assert lease.token == granted.granted.fencing_token
    assert (await ledger.reserve(reservation("x", SliceClaim("n1/nvidia1", whole=True)))).ok
    [waiting] = await submit_job(JobRequested(job_id="s2", tenant="t"), deps, tenant="t")
    assert isinstance(waiting, SubmitReply) and waiting.outcome is SubmitOutcome.WAITING
    [known] = await submit_job(whole, deps, tenant="t")
    assert isinstance(known, SubmitReply) and known.outcome is SubmitOutcome.KNOWN
    short = submit_reply_too_large(granted)
    assert short is not None and short.outcome is SubmitOutcome.GRANTED
    assert short.granted is None and short.job_id == "s1"


async def test_a_batch_that_arrived_during_a_commit_decides_on_the_read_it_carried(
    ledger: Ledger,
) -> None:
    """Requests that arrive while a batch commits make it read the change log in the same round
    trip, and so does every batch that followed another at once; the next batch decides on that
    read instead of one of its own, or of the kept copy. One request per batch here: every
    commit carries a read, every batch but the first uses one, and each job is granted a whole
    device of its own."""
    specs = [device_spec("n1", i) for i in range(5)]
    assert (await ledger.register_node("n1", specs, 64_000, 256_000)).ok
    deps = SchedulerDeps(ledger=ledger, settings=SchedulerSettings(), config=ConfigSource(None))
    deps.admissions.max_batch = 1
    deps.snapshots.note_change(True)  # the feed is up: a current kept copy comes second
    reads = deps.snapshots.reads
    arrivals = [
        Arrival(JobRequested(job_id=f"w{i}", tenant="t"), 500, AdmissionLimits(), {})
        for i in range(4)
    ]
    results = await asyncio.gather(*(deps.admissions.submit(a) for a in arrivals))
    assert all(r.ok and r.outcome == "granted" for r in results), results
    leases = [await ledger.get_lease(r.lease_id) for r in results]
    devices = [s.device_id for lease in leases if lease is not None for s in lease.slices]
    assert len(devices) == len(set(devices)) == 4
    assert (_carried(deps, "carried"), _carried(deps, "used")) == (4.0, 3.0)
    assert _views(deps, "kept") + _views(deps, "changed") == 0.0
    # The first batch read for itself; the other three read nothing of their own.
    assert deps.snapshots.reads == reads + 1 + 4
    # A batch that comes later, alone, on nothing carried reads for itself and carries none.
    await asyncio.sleep(RECENT_READ_S * 2)
    [alone] = await asyncio.gather(deps.admissions.submit(_arrival("alone")))
    assert alone.outcome == "granted"
    assert (_carried(deps, "carried"), _carried(deps, "used")) == (4.0, 3.0)
    assert await audit(ledger) == []


async def test_no_read_is_carried_while_jobs_wait(ledger: Ledger) -> None:
    """With jobs waiting, arrivals are not placed on admission (a cycle places them in order),
    so a commit carries no read for them."""
    specs = [device_spec("n1", 0)]
    assert (await ledger.register_node("n1", specs, 64_000, 256_000)).ok
    deps = SchedulerDeps(ledger=ledger, settings=SchedulerSettings(), config=ConfigSource(None))
    deps.admissions.max_batch = 1
    deps.last_pending = 1
    arrivals = [
        Arrival(JobRequested(job_id=f"q{i}", tenant="t"), 500, AdmissionLimits(), {})
        for i in range(3)
    ]
    results = await asyncio.gather(*(deps.admissions.submit(a) for a in arrivals))
    assert [r.outcome for r in results] == ["pending"] * 3
    assert (_carried(deps, "carried"), _carried(deps, "used")) == (0.0, 0.0)


def _carried(deps: SchedulerDeps, step: str) -> float:
    value = deps.metrics.registry.get_sample_value(
        "xpupool_scheduler_carried_reads_total", {"step": step}
    )
    return value or 0.0
