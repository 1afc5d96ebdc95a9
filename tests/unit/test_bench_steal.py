"""The cores a shared machine's hypervisor took from the bench's slices, as it reports them."""

from __future__ import annotations

from types import ModuleType

import pytest


def test_steal_counts_only_inside_the_slices_it_was_started_and_stopped_around(
    bench: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = {"steal": 100.0, "wall": 1000.0}
    monkeypatch.setattr(bench, "host_steal_s", lambda: clock["steal"])
    monkeypatch.setattr(bench.time, "monotonic", lambda: clock["wall"])
    meter = bench.StealMeter()
    for stolen_inside, wall_inside in ((0.5, 2.0), (1.5, 2.0)):
        meter.start()
        clock["steal"] += stolen_inside
        clock["wall"] += wall_inside
        meter.stop()
        clock["steal"] += 7.0  # between slices (the floor's turn): not this meter's
        clock["wall"] += 3.0

    assert meter.steal_s == pytest.approx(2.0)
    assert meter.wall_s == pytest.approx(4.0)
    assert meter.cores == pytest.approx(0.5)


def test_a_meter_never_started_reads_zero_and_the_table_says_nothing(bench: ModuleType) -> None:
    assert bench.StealMeter().cores == 0.0
    assert bench.stolen(0.0, 0.0) == ""
    assert bench.stolen(None) == ""
    assert (
        bench.stolen(0.25, 0.05) == "; the host took 0.25 of the cores (in the floor's slices 0.05)"
    )


def test_the_machine_says_how_much_it_lost_so_far(bench: ModuleType) -> None:
    first = bench.host_steal_s()
    assert first >= 0.0
    assert bench.host_steal_s() >= first
