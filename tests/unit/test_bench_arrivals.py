"""The e2e bench's open-loop generator: evenly spaced or Poisson arrivals at the asked rate,
neither slowed by a system that answers late."""

from __future__ import annotations

import asyncio
import random
import statistics
from types import ModuleType
from typing import Any

import pytest


class _Client:
    def listen(self, handler: Any) -> None:
        pass


class _TestTime:
    """The generator's clock, moved only by its own sleeps: the schedule it keeps, whatever the
    host's scheduler does to the real one (on a loaded machine, real gaps jitter by
    milliseconds)."""

    def __init__(self) -> None:
        self.now = 0.0

    def clock(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(0)  # what is ready now runs now, as on a real clock
        self.now += seconds


def _starts(bench: ModuleType, poisson: random.Random | None) -> list[float]:
    """When each job of a 1 s open loop at 400/s started. No job is answered before every job
    was submitted: a generator that waited for its answers would never get past the first."""
    load = bench.Load(_Client(), "t")
    at = _TestTime()
    starts: list[float] = []
    all_submitted = asyncio.Event()

    async def one() -> bool:
        starts.append(at.clock())
        if len(starts) == 400:
            all_submitted.set()
        await all_submitted.wait()
        return True

    load.one = one
    asyncio.run(
        asyncio.wait_for(load.open(400.0, 1.0, poisson, clock=at.clock, sleep=at.sleep), 30)
    )
    return starts


def test_arrivals_keep_their_rate_and_poisson_gaps_spread_as_exponential_ones(
    bench: ModuleType,
) -> None:
    """Both keep the rate however late the system answers; Poisson gaps spread as an
    exponential's (standard deviation about the mean), evenly spaced ones not at all."""
    spread = {}
    for name, poisson in (("constant", None), ("poisson", random.Random(1))):
        starts = _starts(bench, poisson)
        gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        assert len(starts) == 400
        assert statistics.fmean(gaps) == pytest.approx(1 / 400, rel=0.3), name
        spread[name] = statistics.pstdev(gaps)
    assert spread["poisson"] > 0.6 / 400
    assert spread["constant"] < 1e-9
