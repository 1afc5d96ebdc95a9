"""Which slices are enforced: whole units always, shares only through an env-read mechanism."""

from __future__ import annotations

import pytest

from xpupool.contracts import Vendor
from xpupool.devices.catalog import Catalog
from xpupool.devices.enforcement import is_mig_uuid, slice_enforced


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
