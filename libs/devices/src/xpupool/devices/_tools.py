"""Helpers shared by the CLI-based backends: running a vendor tool and reading its cells."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from typing import Final

from xpupool.contracts import Health
from xpupool.devices.backend import BackendUnavailable

__all__ = [
    "Runner",
    "health_from_word",
    "inum",
    "mib",
    "num",
    "run_tool",
    "subprocess_runner",
]

Runner = Callable[[Sequence[str]], str]
"""Runs ``argv`` and returns its stdout; raises BackendUnavailable. Tests inject fakes."""

DEFAULT_TIMEOUT_S: Final = 10.0
# What vendor tools print for "no value": NVIDIA N/A, Ascend NA and "-", Cambricon N/A.
_MISSING: Final = frozenset({"", "na", "n/a", "-", "--", "none", "unknown", "[n/a]", "xxx"})
_NUMBER: Final = re.compile(r"^[-+]?\d+(?:\.\d+)?")
_UNIT_TO_MIB: Final = {
    "b": 1 / (1024 * 1024),
    "kib": 1 / 1024,
    "kb": 1 / 1024,
    "mib": 1.0,
    "mb": 1.0,
    "gib": 1024.0,
    "gb": 1024.0,
}


def run_tool(argv: Sequence[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> str:
    """Run a vendor tool found on PATH and return its stdout.

    Raises :class:`BackendUnavailable` when the tool is missing, times out, cannot start or
    exits non-zero; the message names the tool and the cause.
    """
    tool = argv[0]
    path = shutil.which(tool)
    if path is None:
        raise BackendUnavailable(f"{tool} not found on PATH")
    command = " ".join(argv)
    try:
        done = subprocess.run(
            [path, *argv[1:]],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            errors="replace",
        )
    except subprocess.TimeoutExpired as exc:
        raise BackendUnavailable(f"{command} timed out after {timeout_s:g} s") from exc
    except OSError as exc:
        raise BackendUnavailable(f"{command} could not start: {exc.strerror}") from exc
    if done.returncode != 0:
        detail = (done.stderr.strip() or done.stdout.strip()).splitlines()
        tail = detail[-1] if detail else "no output"
        raise BackendUnavailable(f"{command} exited with status {done.returncode}: {tail}")
    return done.stdout


def subprocess_runner(timeout_s: float = DEFAULT_TIMEOUT_S) -> Runner:
    """A :data:`Runner` that calls :func:`run_tool` with ``timeout_s``."""

    def run(argv: Sequence[str]) -> str:
        return run_tool(argv, timeout_s)

    return run


def num(text: str | None) -> float | None:
    """The leading number of a cell (``"41C"`` -> 41.0, ``"72W"`` -> 72.0); ``None`` for
    NA, N/A, -, empty or non-numeric cells."""
    if text is None:
        return None
    cell = text.strip()
    if cell.lower() in _MISSING:
        return None
    match = _NUMBER.match(cell)
    return float(match.group(0)) if match else None


def inum(text: str | None) -> int | None:
    """Like :func:`num` but rounded to an int."""
    value = num(text)
    return round(value) if value is not None else None


def mib(value: str | None, unit: str = "mib") -> int | None:
    """A memory figure in ``unit`` (b, kib, mib, gib; 'mb' is read as MiB) converted to MiB."""
    number = num(value)
    if number is None:
        return None
    return round(number * _UNIT_TO_MIB[unit.strip().lower()])


def health_from_word(word: str) -> tuple[Health, list[str]]:
    """Map a vendor health word to ``Health`` plus a reason for anything but OK.

    ``OK`` is healthy, ``Warning`` degraded; ``Alarm``, ``Critical``, ``Error`` and anything
    unrecognised are unhealthy. A missing value (NA) is degraded: we cannot vouch for it.
    """
    cleaned = word.strip()
    lowered = cleaned.lower()
    if lowered in ("ok", "healthy", "normal"):
        return Health.HEALTHY, []
    if lowered in _MISSING:
        return Health.DEGRADED, ["health not reported"]
    if lowered == "warning":
        return Health.DEGRADED, [f"health {cleaned}"]
    return Health.UNHEALTHY, [f"health {cleaned}"]
