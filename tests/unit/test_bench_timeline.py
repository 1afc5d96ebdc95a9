"""The e2e bench's second-by-second account of an open phase (``bench/e2e/timeline.py``): which
bins a stall or an AOF rewrite made slow, and the percentiles of each."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

import pytest


def test_a_stall_shows_in_its_own_bin_and_a_rewrite_is_marked(timeline: ModuleType) -> None:
    # 100 jobs a second for three seconds at 2 ms, but ten jobs of the second second waited
    # 40 ms, and a rewrite ran inside the third.
    start = 1_000.0
    granted = [(start + i / 100, 0.002) for i in range(300)]
    granted[150:160] = [(start + i / 100, 0.040) for i in range(150, 160)]
    lines = timeline.timeline(granted, [(start + 2.2, start + 2.5)])
    assert len(lines) == 3
    calm, stalled, rewritten = lines
    assert "100 jobs" in calm and "p99     2.0" in calm and "AOF" not in calm
    # Ten of a hundred are slow: the bin's p90 and above show them, its median does not.
    assert "p50     2.0" in stalled and "p99    40.0" in stalled and "max    40.0" in stalled
    assert rewritten.endswith("AOF rewrite")


def test_reads_what_the_bench_wrote(
    timeline: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    phase = {"granted": [[5.0, 0.010], [5.5, 0.020], [6.2, 0.004]], "aof_rewrites": []}
    (tmp_path / "fleet-1000-open-50.json").write_text(json.dumps(phase))
    assert timeline.main([str(tmp_path), "--bin-s", "0.5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "== fleet-1000-open-50"
    assert [line.split()[0] for line in out[1:]] == ["0.0", "0.5", "1.0"]
    with pytest.raises(SystemExit, match="no \\*-open-\\*.json"):
        timeline.main([str(tmp_path / "empty")])


def test_redis_latency_events_go_to_the_seconds_they_overlap(timeline: ModuleType) -> None:
    # Bins of one second from 100.5; Redis samples whole seconds of the wall clock.
    granted = [(100.5 + i / 10, 0.003) for i in range(30)]
    events = {"aof-fsync-always": [(100, 2), (101, 5), (102, 3)], "command": [(102, 1)]}
    first, second, third = timeline.timeline(granted, [], 1.0, events)
    # [100.5, 101.5) overlaps the samples of seconds 100 and 101: the slower is shown.
    assert first.endswith("aof-fsync-always 5 ms")
    assert second.endswith("aof-fsync-always 5 ms  command 1 ms")
    assert third.endswith("aof-fsync-always 3 ms  command 1 ms")
    assert "aof" not in timeline.timeline(granted, [], 1.0, {"command": [(50, 9)]})[0]
