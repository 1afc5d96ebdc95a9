"""Shared fixtures for the xpupool-devices tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from xpupool.devices.catalog import Catalog, load_catalog

_FIXTURE_SUBDIR = Path("shared") / "fixtures" / "vendor-cli"


def find_vendor_fixtures() -> Path:
    """Walk up from this file to the first ``shared/fixtures/vendor-cli`` next to or above it."""
    for parent in Path(__file__).resolve().parents:
        candidate = parent / _FIXTURE_SUBDIR
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        f"no {_FIXTURE_SUBDIR} found above {Path(__file__).parent}; the vendor CLI fixtures "
        "live in the shared folder next to the repository (see shared/fixtures/vendor-cli)"
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Parametrize ``fixture_file`` over every file in the fixture directory, so a new file is
    picked up without editing the tests; a missing directory yields one failing case."""
    if "fixture_file" not in metafunc.fixturenames:
        return
    try:
        root = find_vendor_fixtures()
    except FileNotFoundError as exc:
        metafunc.parametrize("fixture_file", [pytest.param(None, id=f"MISSING: {exc}")])
        return
    files = sorted(p for p in root.rglob("*") if p.is_file() and p.suffix != ".md")
    metafunc.parametrize("fixture_file", files, ids=[str(p.relative_to(root)) for p in files])


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    """The vendor CLI fixture directory; fails loudly when it is missing."""
    try:
        return find_vendor_fixtures()
    except FileNotFoundError as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="session")
def catalog() -> Catalog:
    """The shipped catalog, ignoring any XPUPOOL_CATALOG in the environment."""
    return load_catalog(env={})
