"""The job environment: visible devices per vendor, share limits where a vendor has them."""

from __future__ import annotations

import msgspec
import pytest

from xpupool.contracts import DeviceSlice, Vendor
from xpupool.devices import load_catalog, slice_enforced
from xpupool.devices.environment import job_environment

VISIBLE = (
    "NVIDIA_VISIBLE_DEVICES",
    "CUDA_VISIBLE_DEVICES",
    "ASCEND_VISIBLE_DEVICES",
    "ASCEND_RT_VISIBLE_DEVICES",
    "CAMBRICON_VISIBLE_DEVICES",
    "MLU_VISIBLE_DEVICES",
    "AMD_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES",
    "HIP_VISIBLE_DEVICES",
    "HYGON_VISIBLE_DEVICES",
    "XPUPOOL_SIMULATED_VISIBLE_DEVICES",
)


def test_host_only_job_sees_no_device_of_any_vendor() -> None:
    """No slices: each vendor's visible-device variable is set, to the empty "no device"."""
    env = job_environment([], "job", "lease", 3)
    assert {name: env.get(name) for name in VISIBLE} == dict.fromkeys(VISIBLE, "")
    assert env["XPUPOOL_LEASE_ID"] == "lease" and env["XPUPOOL_FENCING_TOKEN"] == "3"
    assert not any("LIMIT" in name or "QUOTA" in name for name in env)


def test_device_job_gets_only_its_vendors_variables() -> None:
    """A job with slices keeps the previous behaviour: only its vendors' variables."""
    gpu = DeviceSlice(
        device_id="n/nvidia0",
        node_id="n",
        vendor=Vendor.NVIDIA,
        model="A100",
        index=0,
        uuid="GPU-1",
        memory_mib=81920,
        compute_pct=100,
        whole=True,
    )
    env = job_environment([gpu], "job", "lease", 1)
    assert env["CUDA_VISIBLE_DEVICES"] == "GPU-1"
    assert "ROCR_VISIBLE_DEVICES" not in env


def _slice(
    vendor: Vendor, index: int, *, uuid: str = "", whole: bool = False, memory_mib: int = 8192
) -> DeviceSlice:
    return DeviceSlice(
        device_id=f"n/{vendor.value}{index}",
        node_id="n",
        vendor=vendor,
        model="m",
        index=index,
        uuid=uuid or f"{vendor.value}-{index}",
        memory_mib=memory_mib,
        compute_pct=100 if whole else 25,
        whole=whole,
    )


def _limits(env: dict[str, str]) -> set[str]:
    """The variables of env that limit a share (anything but identity and visibility)."""
    return {
        name
        for name in env
        if not name.startswith("XPUPOOL_") and not name.endswith("VISIBLE_DEVICES")
    }


@pytest.mark.parametrize(
    ("vendor", "visible"),
    [
        (Vendor.AMD, {"AMD_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"}),
        (Vendor.HYGON, {"HYGON_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"}),
        (Vendor.CAMBRICON, {"CAMBRICON_VISIBLE_DEVICES", "MLU_VISIBLE_DEVICES"}),
    ],
)
def test_shares_without_a_limit_variable_get_visibility_only(
    vendor: Vendor, visible: set[str]
) -> None:
    """AMD, Hygon and Cambricon shares see their devices by host index and get no invented
    limit; the slice a scheduler builds for them says it is not enforced."""
    env = job_environment([_slice(vendor, 3), _slice(vendor, 1)], "job", "lease", 1)
    assert {name: env[name] for name in visible} == dict.fromkeys(visible, "1,3")
    assert not _limits(env)
    isolation = next(e.isolation for e in load_catalog() if e.vendor is vendor)
    assert not slice_enforced(vendor, isolation, whole=False)
    assert slice_enforced(vendor, isolation, whole=True)


def test_mig_instance_is_visible_by_its_uuid_without_mps_limits() -> None:
    """A MIG instance, whole or shared, is named by its MIG- UUID and gets no MPS/HAMi limit."""
    for whole in (True, False):
        mig = _slice(Vendor.NVIDIA, 0, uuid="MIG-4b2c", whole=whole, memory_mib=40960)
        env = job_environment([mig], "job", "lease", 1)
        assert env["NVIDIA_VISIBLE_DEVICES"] == env["CUDA_VISIBLE_DEVICES"] == "MIG-4b2c"
        assert not _limits(env)
        assert slice_enforced(Vendor.NVIDIA, ["mig"], whole, uuid=mig.uuid) is whole


def test_mixed_grant_limits_only_the_mps_share_at_its_position() -> None:
    """MIG instance, MPS share and whole GPU together: limits name only the share's position,
    and its compute limit is not lowered by the MIG instance's compute."""
    mig = _slice(Vendor.NVIDIA, 0, uuid="MIG-aa", memory_mib=20480)
    share = _slice(Vendor.NVIDIA, 1, uuid="GPU-bb", memory_mib=10000)
    share = DeviceSlice(**{**msgspec.structs.asdict(share), "compute_pct": 40})
    whole = _slice(Vendor.NVIDIA, 2, uuid="GPU-cc", whole=True)
    amd = _slice(Vendor.AMD, 0)
    env = job_environment([whole, share, mig, amd], "job", "lease", 1)
    assert env["CUDA_VISIBLE_DEVICES"] == "MIG-aa,GPU-bb,GPU-cc"
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "1=10000M"
    assert env["CUDA_DEVICE_MEMORY_LIMIT_1"] == "10000m"
    assert "CUDA_DEVICE_MEMORY_LIMIT_0" not in env and "CUDA_DEVICE_MEMORY_LIMIT_2" not in env
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == env["CUDA_DEVICE_SM_LIMIT"] == "40"
    assert env["ROCR_VISIBLE_DEVICES"] == "0"


def test_a_share_called_enforced_has_limits_in_its_environment() -> None:
    """For every catalog model, a share the scheduler-side rule calls enforced gets a limit
    variable from this builder (the converse need not hold: Ascend gets NPU_MEM_QUOTA whether
    or not HAMi's vNPU core runs, and only the catalog says whether it does)."""
    verdicts = set()
    for entry in load_catalog():
        env = job_environment([_slice(entry.vendor, 0, uuid="GPU-x")], "job", "lease", 1)
        enforced = slice_enforced(entry.vendor, entry.isolation, whole=False)
        assert not enforced or _limits(env), entry.name
        verdicts.add(enforced)
    assert verdicts == {True, False}
