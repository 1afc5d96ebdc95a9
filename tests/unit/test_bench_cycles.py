"""The scheduler's cycle time by phase, as the e2e bench reads it from two scrapes of the
scheduler's own exposition."""

from __future__ import annotations

from types import ModuleType

import pytest
from prometheus_client import generate_latest

from xpupool.scheduler.metrics import SchedulerMetrics


def scrape(bench: ModuleType, metrics: SchedulerMetrics) -> dict[str, float]:
    counts: dict[str, float] = bench.scheduler_counts(generate_latest(metrics.registry).decode())
    return counts


def test_a_cycle_counts_in_all_and_by_phase_and_the_bench_takes_the_means_between_scrapes(
    bench: ModuleType,
) -> None:
    metrics = SchedulerMetrics()
    metrics.observe_cycle(0.010, 0.020, 0.030)  # before the slice the bench measures
    before = scrape(bench, metrics)
    metrics.observe_cycle(0.002, 0.004, 0.006)
    metrics.observe_cycle(0.004, 0.002, 0.010)
    figures = bench.cycle_figures(before, scrape(bench, metrics))

    assert figures["cycles"] == 2
    assert figures["cycle_ms_mean"] == pytest.approx(14.0)
    assert figures["cycle_read_ms_mean"] == pytest.approx(3.0)
    assert figures["cycle_decide_ms_mean"] == pytest.approx(3.0)
    assert figures["cycle_commit_ms_mean"] == pytest.approx(8.0)
    assert bench.cycle_time(figures) == "14.0 ms each, read / decide / commit 3.0 / 3.0 / 8.0"


def test_no_cycle_in_the_slice_reads_zero_rather_than_dividing_by_it(bench: ModuleType) -> None:
    metrics = SchedulerMetrics()
    counts = scrape(bench, metrics)
    figures = bench.cycle_figures(counts, counts)
    assert figures == {
        "cycles": 0.0,
        "cycle_ms_mean": 0.0,
        "cycle_read_ms_mean": 0.0,
        "cycle_decide_ms_mean": 0.0,
        "cycle_commit_ms_mean": 0.0,
    }
