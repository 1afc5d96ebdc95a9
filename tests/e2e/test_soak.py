"""A short soak (``bench/soak/soak.py``; ``just soak`` runs ten minutes): the stack under two
tenants' load and a hostile third while every family of fault is injected, then the reliability
plan's invariants (I1 no double allocation, I2 one outcome per accepted job and one end per
grant, I3 nothing leaked, I4 a queue's limit held, I5 stale tokens and I6 other tenants'
commands refused, no tenant sent another's events) and the ledger's audit."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak" / "soak.py"


def _soak_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


async def test_a_short_soak_with_every_fault_family_breaks_no_invariant() -> None:
    soak = _soak_module()
    report = await soak.soak(minutes=0.75, seed=7, workers=6, fault_every_s=4)
    assert report.violations == [], report.violations
    assert len(report.faults) >= 4, report.faults  # one round: every family once
    assert {f.split()[0] for f in report.faults} >= {"kill", "pause", "restart", "failpoint"}
    assert report.recovery_s is not None
    assert report.seen.get("AllocationGranted", 0) > 50, report.seen
    # The commands that must be refused were sent, and answered (refused).
    answered = {kind.split()[0] for kind, n in report.refusals.items() if "unanswered" not in kind}
    assert answered == {"I5", "I6"}, report.refusals
    assert report.events_delivered > 50
