"""The forecaster: a recurring daily burst is forecast before it starts; a ramp is followed."""

from __future__ import annotations

import numpy as np
import pytest

from xpupool.autoscaler.forecast import SmoothingParams, bucketize, forecast

DAY = 86400.0
HOUR = 3600.0
STEP = 300.0
T0 = 1_790_000_000.0 - (1_790_000_000.0 % DAY)  # a midnight (UTC)


def daily_burst(days: int, until_s: float, seed: int = 1) -> list[tuple[float, float]]:
    """Demand of 2 devices, 12 from 09:00 to 11:00 every day, a little noise, one sample a
    minute, from T0 to T0 + until_s."""
    rng = np.random.default_rng(seed)
    out = []
    for t in np.arange(T0, T0 + until_s, 60.0):
        clock = (t - T0) % DAY
        base = 12.0 if 9 * HOUR <= clock < 11 * HOUR else 2.0
        out.append((float(t), base + float(rng.uniform(-0.3, 0.3))))
    assert days * DAY <= until_s + DAY
    return out


def test_the_forecast_rises_before_a_recurring_burst() -> None:
    now = T0 + 3 * DAY + 8 * HOUR + 45 * 60  # day 4, 08:45: still quiet
    history = daily_burst(3, now - T0)
    assert history[-1][1] < 3  # nothing yet in the live demand
    ahead = forecast(history, now, horizon_s=20 * 60, bucket_s=STEP)  # provisioning delay
    assert ahead.demand > 8, ahead  # 09:05 forecast: the burst
    assert ahead.peak >= ahead.demand
    assert ahead.series[0] < 4  # 08:50 still quiet: it rises at the burst, not before
    # The same model at 03:00 forecasts the quiet level.
    night = T0 + 3 * DAY + 3 * HOUR
    quiet = forecast(daily_burst(3, night - T0), night, horizon_s=20 * 60, bucket_s=STEP)
    assert quiet.peak < 4, quiet


def test_without_a_full_day_of_history_it_is_a_trend_model() -> None:
    """A ramp of one device per 10 minutes: the forecast is above the last value, damped."""
    now = T0 + 6 * HOUR
    history = [(T0 + s, s / 600.0) for s in np.arange(0, 6 * HOUR + 1, 60.0)]
    ahead = forecast(history, now, horizon_s=30 * 60, bucket_s=STEP)
    last = history[-1][1]
    assert last < ahead.demand < last + 3 * 1.5, ahead
    assert ahead.trend > 0


def test_empty_and_flat_histories() -> None:
    assert forecast([], T0, horizon_s=600).peak == 0.0
    flat = [(T0 + s, 5.0) for s in np.arange(0, 2 * DAY, 300.0)]
    ahead = forecast(flat, T0 + 2 * DAY - 300, horizon_s=900)
    assert ahead.demand == pytest.approx(5.0, abs=0.05)
    assert forecast(flat, T0 + DAY, horizon_s=0).series == ()


def test_bucketize_keeps_the_peak_and_carries_empty_buckets() -> None:
    samples = [(T0 + 10, 1.0), (T0 + 20, 4.0), (T0 + 700, 2.0)]
    out = bucketize(samples, start=T0, end=T0 + 1000, bucket_s=300)
    assert out.tolist() == [4.0, 4.0, 2.0, 2.0]


def test_smoothing_weights_are_checked() -> None:
    with pytest.raises(ValueError, match="alpha"):
        SmoothingParams(alpha=1.5)
    with pytest.raises(ValueError):
        forecast([], T0, horizon_s=60, bucket_s=0)
