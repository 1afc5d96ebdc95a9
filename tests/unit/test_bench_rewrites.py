"""The e2e bench's account of Redis's AOF rewrites in an open-loop phase: the windows read from
Redis's own log, and the jobs that overlapped none of them, apart."""

from __future__ import annotations

import gc
from datetime import datetime
from pathlib import Path
from types import ModuleType

import pytest

# Lines as redis-server 7.0 writes them (pid:role, local time to the millisecond).
LOG = """\
6712:M 05 Dec 2026 17:15:54.761 * Creating AOF base file appendonly.aof.1.base.rdb on server start
6712:M 05 Dec 2026 17:16:10.553 * Starting automatic rewriting of AOF on 6755247800% growth
6712:M 05 Dec 2026 17:16:10.556 * Background append only file rewriting started by pid 6730
6730:C 05 Dec 2026 17:16:10.762 * Successfully created the temporary AOF base file temp-rewriteaof-bg-6730.aof
6712:M 05 Dec 2026 17:16:10.866 * Background AOF rewrite terminated with success
6712:M 05 Dec 2026 17:16:10.871 * Background AOF rewrite finished successfully
6712:M 05 Dec 2026 17:16:18.482 * Background append only file rewriting started by pid 6733
"""  # noqa: E501


def at(stamp: str) -> float:
    return datetime.strptime(f"05 Dec 2026 {stamp}", "%d %b %Y %H:%M:%S.%f").timestamp()


def test_windows_come_from_the_main_process_lines_clipped_to_the_phase(
    bench: ModuleType, tmp_path: Path
) -> None:
    log = tmp_path / "server.log"
    log.write_text(LOG)
    since, until = at("17:16:00.000"), at("17:16:20.000")
    windows = bench.aof_rewrite_windows(log, since, until)
    # The first ran 310 ms; the second was still running when the phase ended.
    assert windows == [(at("17:16:10.556"), at("17:16:10.866")), (at("17:16:18.482"), until)]
    # A phase that began after the first rewrite sees only the second, from its own start.
    assert bench.aof_rewrite_windows(log, at("17:16:19.000"), until) == [
        (at("17:16:19.000"), until)
    ]
    assert bench.aof_rewrite_windows(log, at("17:16:11.000"), at("17:16:18.000")) == []


def test_jobs_overlapping_a_rewrite_are_set_apart(bench: ModuleType) -> None:
    windows = [(10.0, 11.0)]
    # (submit, seconds to the grant)
    granted = [(9.0, 0.5), (9.9, 0.2), (10.5, 0.1), (10.95, 0.25), (11.0, 0.3), (12.0, 0.004)]
    calm = bench.outside_rewrites(granted, windows)
    assert calm == pytest.approx([0.5, 0.3, 0.004])
    assert bench.p99_ms_outside_rewrites(granted, windows, counted=1) == pytest.approx(500)


def test_no_figure_when_redis_counted_a_rewrite_its_log_did_not_show(bench: ModuleType) -> None:
    """A server whose log words a rewrite otherwise must not pass the whole phase's p99 off as
    the p99 outside rewrites."""
    granted = [(9.0, 0.5), (12.0, 0.004)]
    assert bench.p99_ms_outside_rewrites(granted, [], counted=1) is None
    assert bench.p99_ms_outside_rewrites(granted, [], counted=0) == pytest.approx(500)


def test_the_load_generator_heap_is_frozen_before_a_measured_slice(bench: ModuleType) -> None:
    """Everything alive before a slice is out of the collector's view, and a full pass counted
    since the mark is one that happened after it."""
    held = [[i] for i in range(10_000)]  # a heap of the run's bookkeeping
    thresholds = gc.get_threshold()
    mark = bench.quiet_collector()
    try:
        assert gc.get_freeze_count() >= len(held)
        assert bench.full_passes_since(mark) == 0
        gc.collect()
        assert bench.full_passes_since(mark) == 1
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
