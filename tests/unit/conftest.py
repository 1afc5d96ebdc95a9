"""Fixtures shared by the unit tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH_E2E = Path(__file__).resolve().parents[2] / "bench" / "e2e" / "bench_e2e.py"


@pytest.fixture(scope="session")
def bench() -> ModuleType:
    """The end-to-end bench script (``bench/e2e/bench_e2e.py``) as a module, for its helpers."""
    spec = importlib.util.spec_from_file_location("bench_e2e", BENCH_E2E)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered first: its dataclasses look their module up while being made.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
