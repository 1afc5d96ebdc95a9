"""A service's start-up state is kept out of the cyclic collector's full passes."""

from __future__ import annotations

import asyncio
import gc
import weakref
from collections.abc import Iterator

import pytest

from xpupool.bus.lifecycle import (
    FULL_COLLECTION_EVERY,
    YOUNG_COLLECTION_THRESHOLD,
    freeze_heap,
    run_until_stopped,
)


class Node:
    """An object that can sit in a reference cycle."""

    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture(autouse=True)
def unfrozen() -> Iterator[None]:
    thresholds = gc.get_threshold()
    gc.unfreeze()
    yield
    gc.unfreeze()
    gc.set_threshold(*thresholds)


def test_garbage_is_collected_before_the_heap_is_frozen() -> None:
    """A reference cycle that is already garbage is freed, not frozen for good; a live one is
    frozen (out of every later collection)."""
    dead, alive = Node(), Node()
    dead.other, alive.other = Node(), Node()
    dead.other.other, alive.other.other = dead, alive
    dead_ref = weakref.ref(dead)
    del dead
    assert dead_ref() is not None  # only the cyclic collector can free it
    freeze_heap()
    assert dead_ref() is None
    assert gc.get_freeze_count() > 0
    assert not any(o is alive for o in gc.get_objects())  # frozen: no longer tracked


async def test_a_service_freezes_its_start_up_state_before_running_its_loops() -> None:
    frozen_at_start: list[int] = []

    async def loop() -> None:
        frozen_at_start.append(gc.get_freeze_count())

    await run_until_stopped(asyncio.Event(), loop())
    assert frozen_at_start and frozen_at_start[0] > 0


def test_after_the_freeze_the_young_generation_is_collected_less_often() -> None:
    """A burst of allocations as an admission batch makes (a thousand live containers) runs no
    collection once the heap is frozen; at CPython's default it ran one."""
    gc.set_threshold(700, 10, 10)
    freeze_heap()
    assert gc.get_threshold() == (YOUNG_COLLECTION_THRESHOLD, 10, FULL_COLLECTION_EVERY)
    collections = 0

    def count(phase: str, info: dict[str, int]) -> None:
        nonlocal collections
        collections += phase == "start"

    gc.callbacks.append(count)
    try:
        batch = [{"job": i, "slices": [i]} for i in range(YOUNG_COLLECTION_THRESHOLD // 4)]
    finally:
        gc.callbacks.remove(count)
    assert len(batch) == YOUNG_COLLECTION_THRESHOLD // 4
    assert collections == 0
