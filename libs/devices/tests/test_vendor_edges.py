"""Vendor readings at their edges, where a faithful parse still must not make a wrong unit."""

from __future__ import annotations

from xpupool.contracts import Vendor
from xpupool.devices.backend import DeviceInfo, PartitionInfo, to_samples, to_specs
from xpupool.devices.catalog import Catalog


def test_a_mig_enabled_gpu_without_instances_is_no_leasable_unit(catalog: Catalog) -> None:
    """Between `nvidia-smi -i 0 -mig 1` and `nvidia-smi mig -cgi …` (or after `mig -dci -dgi`),
    NVML reads MIG mode enabled and every instance slot NotFound: a GPU no CUDA process can
    use whole (DeviceSpec: "listed only through its instances") and with nothing to slice. A
    lease on it would hand its holder a GPU UUID that shows no device."""
    bare = DeviceInfo(
        vendor=Vendor.NVIDIA,
        index=0,
        name="NVIDIA A100-SXM4-40GB",
        uuid="GPU-mig-bare",
        memory_total_mib=40_960,
        mig_mode=True,
        partitions=[],
    )
    plain = DeviceInfo(
        vendor=Vendor.NVIDIA, index=1, name="NVIDIA A100-SXM4-40GB", uuid="GPU-plain"
    )
    assert [s.device_id for s in to_specs([bare, plain], "n1", catalog)] == ["n1/nvidia1"]
    assert [s.device_id for s in to_samples([bare, plain], "n1")] == ["n1/nvidia1"]

    # Once an instance exists, it (and only it) is the unit, as before.
    part = PartitionInfo(
        index=0,
        uuid="MIG-1",
        profile="3g.20gb",
        gpu_instance_id=1,
        compute_instance_id=0,
        memory_total_mib=19_968,
    )
    cut = DeviceInfo(
        vendor=Vendor.NVIDIA,
        index=0,
        name="NVIDIA A100-SXM4-40GB",
        uuid="GPU-mig-bare",
        mig_mode=True,
        partitions=[part],
    )
    assert [s.device_id for s in to_specs([cut], "n1", catalog)] == ["n1/nvidia0/mig1.0"]
