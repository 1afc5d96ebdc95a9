"""Registration of a node's devices."""

from __future__ import annotations


def test_duplicate_device_ids_keep_the_first() -> None:
    """A backend reporting one device id twice registers the first and leaves out the repeat."""
    from xpupool.contracts import DeviceSpec, Vendor
    from xpupool.telemetry_collector.handlers import unique_specs

    def spec(uuid: str, index: int = 0) -> DeviceSpec:
        return DeviceSpec(
            device_id=f"n/nvidia{index}",
            vendor=Vendor.NVIDIA,
            model="T4",
            index=index,
            uuid=uuid,
            memory_mib=16384,
        )

    kept = unique_specs([spec("GPU-a"), spec("GPU-b"), spec("GPU-c", 1)])
    assert [s.uuid for s in kept] == ["GPU-a", "GPU-c"]
