"""Failpoints (``xpupool.obs.failpoints``): what a spec arms, what each term does, and that the
points the services reach are the points it knows (a misspelt one would never fire)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from xpupool.obs.failpoints import POINTS, FailpointError, Failpoints

ROOT = Path(__file__).resolve().parents[2]


def test_nothing_armed_does_nothing() -> None:
    points = Failpoints.parse("")
    for name in POINTS:
        points.reached(name)


def test_raise_fires_at_its_point_only_and_n_times_when_counted() -> None:
    points = Failpoints.parse(
        " scheduler.admission_committed = 2*raise ; lease_manager.lease_ended=raise"
    )
    points.reached("scheduler.cycle_committed")
    for _ in range(2):
        with pytest.raises(FailpointError, match="scheduler.admission_committed"):
            points.reached("scheduler.admission_committed")
    points.reached("scheduler.admission_committed")  # its two firings are spent
    for _ in range(3):
        with pytest.raises(FailpointError):
            points.reached("lease_manager.lease_ended")


def test_stall_blocks_the_process_for_its_milliseconds() -> None:
    points = Failpoints.parse("lease_manager.lease_renewed=1*stall(150)")
    started = time.monotonic()
    points.reached("lease_manager.lease_renewed")
    assert time.monotonic() - started >= 0.15
    started = time.monotonic()
    points.reached("lease_manager.lease_renewed")
    assert time.monotonic() - started < 0.15


def test_kill_ends_the_process_at_once() -> None:
    script = (
        "from xpupool.obs.failpoints import Failpoints\n"
        "p = Failpoints.parse('scheduler.grants_published=kill')\n"
        "print('before', flush=True)\n"
        "p.reached('scheduler.grants_published')\n"
        "print('after', flush=True)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == -signal.SIGKILL
    assert done.stdout == "before\n"


@pytest.mark.parametrize(
    ("spec", "complaint"),
    [
        ("scheduler.admision_committed=kill", "unknown failpoint 'scheduler.admision_committed'"),
        ("scheduler.admission_committed=explode", "is not kill, raise or stall"),
        ("scheduler.admission_committed=stall", "is not kill, raise or stall"),
        ("scheduler.admission_committed", "is not kill, raise or stall"),
    ],
)
def test_a_bad_spec_is_refused_saying_what_is_wrong(spec: str, complaint: str) -> None:
    with pytest.raises(ValueError, match=re.escape(complaint)):
        Failpoints.parse(spec)


def test_every_point_reached_in_the_services_is_known_and_every_known_one_is_reached() -> None:
    sources = "\n".join(
        path.read_text() for path in (ROOT / "services").rglob("*.py") if "bench" not in path.parts
    )
    reached = set(re.findall(r"\.reached\(\s*\"([^\"]+)\"", sources))
    assert reached == set(POINTS)
