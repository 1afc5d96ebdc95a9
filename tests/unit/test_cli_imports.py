"""What the command line imports to start: a researcher's `xpupool run` pays for each module."""

from __future__ import annotations

import subprocess
import sys

# Each is needed by some commands (status, usage, explain, dev up, the queue file's checks),
# imported by them when they run: none by `xpupool run`, `submit` or the other NATS commands.
NOT_AT_START = (
    "numpy",
    "redis",
    "yaml",
    "xpupool.ledger",
    "xpupool.placement",
    "xpupool.scheduler",
    "xpupool.devstack.stack",
)


def test_the_cli_starts_without_the_ledger_numpy_or_the_dev_stack() -> None:
    probe = (
        "import sys\n"
        "from xpupool.cli.main import build_parser\n"
        "build_parser().parse_args(['run', '--tenant', 't', '--', 'true'])\n"
        f"print(' '.join(m for m in {NOT_AT_START!r} if m in sys.modules))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.split() == [], done.stdout
