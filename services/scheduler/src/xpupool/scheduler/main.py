"""Scheduler entry point: wires NATS, Redis and the handlers, runs until SIGTERM."""

from __future__ import annotations

import asyncio
import functools
import time
import uuid
from collections.abc import Coroutine
from contextlib import AsyncExitStack, suppress
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.msg import Msg

from xpupool.bus import DispatchStats, Publisher, consume_stream, serve_subject
from xpupool.bus.connection import bus_settings
from xpupool.bus.lifecycle import (
    freeze_heap,
    open_bus,
    run_service,
    run_until_stopped,
    stop_on_signals,
    supervise,
    watch_bus,
)
from xpupool.contracts import NodeProvisioning, NodeReady, access, subjects
from xpupool.ledger import FairShareView, Ledger, OutboxRelay, each_entry, open_ledger
from xpupool.obs import configure_logging, configure_tracing, get_logger, load_settings
from xpupool.obs.metrics import LoopLag, watch_loop_lag
from xpupool.placement.default import DefaultPolicy
from xpupool.placement.engine import PlacementPolicy
from xpupool.placement.node_policies import make_trace_policies, parse_aliases
from xpupool.placement.workload import load_demands
from xpupool.scheduler import handlers
from xpupool.scheduler.capacity_watch import CapacityWatch
from xpupool.scheduler.config_source import ConfigSource
from xpupool.scheduler.domain import current_usage, update_history
from xpupool.scheduler.domain.config import BUILTIN_POLICIES, ROOT
from xpupool.scheduler.metrics import serve_metrics
from xpupool.scheduler.settings import SchedulerSettings
from xpupool.scheduler.snapshot_cache import SnapshotCache

SERVICE = "scheduler"
CYCLE_LOCK_MS = 10_000
# How many job requests one replica handles at once (what one admission batch can hold).
ADMISSION_CONCURRENCY = 256
# How long a replica keeps the cycle lock, after a cycle that had work, waiting for more.
CYCLE_LOCK_LINGER_S = 0.05
# How often, at most, an idle replica reads in changes of live load alone (``keep_warm``): a
# fraction of a telemetry interval (seconds), so the kept copy's utilisation is never much older
# than the samples themselves.
LOAD_CATCH_UP_S = 0.5


class CycleLock:
    """The ledger's cycle lock as this replica holds it.

    Replicas take turns through it so they do not decide the same queue twice at once; safety
    never rests on it (every commit re-checks in its script). A busy replica keeps it from one
    cycle to the next and extends it only when half its term is gone, so a burst does not pay
    two ledger writes (each one fsynced) per cycle; it gives it back as soon as a cycle finds
    nothing pending, or when nothing new arrives shortly after a cycle, so a peer that admitted
    work waits at most that long.
    """

    def __init__(self, ledger: Ledger, owner: str, ttl_ms: int = CYCLE_LOCK_MS) -> None:
        self._ledger = ledger
        self._owner = owner
        self._ttl_s = ttl_ms / 1000
        self._until = 0.0  # monotonic time before which the lock is surely ours

    @property
    def held(self) -> bool:
        return time.monotonic() < self._until

    async def take(self) -> bool:
        """Hold the lock for the next cycle: already ours with half its term left, or taken
        (or extended) now; False if a peer holds it."""
        now = time.monotonic()
        if now < self._until - self._ttl_s / 2:
            return True
        if not await self._ledger.acquire("cycle", self._owner, int(self._ttl_s * 1000)):
            self._until = 0.0
            return False
        self._until = now + self._ttl_s
        return True

    async def give_back(self) -> None:
        """Let a peer in now. Never fails: with the ledger away (restarting, still loading its
        data) the lock is left to run out its term, which is all a give-back shortens."""
        self._until = 0.0
        try:
            await self._ledger.release_lock("cycle", self._owner)
        except Exception as error:  # noqa: BLE001  (it expires on its own)
            get_logger().warning("cycle_lock_give_back_failed", error=repr(error))


async def _woken(wake: asyncio.Event, timeout_s: float) -> bool:
    with suppress(TimeoutError):
        await asyncio.wait_for(wake.wait(), timeout=timeout_s)
        return True
    return False


async def cycle_loop(
    deps: handlers.SchedulerDeps,
    publisher: Publisher,
    stop: asyncio.Event,
    lease_ends: CapacityWatch,
) -> None:
    """Run a scheduling cycle whenever something may have changed, and at least periodically.

    The cycle lock (``CycleLock``) makes replicas take turns; a replica that finds it taken
    tries again shortly, so work admitted on any replica is decided promptly. ``lease_ends`` is
    followed while jobs wait (``CapacityWatch``).
    """
    log = get_logger()
    lock = CycleLock(deps.ledger, f"scheduler-{uuid.uuid4().hex[:8]}")
    while not stop.is_set():
        if lock.held:
            if not await _woken(deps.wake, CYCLE_LOCK_LINGER_S):
                await lock.give_back()  # quiet after a busy cycle: let a peer in
                continue
        else:
            await _woken(deps.wake, deps.settings.retry_interval_s)
        deps.wake.clear()
        try:
            if not lock.held and not await deps.ledger.any_pending():
                # Nothing waits (placement on admission granted what arrived): no lock, no cycle.
                deps.last_pending = 0
                deps.metrics.observe_queues(())
                await lease_ends.rest()
                continue
            # Before the cycle reads the pool: a lease end after that read wakes the next.
            await lease_ends.follow()
            if not await lock.take():
                # A peer decides the waiting jobs now and reports their queues: this replica's
                # gauges of its last cycle would otherwise stay as they were for as long.
                deps.metrics.observe_queues(())
                await asyncio.sleep(0.02)
                deps.wake.set()
                continue
            events = await handlers.schedule_cycle(deps)
            if not deps.last_pending:
                await lock.give_back()
                await lease_ends.rest()
            # Published outside the lock when it was given back: a replica waiting for it need
            # not wait for these.
            await publisher.publish_all(events)
        except Exception as error:  # noqa: BLE001  (Redis or NATS away: the next cycle retries)
            log.warning("scheduling_cycle_failed", error=repr(error))
            await lock.give_back()
            await asyncio.sleep(0.2)


async def pool_metrics_loop(deps: handlers.SchedulerDeps, stop: asyncio.Event) -> None:
    """Refresh the pool gauges from the ledger on the event loop, so a scrape (on the metrics
    server's thread) only renders the last summary and never touches Redis or the loop; and
    publish the fair-share position to the ledger for ``xpupool status`` at the same pace, off
    the scheduling cycle's path. It reads through the cycles' snapshot cache (which serialises
    its readers), so it re-reads nothing a cycle or an admission batch read already."""
    while not stop.is_set():
        try:
            config = deps.config.current()
            snapshot, _, pool = await deps.snapshots.read_pool(deps.ledger, config)
            await deps.metrics.observe_pool(snapshot)
            # Fair share folds in the usage it sees at every cycle; while placement on admission
            # grants without cycles, this keeps sampling it.
            deps.history = update_history(
                deps.history, current_usage(pool), snapshot.now_s, config.fair_share.half_life_s
            )
            deps.metrics.observe_fair_share({q: u.units for q, u in deps.history.usage.items()})
            if deps.history is not None:
                units = {q: u.units for q, u in deps.history.usage.items()}
                total = units.pop(ROOT, sum(units.values()))
                await deps.ledger.publish_fair_share(FairShareView(time.time(), units, total))
        except Exception as error:  # noqa: BLE001  (Redis away: keep the last summary, retry)
            get_logger().warning("pool_metrics_refresh_failed", error=repr(error))
        with suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=deps.settings.scheduler_metrics_refresh_s)


async def keep_warm(deps: handlers.SchedulerDeps, stop: asyncio.Event) -> None:
    """Bring the kept copy of the ledger up to date as soon as the change feed announces a
    change while this replica has nothing else to do, so that a lone arrival is placed on it
    without a read of its own (``SnapshotCache.kept_pool``), and the default policy's own view
    of it with it (``DefaultPolicy.warm``; the first read after a start also seeds its learned
    shapes). Under load it stays out of the way: an admission batch or a cycle reads for
    itself. Its own grants alone wake no read.

    Live load alone (utilisation samples, which withdraw no kept pool) is read in at most every
    ``LOAD_CATCH_UP_S``: a fleet's busy devices report it many times a second in all, and a
    read per sample would keep an idle scheduler reading."""
    cache = deps.snapshots
    loop = asyncio.get_running_loop()
    armed = False  # a timer will wake this loop for live load when it is due

    def due() -> None:
        nonlocal armed
        armed = False
        cache.changed.set()

    while not stop.is_set():
        # No timeout per wait (it wakes several times per grant under load): the service's
        # loops are cancelled when it stops.
        await cache.changed.wait()
        cache.changed.clear()
        if deps.admissions.busy or deps.last_pending or not cache.wants_read():
            continue
        if cache.load_only_unread():
            wait = LOAD_CATCH_UP_S - cache.since_read_s()
            if wait > 0:
                # Armed again if it fires early (libuv's timers keep milliseconds).
                if not armed:
                    armed = True
                    loop.call_later(wait, due)
                continue
        try:
            _, _, pool = await cache.read_pool(deps.ledger, deps.config.current())
            # What the next lone decision would otherwise build first (the first one after a
            # start: the whole node view and the learned shapes' seed), done while idle.
            deps.default_policy.warm(pool)
        except Exception as error:  # noqa: BLE001  (Redis away: the next arrival reads itself)
            get_logger().warning("snapshot_warm_read_failed", error=repr(error))
            await asyncio.sleep(0.2)


def warm_copy_loops(
    deps: handlers.SchedulerDeps, stop: asyncio.Event
) -> list[Coroutine[Any, Any, None]]:
    """The ledger's change feed into the snapshot cache, and ``keep_warm`` on it (none when
    placement on the kept copy is off)."""
    if not deps.settings.decide_on_kept_copy:
        return []
    return [deps.ledger.follow_changes(deps.snapshots.note_change, stop), keep_warm(deps, stop)]


def trace_policies(settings: SchedulerSettings) -> list[PlacementPolicy]:
    """The trace policies, told to expect the configured workload file (if any)."""
    workload = (
        load_demands(Path(settings.placement_workload)) if settings.placement_workload else None
    )
    return list(
        make_trace_policies(
            workload, parse_aliases(settings.placement_model_aliases), settings.placement_seed
        )
    )


async def run(settings: SchedulerSettings) -> None:
    """Run one scheduler replica until SIGINT/SIGTERM; replicas share the job consumer."""
    configure_logging(SERVICE, settings.log_level)
    provider = configure_tracing(SERVICE)
    stop = stop_on_signals()
    async with AsyncExitStack() as stack:
        ledger = await open_ledger(
            stack, settings.redis_url, settings.namespace, tls_ca=settings.redis_tls_ca
        )
        extra = trace_policies(settings)
        config = ConfigSource(
            Path(settings.queue_config) if settings.queue_config else None,
            known_policies=(*BUILTIN_POLICIES, *(p.name for p in extra)),
        )
        deps = handlers.SchedulerDeps(
            ledger=ledger,
            settings=settings,
            config=config,
            default_policy=DefaultPolicy.create(half_life=settings.placement_shape_half_life),
            extra_policies=extra,
            # The copy of the ledger a full read builds lives until the next one.
            snapshots=SnapshotCache(after_full_read=freeze_heap),
        )
        stats = DispatchStats()
        if settings.scheduler_metrics_port:
            port = stack.enter_context(
                serve_metrics(
                    deps.metrics.registry,
                    settings.scheduler_metrics_port,
                    settings.scheduler_metrics_addr,
                )
            )
            get_logger().info("metrics_serving", addr=settings.scheduler_metrics_addr, port=port)
        loop_lag = LoopLag(deps.metrics.registry) if settings.scheduler_metrics_port else None

        async def on_capacity_change(_: Any) -> None:
            handlers.wake_for_capacity(deps)

        scale_events = msgspec.json.Decoder(NodeProvisioning | NodeReady)
        log = get_logger()

        async def on_scale(msg: Msg) -> None:
            try:
                event = scale_events.decode(msg.data)
            except msgspec.ValidationError as error:
                log.warning("scale_event_invalid", subject=msg.subject, error=str(error))
                return
            await handlers.on_scale_event(event, deps)

        async def run_once(run_stop: asyncio.Event) -> None:
            # Everything on NATS lives here: a closed connection re-opens all of it (supervise).
            async with AsyncExitStack() as bus_stack:
                bus = await open_bus(
                    bus_stack, bus_settings(access.SCHEDULER, SERVICE, settings), SERVICE
                )
                # Requests submitted by request/reply are handled side by side as well, and
                # share admission batches with the stream's. Served first: a replica that
                # answers queries takes submissions too.
                await serve_subject(
                    bus.nc,
                    subjects.JOB_SUBMIT,
                    functools.partial(handlers.submit_job, deps=deps),
                    bus.publisher,
                    queue=SERVICE,
                    on_invalid=handlers.reject_invalid_submit,
                    stats=stats,
                    too_large_reply=handlers.submit_reply_too_large,
                    concurrency=ADMISSION_CONCURRENCY,
                )
                for channel, handler, on_invalid, too_large in (
                    (
                        subjects.JOB_LIST,
                        handlers.list_jobs,
                        handlers.reject_invalid_list,
                        handlers.list_reply_too_large,
                    ),
                    (
                        subjects.JOB_CANCEL,
                        handlers.cancel_job,
                        handlers.reject_invalid_cancel,
                        handlers.cancel_reply_too_large,
                    ),
                ):
                    await serve_subject(
                        bus.nc,
                        channel,
                        functools.partial(handler, deps=deps),
                        bus.publisher,
                        queue=SERVICE,
                        on_invalid=on_invalid,
                        stats=stats,
                        too_large_reply=too_large,
                    )
                # Lease ends only while jobs wait (``CapacityWatch``); nodes and health, rare,
                # always.
                for channel in (subjects.NODE_REGISTERED, subjects.DEVICE_HEALTH):
                    await bus.nc.subscribe(channel.pattern, cb=on_capacity_change)
                lease_ends = CapacityWatch(
                    bus.nc, functools.partial(handlers.wake_for_capacity, deps)
                )
                # Every replica keeps its own view of the incoming capacity (no queue group).
                for channel in (subjects.SCALE_PROVISIONING, subjects.SCALE_READY):
                    await bus.nc.subscribe(channel.pattern, cb=on_scale)
                relay = OutboxRelay(
                    ledger,
                    SERVICE,
                    each_entry(functools.partial(handlers.build_events, ledger=ledger)),
                    bus.publisher.send,
                )
                await run_until_stopped(
                    run_stop,
                    watch_bus(bus.nc, run_stop),
                    consume_stream(
                        bus.js,
                        subjects.SCHEDULER_JOBS,
                        functools.partial(handlers.admit_job, deps=deps),
                        bus.publisher,
                        run_stop,
                        on_invalid=handlers.reject_invalid_request,
                        on_give_up=handlers.give_up_request,
                        stats=stats,
                        # Requests are handled side by side so that admission batches them.
                        concurrency=ADMISSION_CONCURRENCY,
                    ),
                    relay.run(run_stop),
                    deps.direct.run(bus.publisher.send, run_stop),
                    cycle_loop(deps, bus.publisher, run_stop, lease_ends),
                    pool_metrics_loop(deps, run_stop),
                    *warm_copy_loops(deps, run_stop),
                    *watch_loop_lag(loop_lag, run_stop),
                )

        await supervise(run_once, stop)
    provider.shutdown()


def main() -> None:
    """Console entry point."""
    run_service(run(load_settings(SchedulerSettings)))


if __name__ == "__main__":
    main()
