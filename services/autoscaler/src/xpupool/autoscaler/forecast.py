"""Predictive demand: a damped Holt trend plus a time-of-day profile (pure, numpy, no I/O).

The history is a list of ``(at, demand)`` samples (epoch seconds; demand in devices a pool
serves: in use plus actionable pending). It is bucketed into ``bucket_s`` steps (the peak of each
bucket: capacity must meet the peak, not the mean; an empty bucket repeats the last value) and
run through additive Holt-Winters smoothing whose seasonal term is indexed by **time of day**
(``season_s``, a day by default): slot ``k`` is the ``k``-th ``bucket_s`` of the day, whatever
the history's start. Per bucket::

    level  = alpha * (y - season[slot]) + (1 - alpha) * (level + phi * trend)
    trend  = beta * (level - level_prev) + (1 - beta) * phi * trend
    season[slot] = gamma * (y - level) + (1 - gamma) * season[slot]

and ``h`` buckets ahead the forecast is ``level + (phi + ... + phi**h) * trend + season[slot+h]``
(never below zero). The trend is damped (``phi`` < 1) so a ramp is followed without running away.
The first full season of history initialises the profile (its deviation from its mean); with
less than a season the profile starts flat and learns as slots come round.

:func:`forecast` answers for ``now + horizon_s`` (the pool's provisioning delay): ``demand`` at
the horizon and ``peak``, the most demand expected between now and then: provisioning for
``peak`` now has the capacity up when a recurring burst starts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = ["Forecast", "SmoothingParams", "bucketize", "forecast"]


@dataclass(frozen=True, slots=True)
class SmoothingParams:
    """Smoothing weights: level ``alpha``, trend ``beta``, time-of-day profile ``gamma``, trend
    damping ``phi``."""

    alpha: float = 0.3
    beta: float = 0.05
    gamma: float = 0.3
    phi: float = 0.95

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "gamma", "phi"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be between 0 and 1, got {value!r}")


@dataclass(frozen=True, slots=True)
class Forecast:
    """The forecast made at ``now`` for ``now + horizon_s``: ``demand`` then, ``peak`` between
    now and then; ``series`` the bucket-by-bucket forecast (one per bucket after now's), and the
    model's state (``level``, ``trend``) for metrics and tests."""

    now: float
    horizon_s: float
    demand: float
    peak: float
    series: tuple[float, ...]
    level: float
    trend: float
    observations: int


def bucketize(
    samples: Sequence[tuple[float, float]], *, start: float, end: float, bucket_s: float
) -> npt.NDArray[np.float64]:
    """Peak demand per bucket ``[start + i*bucket_s, start + (i+1)*bucket_s)`` up to the one
    holding ``end``; an empty bucket repeats the previous one (0 before the first sample)."""
    n = int((end - start) // bucket_s) + 1
    out = np.full(n, np.nan)
    if samples:
        data = np.asarray(samples, dtype=np.float64).reshape(-1, 2)
        keep = (data[:, 0] >= start) & (data[:, 0] <= end)
        data = data[keep]
        if len(data):
            index = ((data[:, 0] - start) // bucket_s).astype(np.int64)
            peaks = np.full(n, -np.inf)
            np.maximum.at(peaks, index, data[:, 1])
            out = np.where(np.isfinite(peaks), peaks, np.nan)
    last = 0.0
    for i in range(n):  # forward-fill
        if math.isnan(out[i]):
            out[i] = last
        else:
            last = float(out[i])
    return out


def forecast(
    samples: Sequence[tuple[float, float]],
    now: float,
    horizon_s: float,
    *,
    bucket_s: float = 300.0,
    season_s: float = 24 * 3600.0,
    lookback_s: float = 7 * 24 * 3600.0,
    params: SmoothingParams | None = None,
) -> Forecast:
    """Forecast demand ``horizon_s`` after ``now`` from the samples of the last
    ``lookback_s`` (see the module docstring)."""
    if bucket_s <= 0 or season_s < bucket_s or horizon_s < 0:
        raise ValueError("need bucket_s > 0, season_s >= bucket_s and horizon_s >= 0")
    params = params or SmoothingParams()
    # Align buckets to the time of day so that slot k is the same clock time every day.
    first = min((at for at, _ in samples if at >= now - lookback_s), default=now)
    start = math.floor(first / bucket_s) * bucket_s
    y = bucketize(samples, start=start, end=now, bucket_s=bucket_s)
    slots = max(1, round(season_s / bucket_s))

    def slot(i: int) -> int:
        return int(round((start + i * bucket_s) / bucket_s)) % slots

    season = np.zeros(slots)
    n = len(y)
    if n >= slots:
        first_season = y[:slots]
        mean = float(first_season.mean())
        for i in range(slots):
            season[slot(i)] = first_season[i] - mean
        level = mean
    else:
        level = float(y[0]) if n else 0.0
    trend = 0.0
    a, b, g, phi = params.alpha, params.beta, params.gamma, params.phi
    for i in range(n):
        k = slot(i)
        previous = level
        observed = float(y[i])
        level = a * (observed - float(season[k])) + (1 - a) * (level + phi * trend)
        trend = b * (level - previous) + (1 - b) * phi * trend
        season[k] = g * (observed - level) + (1 - g) * float(season[k])

    steps = max(1, math.ceil(horizon_s / bucket_s - 1e-9)) if horizon_s > 0 else 0
    series: list[float] = []
    damp = 0.0
    for h in range(1, steps + 1):
        damp += phi**h
        series.append(max(0.0, level + damp * trend + float(season[slot(n - 1 + h)])))
    current = float(y[-1]) if n else 0.0
    demand = series[-1] if series else current
    return Forecast(
        now=now,
        horizon_s=horizon_s,
        demand=demand,
        peak=max([current, *series]),
        series=tuple(series),
        level=level,
        trend=trend,
        observations=n,
    )
