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
    order); ``submit`` returns an item's result once its batch is committed."""

    flush: Callable[[Sequence[Item]], Awaitable[Sequence[Result]]]
    max_batch: int = 256
    _waiting: list[tuple[Item, asyncio.Future[Result]]] = field(default_factory=list)
    _runner: asyncio.Task[None] | None = None
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

    async def submit(self, item: Item) -> Result:
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._waiting.append((item, future))
        if self._runner is None or self._runner.done():
            # A context of its own: a batch is nobody's (not the first submitter's trace).
            self._runner = asyncio.create_task(self._run(), context=contextvars.Context())
        return await future

    async def _run(self) -> None:
        await asyncio.sleep(0)  # let the requests already received join this batch
        self.following = False
        while self._waiting:
            batch = self._waiting[: self.max_batch]
            del self._waiting[: self.max_batch]
            try:
                results = await self.flush([item for item, _ in batch])
                if len(results) != len(batch):
                    raise RuntimeError(f"flush answered {len(results)} of {len(batch)} items")
            except asyncio.CancelledError:
                for _, future in batch + self._waiting:
                    future.cancel()
                raise
            except Exception as error:  # noqa: BLE001  (each waiter gets it, and retries as it will)
                for _, future in batch:
                    if not future.done():
                        future.set_exception(error)
                continue
            for (_, future), result in zip(batch, results, strict=True):
                if not future.done():
                    future.set_result(result)
            self.following = True
