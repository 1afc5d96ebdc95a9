"""Fixtures shared by the unit tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH_E2E_DIR = Path(__file__).resolve().parents[2] / "bench" / "e2e"


def _script_module(name: str) -> ModuleType:
    """A script of ``bench/e2e`` as a module, for its helpers."""
    spec = importlib.util.spec_from_file_location(name, BENCH_E2E_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    # Registered first: its dataclasses look their module up while being made.
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def bench() -> ModuleType:
    """The end-to-end bench script (``bench/e2e/bench_e2e.py``)."""
    return _script_module("bench_e2e")


@pytest.fixture(scope="session")
def timeline() -> ModuleType:
    """The open phases' second-by-second account (``bench/e2e/timeline.py``)."""
    return _script_module("timeline")
