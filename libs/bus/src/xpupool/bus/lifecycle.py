"""Process lifecycle: open the bus, stop on SIGINT/SIGTERM, run a service's loops until then.

A service never lives on deaf. nats-py reconnects after a lost connection, but a connection the
server closed with an error (``-ERR 'Maximum Payload Violation'``, say) is closed for good, and
every later call fails with ``ConnectionClosedError``. ``watch_bus`` turns that state into a
``BusClosed`` error that ends ``run_until_stopped``; ``supervise`` then runs the service again,
in-process, on a fresh connection.

Shutdown is bounded whatever the connections do: loops get ``SHUTDOWN_TIMEOUT_S`` to finish once
cancelled, and the bus is drained only while connected, within its drain timeout, then closed. A
run still opening its bus (nats-py retries a first connection forever) is cancelled at once.

A service started by a parent that set ``XPUPOOL_PARENT_PID`` (``xpupool dev up``, the demo,
the tests' stacks) stops as on SIGTERM when that parent is gone, however it died: the services of
a killed stack do not outlive it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
import threading
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from xpupool.bus.connection import BusSettings, connect, declare_streams
from xpupool.bus.publisher import Publisher
from xpupool.obs import get_logger

SHUTDOWN_TIMEOUT_S = 5.0
CANCEL_AGAIN_AFTER_S = 0.5
WATCH_INTERVAL_S = 0.5


class BusClosed(ConnectionError):
    """The NATS connection was closed for good while the service was meant to be running."""


# The stop events of runs that reached ``run_until_stopped`` (``supervise`` cancels the others at
# once when stopped).
_running: weakref.WeakSet[asyncio.Event] = weakref.WeakSet()

PARENT_PID_ENV = "XPUPOOL_PARENT_PID"
PARENT_CHECK_INTERVAL_S = 0.5
# The last resort after SIGTERM: the bounded shutdown takes a few seconds at most.
HARD_EXIT_AFTER_S = 15.0
_hard_exit: threading.Timer | None = None
_watchers: set[asyncio.Task[None]] = set()


def run_service(main: Coroutine[Any, Any, None]) -> None:
    """Run a service's main coroutine to completion on uvloop where it is installed (a
    service spends most of its CPU in the event loop: scheduling callbacks, socket reads and
    writes), else on asyncio's own loop. ``XPUPOOL_EVENT_LOOP=asyncio`` picks the latter."""
    if os.environ.get("XPUPOOL_EVENT_LOOP", "uvloop") != "asyncio":
        try:
            import uvloop
        except ImportError:
            pass
        else:
            uvloop.run(main)
            return
    asyncio.run(main)


YOUNG_COLLECTION_THRESHOLD = 2_000
"""Container objects allocated (net of those freed) between two collections of the youngest
generation once the heap is frozen (CPython's default is 700): a message's short-lived structs
and dicts mostly die by reference counting before a collection sees them, instead of being
promoted to the older generations. Larger was measured and not taken: at 10,000 the collector's
time fell further, but the serial submit-to-grant p50 rose by 0.2-0.4 ms in five of five
alternating pairs (likely because a larger young generation keeps more garbage cycles' memory
out of reuse; not measured further)."""
FULL_COLLECTION_EVERY = 100
"""Middle-generation collections between two full ones (CPython's default is 10). A full pass
walks everything not frozen, 29-44 ms in the scheduler at 10,000 devices, a stall of every
request in flight: at the defaults it came 18-26 times in one ``just bench --devices 10000``
run and was half the collector's time (``bench/e2e/PROFILE.md``, "The cyclic collector,
counted"). Garbage cycles that reach the oldest generation are still collected, later."""


def freeze_heap() -> None:
    """Collect what is garbage now, then take every object still alive out of the cyclic
    collector's view (``gc.freeze``), and collect less often from now on
    (``YOUNG_COLLECTION_THRESHOLD``, ``FULL_COLLECTION_EVERY``).

    A full collection walks every tracked object, and a service's heap is mostly what lives as
    long as it does: modules, connections, and in the scheduler its copy of the ledger. At
    10,000 devices such passes took 47 ms in the lease-manager and 103 ms in the scheduler, each
    a stall of every request in flight (the open-loop p99). Frozen objects are still freed by
    reference counting when dropped; only a reference cycle among them would stay, which is
    why this is called once the long-lived state is built (start-up, a full ledger read), not
    on a timer.
    """
    gc.collect()
    gc.freeze()
    _, middle, _ = gc.get_threshold()
    gc.set_threshold(YOUNG_COLLECTION_THRESHOLD, middle, FULL_COLLECTION_EVERY)


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGINT or SIGTERM (call from inside the running loop), and, where
    ``$XPUPOOL_PARENT_PID`` names this process's parent, once that parent is gone."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, _stop_now, stop)
    parent = os.environ.get(PARENT_PID_ENV, "")
    if parent.isdigit():
        task = loop.create_task(watch_parent(int(parent), stop))
        _watchers.add(task)
        task.add_done_callback(_watchers.discard)
    return stop


def _stop_now(stop: asyncio.Event) -> None:
    """Set ``stop``, and make sure the process is gone ``HARD_EXIT_AFTER_S`` later even if
    something swallowed the cancellation (``asyncio.run`` would wait for it forever)."""
    global _hard_exit
    stop.set()
    if _hard_exit is None:
        _hard_exit = threading.Timer(HARD_EXIT_AFTER_S, _exit_now)
        _hard_exit.daemon = True
        _hard_exit.start()


def _exit_now() -> None:
    os.write(2, f"still running {HARD_EXIT_AFTER_S:g} s after stop: exiting\n".encode())
    os._exit(70)


async def watch_parent(
    parent: int, stop: asyncio.Event, *, interval_s: float = PARENT_CHECK_INTERVAL_S
) -> None:
    """Set ``stop`` once this process is no longer ``parent``'s child (an orphan is adopted by
    another process: ``getppid`` changes, which a recycled pid cannot fake)."""
    while not stop.is_set():
        if os.getppid() != parent:
            get_logger().warning("parent_gone", parent_pid=parent)
            _stop_now(stop)
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval_s)


async def watch_bus(
    nc: Client, stop: asyncio.Event, *, interval_s: float = WATCH_INTERVAL_S
) -> None:
    """Return when ``stop`` is set; raise ``BusClosed`` if ``nc`` closes before that.

    Run it as one of the service's loops (``run_until_stopped``): a closed connection then ends
    the service instead of leaving its loops failing forever.
    """
    while not stop.is_set():
        if nc.is_closed:
            raise BusClosed(f"NATS connection closed ({nc.last_error!r})")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval_s)


async def run_until_stopped(
    stop: asyncio.Event,
    *loops: Coroutine[Any, Any, None],
    shutdown_timeout_s: float = SHUTDOWN_TIMEOUT_S,
) -> None:
    """Run the service's loops; when ``stop`` is set, or any loop ends, stop them all.

    A loop that raises is a bug or a lost bus (``BusClosed`` from ``watch_bus``), not a transient
    fault (those are retried inside each loop): the error is raised again here, for
    ``supervise`` to restart the service or the process to exit non-zero. Loops get
    ``shutdown_timeout_s`` to finish once cancelled; one that does not is logged and left.
    """
    log = get_logger()
    _running.add(stop)
    freeze_heap()  # what start-up built lives as long as the service
    tasks = [asyncio.create_task(loop) for loop in loops]
    stopper = asyncio.create_task(stop.wait())
    try:
        done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
    finally:
        stop.set()
        stopper.cancel()
        for task in tasks:
            if not task.done():
                task.cancel()
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=shutdown_timeout_s)
            if stuck:
                log.error("loops_not_stopping", loops=len(stuck))
    failed = [
        t for t in done if t is not stopper and not t.cancelled() and t.exception() is not None
    ]
    log.info("service_stopped", error=repr(failed[0].exception()) if failed else None)
    if failed:
        raise failed[0].exception()  # type: ignore[misc]


RESTART_ON: tuple[type[BaseException], ...] = (BusClosed, nats.errors.ConnectionClosedError)
# A re-run may find the server still away; its connect failing is retried too (not the first
# run's: a service that cannot reach its bus at start-up exits, as before).
RESTART_ON_RECONNECT: tuple[type[BaseException], ...] = (
    *RESTART_ON,
    nats.errors.NoServersError,
    ConnectionError,
    TimeoutError,
)


async def supervise(
    run_once: Callable[[asyncio.Event], Awaitable[None]],
    stop: asyncio.Event,
    *,
    backoff_s: float = 1.0,
    max_backoff_s: float = 30.0,
    shutdown_timeout_s: float = 2 * SHUTDOWN_TIMEOUT_S,
) -> None:
    """Run ``run_once`` until ``stop`` is set, again whenever it ends because the bus closed.

    ``run_once(run_stop)`` opens its own bus (and everything else it needs, in its own
    ``AsyncExitStack``) and runs its loops with ``run_stop``: an event set when ``stop`` is,
    and set by ``run_until_stopped`` when one of the run's loops ends, so that ending one run
    never stops the next. It is restarted after ``BusClosed`` or ``ConnectionClosedError``
    (logged as ``service_restarting``; waits ``backoff_s``, doubling up to ``max_backoff_s``
    while runs keep failing); any other error propagates, and a run that returns while ``stop``
    is unset ends the supervision too. Once ``stop`` is set, a run that has not ended within
    ``shutdown_timeout_s`` is cancelled (one still connecting is cancelled at once: nats-py
    retries a first connection forever and would never look at ``run_stop``).
    """
    log = get_logger()
    restarts = 0
    while not stop.is_set():
        run_stop = asyncio.Event()
        mirror = asyncio.create_task(_set_when(stop, run_stop))
        try:
            await _until_stopped(run_once(run_stop), run_stop, stop, shutdown_timeout_s)
            return
        except Exception as error:
            if not isinstance(error, RESTART_ON_RECONNECT if restarts else RESTART_ON):
                raise
            if stop.is_set():
                return
            delay = min(backoff_s * 2 ** min(restarts, 16), max_backoff_s)
            restarts += 1
            log.warning("service_restarting", error=repr(error), restarts=restarts, backoff_s=delay)
        finally:
            mirror.cancel()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=delay)


async def _until_stopped(
    run: Awaitable[None],
    run_stop: asyncio.Event,
    stop: asyncio.Event,
    shutdown_timeout_s: float,
) -> None:
    """Await ``run``; once ``stop`` is set, cancel it at once if it has not reached
    ``run_until_stopped`` yet (it may be connecting forever), else give it
    ``shutdown_timeout_s`` to end before cancelling it. A cancelled run ends quietly."""
    task = asyncio.ensure_future(run)
    stopper = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait([task, stopper], return_when=asyncio.FIRST_COMPLETED)
        if not task.done() and run_stop in _running:
            await asyncio.wait([task], timeout=shutdown_timeout_s)
    finally:
        stopper.cancel()
        if not task.done():
            get_logger().warning("run_cancelled_at_stop", started=run_stop in _running)
            # A cancellation can be lost: Python 3.11's wait_for swallows one that lands as its
            # timeout fires, and nats-py's first connect (retried forever) sits in one. Seen
            # in CI: a service started with NATS gone kept reconnecting until the hard exit.
            while not task.done():
                task.cancel()
                await asyncio.wait([task], timeout=CANCEL_AGAIN_AFTER_S)
    if not task.cancelled():
        task.result()


async def _set_when(source: asyncio.Event, target: asyncio.Event) -> None:
    await source.wait()
    target.set()


@dataclass(frozen=True)
class Bus:
    """A service's NATS connection, its JetStream context and its publisher."""

    nc: Client
    js: JetStreamContext
    publisher: Publisher


async def close_bus(nc: Client, timeout_s: float | None = None) -> None:
    """Drain ``nc`` if it is connected, within ``timeout_s`` (default: its drain timeout plus a
    second), then make sure it is closed. Never raises, never waits on a server that is away:
    nats-py's ``drain`` refuses a reconnecting connection, and its final flush would wait."""
    log = get_logger()
    if nc.is_closed:
        return
    if timeout_s is None:
        timeout_s = float(nc.options.get("drain_timeout") or SHUTDOWN_TIMEOUT_S) + 1.0
    try:
        if nc.is_connected:
            await asyncio.wait_for(nc.drain(), timeout=timeout_s)
    except Exception as error:  # noqa: BLE001  (a drain that fails still ends in a close)
        log.warning("nats_drain_failed", error=repr(error))
    finally:
        if not nc.is_closed:
            try:
                await asyncio.wait_for(nc.close(), timeout=timeout_s)
            except Exception as error:  # noqa: BLE001
                log.warning("nats_close_failed", error=repr(error))


async def open_bus(
    stack: AsyncExitStack, settings: BusSettings | str, name: str = "xpupool", source: str = ""
) -> Bus:
    """Connect (drained, or closed, when ``stack`` closes), declare the streams where this
    identity may, build the publisher.

    ``settings``: the service's ``BusSettings`` (``bus_settings(role, name, settings)``: TLS,
    credentials, inbox prefix), or only a URL (an open server), then named ``name``.
    ``source`` is the CloudEvents source of what the service publishes (default
    ``/services/<name>``).
    """
    if isinstance(settings, str):
        settings = BusSettings(url=settings, name=name)
    nc = await connect(settings)
    stack.push_async_callback(close_bus, nc, settings.drain_timeout_s + 1.0)
    js = nc.jetstream()
    await declare_streams(js, settings)
    return Bus(nc, js, Publisher(nc, source=source or f"/services/{settings.name}"))
