"""Which slices are enforced: whole units always, shares only through an env-read mechanism
that runs on the node."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from xpupool.contracts import Vendor
from xpupool.devices.catalog import Catalog
from xpupool.devices.enforcement import (
    is_mig_uuid,
    mps_running,
    running_isolation,
    running_share_limits,
    slice_enforced,
)


@pytest.mark.parametrize(
    ("model", "enforced"),
    [
        ("A100-80GB", True),  # MPS / HAMi-core limits
        ("T4", True),
        ("910B3", True),  # HAMi vNPU core reads NPU_MEM_QUOTA
        ("Ascend910", False),  # vNPU only: made by the runtime, not limited by env
        ("MLU370-X8", False),  # sMLU / MIM are made by the device plugin
        ("RX7800XT", False),
        ("K100_AI", False),
    ],
)
def test_shares_by_catalog_isolation(catalog: Catalog, model: str, enforced: bool) -> None:
    """A share is enforced exactly when the model lists a mechanism the environment limits."""
    entry = catalog.lookup(model)
    assert entry is not None, model
    assert slice_enforced(entry.vendor, entry.isolation, whole=False) is enforced
    assert slice_enforced(entry.vendor, entry.isolation, whole=True)


def test_mig_instance_whole_or_shared() -> None:
    """A whole MIG instance is isolated; a share of one gets no limits, so it is not."""
    assert slice_enforced(Vendor.NVIDIA, ["mig"], whole=True, uuid="MIG-1")
    assert not slice_enforced(Vendor.NVIDIA, ["mig"], whole=False, uuid="MIG-1")
    # Even were a catalog override to list MPS for it, the environment gives it no MPS limit.
    assert not slice_enforced(Vendor.NVIDIA, ["mig", "mps"], whole=False, uuid="MIG-1")
    assert is_mig_uuid("MIG-GPU-27b9/1/0") and not is_mig_uuid("GPU-27b9")


# -- which share limits run on the node ---------------------------------------------------------


@contextmanager
def mps_daemon(directory: Path) -> Iterator[None]:
    """A stand-in for the MPS control daemon: ``control`` as driver 580 makes it (a UNIX
    SOCK_SEQPACKET socket, listening), left behind as a stale socket afterwards."""
    directory.mkdir(exist_ok=True)
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as server:
        server.bind(str(directory / "control"))
        server.listen()
        yield


def test_mps_runs_while_its_control_socket_answers(tmp_path: Path) -> None:
    directory = tmp_path / "mps"
    assert not mps_running(str(directory))  # no directory
    with mps_daemon(directory):
        assert mps_running(str(directory))
    assert (directory / "control").exists()
    assert not mps_running(str(directory))  # the socket file stays; nobody answers it


def test_an_older_drivers_fifo_counts_only_with_a_reader(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "control")
    assert not mps_running(str(tmp_path))
    reader = os.open(tmp_path / "control", os.O_RDONLY | os.O_NONBLOCK)
    try:
        assert mps_running(str(tmp_path))
    finally:
        os.close(reader)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "control").write_text("")
    assert not mps_running(str(tmp_path / "other"))


def test_auto_finds_mps_on_a_real_node_and_trusts_the_catalog_on_a_simulated_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "mps"))
    with mps_daemon(tmp_path / "mps"):
        assert running_share_limits("auto", simulated=False) == {"mps"}
        assert running_share_limits("auto", simulated=True) is None
    assert running_share_limits("auto", simulated=False) == frozenset()


def test_named_share_limits_are_taken_as_named() -> None:
    assert running_share_limits("catalog", simulated=False) is None
    assert running_share_limits("mps, hami-core", simulated=False) == {"mps", "hami-core"}
    assert running_share_limits("none", simulated=True) == frozenset()
    with pytest.raises(ValueError, match="unknown \\['mpss'\\]"):
        running_share_limits("mpss", simulated=False)


def test_a_share_is_enforced_only_through_a_mechanism_that_runs() -> None:
    """The catalog lists MPS and HAMi-core for NVIDIA GPUs; on a node running neither, a share
    is a promise (seen on an H200: 20 GiB allocated on a 16 GiB share without the MPS daemon)."""
    listed = ["mig", "mps", "hami-core"]
    assert running_isolation(listed, None) == listed
    assert running_isolation(listed, frozenset({"mps"})) == ["mig", "mps"]
    bare = running_isolation(listed, frozenset())
    assert bare == ["mig"]
    assert not slice_enforced(Vendor.NVIDIA, bare, whole=False)
    assert slice_enforced(Vendor.NVIDIA, bare, whole=True)
    assert slice_enforced(Vendor.NVIDIA, running_isolation(listed, frozenset({"mps"})), False)
