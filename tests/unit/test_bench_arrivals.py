"""The e2e bench's open-loop generator: evenly spaced or Poisson arrivals at the asked rate,
neither slowed by a system that answers late."""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from types import ModuleType
from typing import Any

import pytest


class _Client:
    def listen(self, handler: Any) -> None:
        pass


def _starts(bench: ModuleType, poisson: random.Random | None) -> list[float]:
    """When each job of a 1 s open loop at 400/s started, each answered only after 50 ms."""
    load = bench.Load(_Client(), "t")
    starts: list[float] = []

    async def one() -> bool:
        starts.append(time.perf_counter())
        await asyncio.sleep(0.05)
        return True

    load.one = one
    asyncio.run(load.open(400.0, 1.0, poisson))
    return starts


def test_arrivals_keep_their_rate_and_poisson_gaps_spread_as_exponential_ones(
    bench: ModuleType,
) -> None:
    """Both keep the rate however late the system answers; Poisson gaps spread as an
    exponential's (standard deviation about the mean), evenly spaced ones hardly at all."""
    spread = {}
    for name, poisson in (("constant", None), ("poisson", random.Random(1))):
        starts = _starts(bench, poisson)
        gaps = [b - a for a, b in zip(starts, starts[1:], strict=False)]
        assert len(starts) == 400
        assert statistics.fmean(gaps) == pytest.approx(1 / 400, rel=0.3), name
        spread[name] = statistics.pstdev(gaps)
    assert spread["poisson"] > 0.6 / 400
    assert spread["constant"] < spread["poisson"] / 2
