"""The job environment of a host-only lease: every vendor's visible devices, empty."""

from __future__ import annotations

from xpupool.contracts import DeviceSlice, Vendor
from xpupool.lease_manager.env import job_environment

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
