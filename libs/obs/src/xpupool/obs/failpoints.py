"""Failpoints: named places in a service's code where a test makes the process fail on purpose,
so that a crash at an unlucky moment is staged rather than waited for (modelled on etcd's gofail;
the reliability plan's cases F1-F3).

Off unless a service's settings name some (``XPUPOOL_FAILPOINTS``, one string for every service:
each reaches only its own points, which its name prefixes)::

    XPUPOOL_FAILPOINTS="scheduler.admission_committed=kill;lease_manager.lease_ended=2*raise"

A term is one of

- ``kill``: SIGKILL this process (nothing is flushed, no handler runs: a crash);
- ``raise``: raise :class:`FailpointError` where the point is (a handler failing mid-way);
- ``stall(MS)``: block the whole process for MS milliseconds (a stop-the-world pause: the event
  loop, its timers and its connections' keep-alives all wait);

optionally prefixed by ``N*``: only the first N times the point is reached. A point not named
costs one dictionary test. The points are listed in :data:`POINTS` (a misspelt name is refused
when the settings are read, rather than never firing).
"""

from __future__ import annotations

import os
import re
import signal
import time
from dataclasses import dataclass, field
from typing import Final, Literal

__all__ = ["POINTS", "FailpointError", "Failpoints"]

POINTS: Final = {
    "scheduler.admission_committed": (
        "the ledger committed an admission batch (grants on arrival among it), before any of its "
        "grants is answered or published"
    ),
    "scheduler.grants_published": (
        "an admission batch's grants were answered and handed to the connection, before "
        "JetStream's acknowledgements confirm their outbox entries"
    ),
    "scheduler.cycle_committed": (
        "a scheduling cycle's reservations and preemptions are in the ledger, before their "
        "events are published"
    ),
    "lease_manager.lease_ended": (
        "a holder's release ended its lease in the ledger, before the reply and the LeaseEnded "
        "event"
    ),
    "lease_manager.lease_renewed": (
        "a holder's renewal moved its lease's expiry in the ledger, before the reply"
    ),
}

Action = Literal["kill", "raise", "stall"]
_TERM: Final = re.compile(r"^(?:(\d+)\*)?(kill|raise|stall\((\d+)\))$")


class FailpointError(RuntimeError):
    """Raised at a failpoint whose term is ``raise``."""


@dataclass
class _Term:
    action: Action
    stall_ms: int = 0
    left: int | None = None  # how many more times it fires; None: every time


@dataclass
class Failpoints:
    """The failpoints one process has armed (:meth:`parse`); :meth:`reached` at each point."""

    armed: dict[str, _Term] = field(default_factory=dict)

    @classmethod
    def parse(cls, spec: str) -> Failpoints:
        """``name=term;name=term`` (see the module docstring); ``ValueError`` naming what is
        wrong with a bad one."""
        armed: dict[str, _Term] = {}
        for part in filter(None, (p.strip() for p in spec.split(";"))):
            name, _, term = (s.strip() for s in part.partition("="))
            if name not in POINTS:
                raise ValueError(f"unknown failpoint {name!r}; known: {', '.join(sorted(POINTS))}")
            match = _TERM.match(term)
            if match is None:
                raise ValueError(
                    f"failpoint {name}: {term!r} is not kill, raise or stall(MS), "
                    "optionally prefixed N*"
                )
            count, action, stall_ms = match.groups()
            armed[name] = _Term(
                "stall" if stall_ms is not None else action,  # type: ignore[arg-type]
                int(stall_ms or 0),
                None if count is None else int(count),
            )
        return cls(armed)

    def reached(self, name: str) -> None:
        """Fail here if ``name`` is armed (and has firings left)."""
        term = self.armed.get(name)
        if term is None:
            return
        if term.left is not None:
            if term.left <= 0:
                return
            term.left -= 1
        if term.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif term.action == "raise":
            raise FailpointError(f"failpoint {name}")
        else:
            time.sleep(term.stall_ms / 1000)  # the whole process stops, as in a long pause
