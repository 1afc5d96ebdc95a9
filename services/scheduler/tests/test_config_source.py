"""The queue file reloaded as the operator edits it: an edit takes effect within the recheck
period, a bad edit keeps the last good configuration, and a fixed edit is taken again."""

from __future__ import annotations

import os
from pathlib import Path

from xpupool.scheduler.config_source import ConfigSource

GOOD = "default_priority: normal\nqueues:\n  - name: research\n    weight: {weight}\n"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def write(path: Path, text: str, stamp_ns: int) -> None:
    """Write ``text`` with a modification time of its own (edits within one filesystem tick
    would otherwise look alike)."""
    path.write_text(text, encoding="utf-8")
    os.utime(path, ns=(stamp_ns, stamp_ns))


def weight(source: ConfigSource) -> float:
    return next(q.weight for q in source.current().queues.values() if q.name == "research")


def test_an_edit_is_taken_within_the_recheck_period(tmp_path: Path) -> None:
    path, clock = tmp_path / "queues.yaml", Clock()
    write(path, GOOD.format(weight=2), 1_000_000_000)
    source = ConfigSource(path, recheck_s=1.0, clock=clock)
    assert weight(source) == 2
    write(path, GOOD.format(weight=5), 2_000_000_000)
    clock.now = 0.5
    assert weight(source) == 2  # not looked at yet
    clock.now = 1.0
    assert weight(source) == 5
    clock.now = 1.2
    assert weight(source) == 5


def test_a_bad_edit_keeps_the_last_good_configuration_until_fixed(tmp_path: Path) -> None:
    path, clock = tmp_path / "queues.yaml", Clock()
    write(path, GOOD.format(weight=2), 1_000_000_000)
    source = ConfigSource(path, recheck_s=1.0, clock=clock)
    write(path, "queues: [{name: research, weight: -1}]\n", 2_000_000_000)
    clock.now = 1.0
    assert weight(source) == 2
    clock.now = 2.0
    assert weight(source) == 2
    write(path, GOOD.format(weight=3), 3_000_000_000)
    clock.now = 3.0
    assert weight(source) == 3
