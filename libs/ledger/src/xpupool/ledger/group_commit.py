"""Group commit: the calls handed in while the ledger is busy with the last batch are committed
together, in one ledger round trip (and one fsync).

At low load a batch is one call and costs no waiting (the flush starts on the next turn of the
event loop); under load the batch grows with whatever arrived during the previous flush, so the
cost per call falls as the rate rises. One flush runs at a time, in arrival order, which also
keeps the ledger's order the order calls were handed in. The scheduler admits job requests this
way (one placement decision per batch too); the ledger batches holder commands with it.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

Item = TypeVar("Item")
Result = TypeVar("Result")


@dataclass
class GroupCommit(Generic[Item, Result]):
    """Collects items and commits them in batches with ``flush`` (one result per item, in
    order); ``submit`` returns an item's result once its batch is committed.

    With ``depth`` 2 the next batch's flush starts as soon as the running one calls
    ``hand_off`` (its commit is on its way and it no longer needs to go first), so the two
    overlap: the scheduler decides the next batch while the ledger commits this one. A flush
    that never hands off is waited for, as with ``depth`` 1. The flush itself keeps the commits
    in order (the scheduler's take its snapshot lock); results are answered per batch."""

    flush: Callable[[Sequence[Item]], Awaitable[Sequence[Result]]]
    max_batch: int = 256
    depth: int = 1
    _waiting: list[tuple[Item, asyncio.Future[Result]]] = field(default_factory=list)
    _runner: asyncio.Task[None] | None = None
    # The running flushes and, per flush, the future its hand-off resolves.
    _handoffs: dict[asyncio.Task[None], asyncio.Future[None]] = field(default_factory=dict)
    _arrived: asyncio.Event = field(default_factory=asyncio.Event)
    following: bool = False
    """Whether the batch being committed was handed in while the previous one was: its flush
    starts right after that one's, so calls keep coming (a backlog, however short)."""

    @property
    def busy(self) -> bool:
        """Whether a batch is being committed or waits to be."""
        return bool(self._waiting) or (self._runner is not None and not self._runner.done())

    @property
    def waiting(self) -> int:
        """How many items wait for the next batch (handed in while this one is committed)."""
        return len(self._waiting)

    def hand_off(self) -> None:
        """Called by a flush (in its own task) once the next batch's flush may start: with
        ``depth`` 2 it then runs beside this one. Without effect elsewhere."""
        task = asyncio.current_task()
        handoff = self._handoffs.get(task) if task is not None else None
        if handoff is not None and not handoff.done():
            handoff.set_result(None)

    async def submit(self, item: Item) -> Result:
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._waiting.append((item, future))
        self._arrived.set()
        if self._runner is None or self._runner.done():
            # A context of its own: a batch is nobody's (not the first submitter's trace).
            self._runner = asyncio.create_task(self._run(), context=contextvars.Context())
        return await future

    async def _run(self) -> None:
        await asyncio.sleep(0)  # let the requests already received join this batch
        self.following = False
        loop = asyncio.get_running_loop()
        before: asyncio.Task[None] | None = None  # the last flush started (it may still run)
        try:
            while True:
                if not self._waiting:
                    if before is None or before.done():
                        return
                    # A flush runs on: the next batch starts with the next arrival, beside it.
                    self._arrived.clear()
                    arrival = asyncio.ensure_future(self._arrived.wait())
                    await asyncio.wait({before, arrival}, return_when=asyncio.FIRST_COMPLETED)
                    arrival.cancel()
                    continue
                batch = self._waiting[: self.max_batch]
                del self._waiting[: self.max_batch]
                handoff: asyncio.Future[None] = loop.create_future()
                task = asyncio.create_task(self._flush_batch(batch), context=contextvars.Context())
                self._handoffs[task] = handoff
                before = task
                await asyncio.wait(
                    {task} if self.depth < 2 else {task, handoff},
                    return_when=asyncio.FIRST_COMPLETED,
                )
                self.following = True
        except asyncio.CancelledError:
            for task in self._handoffs:
                task.cancel()
            for _, future in self._waiting:
                future.cancel()
            raise

    async def _flush_batch(self, batch: list[tuple[Item, asyncio.Future[Result]]]) -> None:
        try:
            results = await self.flush([item for item, _ in batch])
            if len(results) != len(batch):
                raise RuntimeError(f"flush answered {len(results)} of {len(batch)} items")
        except asyncio.CancelledError:
            for _, future in batch:
                future.cancel()
            raise
        except Exception as error:  # noqa: BLE001  (each waiter gets it, and retries as it will)
            for _, future in batch:
                if not future.done():
                    future.set_exception(error)
            return
        else:
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)
        finally:
            task = asyncio.current_task()
            if task is not None:
                handoff = self._handoffs.pop(task, None)
                if handoff is not None and not handoff.done():
                    handoff.set_result(None)
