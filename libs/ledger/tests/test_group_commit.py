"""Group commit (``xpupool.ledger.group_commit.GroupCommit``), without servers."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from xpupool.ledger.group_commit import GroupCommit


class Recorder:
    """A flush that records each batch and can be held open or made to fail."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail_next: Exception | None = None

    async def flush(self, items: Sequence[int]) -> list[str]:
        self.batches.append(list(items))
        await self.gate.wait()
        if self.fail_next is not None:
            error, self.fail_next = self.fail_next, None
            raise error
        return [f"r{i}" for i in items]


async def test_one_item_is_flushed_alone_and_gets_its_result() -> None:
    recorder = Recorder()
    commit: GroupCommit[int, str] = GroupCommit(recorder.flush)
    assert await commit.submit(7) == "r7"
    assert recorder.batches == [[7]]


async def test_items_handed_in_together_share_one_flush_in_order() -> None:
    recorder = Recorder()
    commit: GroupCommit[int, str] = GroupCommit(recorder.flush)
    results = await asyncio.gather(*(commit.submit(i) for i in range(5)))
    assert results == [f"r{i}" for i in range(5)]
    assert recorder.batches == [[0, 1, 2, 3, 4]]


async def test_items_arriving_during_a_flush_form_the_next_batch() -> None:
    """One flush at a time: what arrives while one runs waits for it, then goes together."""
    recorder = Recorder()
    recorder.gate.clear()
    commit: GroupCommit[int, str] = GroupCommit(recorder.flush)
    first = asyncio.create_task(commit.submit(0))
    await asyncio.sleep(0.01)
    assert recorder.batches == [[0]]
    later = [asyncio.create_task(commit.submit(i)) for i in (1, 2, 3)]
    await asyncio.sleep(0.01)
    assert recorder.batches == [[0]]  # held until the first flush is done
    recorder.gate.set()
    assert await first == "r0"
    assert [await t for t in later] == ["r1", "r2", "r3"]
    assert recorder.batches == [[0], [1, 2, 3]]


async def test_batches_are_capped() -> None:
    recorder = Recorder()
    commit: GroupCommit[int, str] = GroupCommit(recorder.flush, max_batch=2)
    await asyncio.gather(*(commit.submit(i) for i in range(5)))
    assert recorder.batches == [[0, 1], [2, 3], [4]]


async def test_a_failed_flush_fails_its_batch_only() -> None:
    """Every item of a failed batch gets the error (its message is retried by the transport);
    the next batch is flushed as usual."""
    recorder = Recorder()
    recorder.gate.clear()
    recorder.fail_next = ConnectionError("ledger away")
    commit: GroupCommit[int, str] = GroupCommit(recorder.flush)
    failing = [asyncio.create_task(commit.submit(i)) for i in (0, 1)]
    await asyncio.sleep(0.01)
    after = asyncio.create_task(commit.submit(2))
    await asyncio.sleep(0.01)
    recorder.gate.set()
    for task in failing:
        with pytest.raises(ConnectionError):
            await task
    assert await after == "r2"


async def test_a_flush_answering_the_wrong_count_fails_the_batch() -> None:
    async def short(items: Sequence[int]) -> list[str]:
        return ["only-one"]

    commit: GroupCommit[int, str] = GroupCommit(short)
    results = await asyncio.gather(commit.submit(1), commit.submit(2), return_exceptions=True)
    assert all(isinstance(r, RuntimeError) for r in results)


async def test_a_cancelled_flush_cancels_its_waiters() -> None:
    recorder = Recorder()
    recorder.gate.clear()
    commit: GroupCommit[int, str] = GroupCommit(recorder.flush)
    waiter = asyncio.create_task(commit.submit(1))
    await asyncio.sleep(0.01)
    assert commit._runner is not None
    commit._runner.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter


async def test_a_batch_knows_whether_it_followed_another_at_once() -> None:
    """``waiting``: what was handed in during the running flush; ``following``: whether the
    running flush was taken right after another (a backlog), not started by a lone call."""
    seen: list[tuple[int, bool]] = []
    commit: GroupCommit[int, str]

    async def flush(items: Sequence[int]) -> list[str]:
        seen.append((commit.waiting, commit.following))
        await asyncio.sleep(0)
        return [f"r{i}" for i in items]

    commit = GroupCommit(flush, max_batch=1)
    await asyncio.gather(*(commit.submit(i) for i in range(3)))
    assert seen == [(2, False), (1, True), (0, True)]
    assert await commit.submit(9) == "r9"  # a new run: started by a lone call
    assert seen[-1] == (0, False)
