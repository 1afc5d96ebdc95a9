"""``xpupool demo`` end to end: the burst is settled, the ledger audit is clean, and the
autoscaled pool grows under the burst and is back at its minimum after the cool-down."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("flags", [[], ["--secure"]], ids=["plain", "secure"])
def test_the_demo_scales_its_pool_up_and_back_down(flags: list[str]) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("XPUPOOL_")}
    done = subprocess.run(
        [sys.executable, "-m", "xpupool.cli.main", "demo", *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ledger audit   consistent" in done.stdout
    scaled = re.search(r"pool t4-burst: 0 -> (\d+) nodes under the burst, (\d+) after", done.stdout)
    assert scaled is not None, done.stdout
    assert int(scaled.group(1)) >= 1 and int(scaled.group(2)) == 0
