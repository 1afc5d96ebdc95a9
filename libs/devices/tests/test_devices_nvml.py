"""NvmlBackend against a fake pynvml module that returns what real boards return.

Constants and error classes come from the installed nvidia-ml-py, so the backend sees the real
exception hierarchy (NVMLError_NotSupported, NVMLError_GpuIsLost, NVMLError_Timeout, ...).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml
import pytest

from xpupool.contracts import Health, PartitionSpec
from xpupool.devices.backend import BackendUnavailable, DeviceBackend, to_specs
from xpupool.devices.catalog import Catalog
from xpupool.devices.nvml import NvmlBackend

MIB = 1024 * 1024
NOT_SUPPORTED = pynvml.NVMLError_NotSupported


@dataclass
class FakeGpu:
    """One simulated board; a value that is an exception type is raised instead."""

    name: str
    uuid: str
    bus: str
    memory_mib: tuple[int, int]
    util: Any = (0, 0)
    temp: Any = 30
    power_mw: Any = 60_000
    limit_mw: Any = 400_000
    ecc_mode: Any = NOT_SUPPORTED
    mig_mode: Any = NOT_SUPPORTED
    migs: list[FakeGpu] = field(default_factory=list)
    gi_ci: tuple[int, int] = (0, 0)
    # (gpuInstanceSliceCount, computeInstanceSliceCount) of a MIG handle, or an error type.
    mig_slices: Any = NOT_SUPPORTED
    nvlinks: Any = NOT_SUPPORTED  # list of remote bus ids, or an error type
    procs: list[Any] = field(default_factory=list)
    v3_missing: bool = False
    lost: bool = False


class FakeNvml:
    """The subset of pynvml NvmlBackend uses; unknown functions are absent (old bindings)."""

    def __init__(self, gpus: list[FakeGpu], *, init_error: type[Exception] | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.events: deque[Any] = deque()
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith(("NVML_", "NVMLError", "nvmlEventType", "NVMLLibraryMismatch")):
            return getattr(pynvml, name)
        raise AttributeError(name)

    @staticmethod
    def _v(gpu: FakeGpu, value: Any) -> Any:
        if gpu.lost:
            raise pynvml.NVMLError_GpuIsLost()
        if isinstance(value, type) and issubclass(value, Exception):
            raise value()
        return value

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error()

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlSystemGetDriverVersion(self) -> str:
        return "535.161.03"

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> FakeGpu:
        return self.gpus[i]

    def nvmlDeviceGetName(self, h: FakeGpu) -> str:
        return str(self._v(h, h.name))

    def nvmlDeviceGetUUID(self, h: FakeGpu) -> str:
        return h.uuid

    def nvmlDeviceGetSerial(self, h: FakeGpu) -> str:
        return str(self._v(h, "1324321002473"))

    def nvmlDeviceGetPciInfo(self, h: FakeGpu) -> Any:
        return SimpleNamespace(busId=h.bus)

    def nvmlDeviceGetMemoryInfo(self, h: FakeGpu) -> Any:
        used, total = self._v(h, h.memory_mib)
        return SimpleNamespace(total=total * MIB, used=used * MIB, free=(total - used) * MIB)

    def nvmlDeviceGetUtilizationRates(self, h: FakeGpu) -> Any:
        gpu, mem = self._v(h, h.util)
        return SimpleNamespace(gpu=gpu, memory=mem)

    def nvmlDeviceGetTemperature(self, h: FakeGpu, sensor: int) -> int:
        return int(self._v(h, h.temp))

    def nvmlDeviceGetPowerUsage(self, h: FakeGpu) -> int:
        return int(self._v(h, h.power_mw))

    def nvmlDeviceGetEnforcedPowerLimit(self, h: FakeGpu) -> int:
        return int(self._v(h, h.limit_mw))

    def nvmlDeviceGetClockInfo(self, h: FakeGpu, clock: int) -> int:
        return int(self._v(h, 1410))

    def nvmlDeviceGetMaxClockInfo(self, h: FakeGpu, clock: int) -> int:
        return int(self._v(h, 1410))

    def nvmlDeviceGetEccMode(self, h: FakeGpu) -> tuple[int, int]:
        mode = self._v(h, h.ecc_mode)
        return (mode, mode)

    def nvmlDeviceGetTotalEccErrors(self, h: FakeGpu, kind: int, counter: int) -> int:
        # With MIG on, the A100 fixture shows volatile counters N/A and aggregate 0.
        if counter == pynvml.NVML_VOLATILE_ECC and h.mig_mode == pynvml.NVML_DEVICE_MIG_ENABLE:
            raise NOT_SUPPORTED()
        return 0

    def nvmlDeviceGetMigMode(self, h: FakeGpu) -> tuple[int, int]:
        mode = self._v(h, h.mig_mode)
        return (mode, mode)

    def nvmlDeviceGetMaxMigDeviceCount(self, h: FakeGpu) -> int:
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: FakeGpu, i: int) -> FakeGpu:
        if i >= len(h.migs):
            raise pynvml.NVMLError_NotFound()
        return h.migs[i]

    def nvmlDeviceGetGpuInstanceId(self, h: FakeGpu) -> int:
        return h.gi_ci[0]

    def nvmlDeviceGetComputeInstanceId(self, h: FakeGpu) -> int:
        return h.gi_ci[1]

    def nvmlDeviceGetAttributes(self, h: FakeGpu) -> Any:
        gpu, compute = self._v(h, h.mig_slices)
        return SimpleNamespace(
            gpuInstanceSliceCount=gpu,
            computeInstanceSliceCount=compute,
            memorySizeMB=h.memory_mib[1],
        )

    def nvmlDeviceGetComputeRunningProcesses(self, h: FakeGpu) -> list[Any]:
        if h.v3_missing:
            raise pynvml.NVMLLibraryMismatchError("no _v3")
        return h.procs

    def nvmlDeviceGetComputeRunningProcesses_v2(self, h: FakeGpu) -> list[Any]:
        self.calls.append("procs_v2")
        return h.procs

    def nvmlDeviceGetNvLinkState(self, h: FakeGpu, link: int) -> int:
        links = self._v(h, h.nvlinks)
        if link >= len(links):
            raise pynvml.NVMLError_InvalidArgument()
        return int(pynvml.NVML_FEATURE_ENABLED)

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: FakeGpu, link: int) -> Any:
        return SimpleNamespace(busId=h.nvlinks[link])

    def nvmlDeviceGetP2PStatus(self, a: FakeGpu, b: FakeGpu, cap: int) -> int:
        both = isinstance(a.nvlinks, list) and isinstance(b.nvlinks, list)
        return int(pynvml.NVML_P2P_STATUS_OK) if both else 1

    def nvmlDeviceGetTopologyCommonAncestor(self, a: FakeGpu, b: FakeGpu) -> int:
        return int(pynvml.NVML_TOPOLOGY_HOSTBRIDGE)

    def nvmlEventSetCreate(self) -> str:
        return "event-set"

    def nvmlEventSetFree(self, s: str) -> None:
        self.calls.append("event_free")

    def nvmlDeviceGetSupportedEventTypes(self, h: FakeGpu) -> int:
        return int(pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError)

    def nvmlDeviceRegisterEvents(self, h: FakeGpu, mask: int, s: str) -> None:
        self.calls.append(f"register:{h.uuid}:{mask}")

    def nvmlEventSetWait_v2(self, s: str, timeout_ms: int) -> Any:
        if not self.events:
            raise pynvml.NVMLError_Timeout()
        return self.events.popleft()

    def xid(self, gpu: FakeGpu, code: int) -> None:
        self.events.append(
            SimpleNamespace(
                device=gpu, eventType=pynvml.nvmlEventTypeXidCriticalError, eventData=code
            )
        )


def a100_mig() -> FakeGpu:
    """The A100 of the nvidia-smi -q -x fixture: MIG on, two 3g.20gb instances."""
    migs = [
        FakeGpu(
            name="NVIDIA A100-SXM4-40GB MIG 3g.20gb",
            uuid=f"MIG-{n}",
            bus="",
            memory_mib=(19, 19968),
            gi_ci=(gi, 0),
        )
        for n, gi in ((0, 1), (1, 2))
    ]
    return FakeGpu(
        name="NVIDIA A100-SXM4-40GB",
        uuid="GPU-27b94a00-ed54-5c24-b1fd-1054085de32a",
        bus="00000000:00:04.0",
        memory_mib=(38, 40960),
        util=NOT_SUPPORTED,
        power_mw=66_920,
        ecc_mode=pynvml.NVML_FEATURE_ENABLED,
        mig_mode=pynvml.NVML_DEVICE_MIG_ENABLE,
        migs=migs,
    )


def h20_x8() -> list[FakeGpu]:
    """Eight H20s whose 18 NVLinks each end at an NVSwitch (remote bus is not a GPU)."""
    return [
        FakeGpu(
            name="NVIDIA H20",
            uuid=f"GPU-h20-{i}",
            bus=f"00000000:{0x04 + i:02X}:00.0",
            memory_mib=(0, 97871),
            power_mw=72_000,
            limit_mw=500_000,
            mig_mode=pynvml.NVML_DEVICE_MIG_DISABLE,
            ecc_mode=pynvml.NVML_FEATURE_ENABLED,
            nvlinks=[f"00000000:{0xA0 + i:02X}:00.0"] * 18,
        )
        for i in range(8)
    ]


def t4(i: int) -> FakeGpu:
    """A T4: no NVLink, no MIG, ECC reported as unsupported."""
    return FakeGpu(
        name="Tesla T4",
        uuid=f"GPU-t4-{i}",
        bus=f"00000000:{0x3B + i:02X}:00.0",
        memory_mib=(100, 15360),
        util=(35, 10),
        limit_mw=70_000,
    )


def test_is_device_backend() -> None:
    """NvmlBackend satisfies the DeviceBackend protocol."""
    backend = NvmlBackend("n1", nvml=FakeNvml([t4(0)]))
    assert isinstance(backend, DeviceBackend)


def test_a100_mig_instances_are_leasable_units(catalog: Catalog) -> None:
    """MIG mode on: each MIG instance becomes a spec; unsupported util/volatile ECC read None."""
    backend = NvmlBackend("n1", nvml=FakeNvml([a100_mig()]))
    (gpu,) = backend.discover()
    assert gpu.mig_mode is True and gpu.util_pct is None
    assert gpu.ecc is not None and gpu.ecc.volatile_uncorrected is None
    assert gpu.ecc.aggregate_uncorrected == 0
    assert gpu.power_w == pytest.approx(66.92) and gpu.power_limit_w == 400.0
    assert [p.profile for p in gpu.partitions] == ["3g.20gb", "3g.20gb"]
    specs = to_specs([gpu], "n1", catalog)
    assert [s.device_id for s in specs] == ["n1/nvidia0/mig1.0", "n1/nvidia0/mig2.0"]
    assert [s.uuid for s in specs] == ["MIG-0", "MIG-1"]
    assert specs[0].capacity_units == pytest.approx(3 / 7, abs=1e-3)
    samples = backend.sample()
    assert [s.memory_used_mib for s in samples] == [19, 19]


def test_mig_specs_carry_uuid_profile_and_slices(catalog: Catalog) -> None:
    """An H100 split into a 3g.40gb instance and a 3g.40gb GPU instance cut into compute
    instances (1c.3g.40gb): each spec names its MIG- UUID, parent, profile and slices; slice
    counts come from the MIG handle's attributes, and the compute share sets capacity."""
    split = [
        FakeGpu(
            name=f"NVIDIA H100 80GB HBM3 MIG {profile}",
            uuid=f"MIG-{n}",
            bus="",
            memory_mib=(0, 40192),
            gi_ci=gi_ci,
            mig_slices=slices,
        )
        for n, (profile, gi_ci, slices) in enumerate(
            [("3g.40gb", (1, 0), (3, 3)), ("1c.3g.40gb", (2, 0), (3, 1))]
        )
    ]
    gpu = FakeGpu(
        name="NVIDIA H100 80GB HBM3",
        uuid="GPU-h100",
        bus="00000000:18:00.0",
        memory_mib=(0, 81559),
        util=NOT_SUPPORTED,
        mig_mode=pynvml.NVML_DEVICE_MIG_ENABLE,
        migs=split,
    )
    specs = to_specs(NvmlBackend("n1", nvml=FakeNvml([gpu])).discover(), "n1", catalog)
    assert [(s.uuid, s.parent_uuid, s.isolation) for s in specs] == [
        ("MIG-0", "GPU-h100", ["mig"]),
        ("MIG-1", "GPU-h100", ["mig"]),
    ]
    assert [s.partition for s in specs] == [
        PartitionSpec(
            kind="mig",
            profile="3g.40gb",
            gpu_slices=3,
            compute_slices=3,
            slices_total=7,
            gpu_instance_id=1,
            compute_instance_id=0,
        ),
        PartitionSpec(
            kind="mig",
            profile="1c.3g.40gb",
            gpu_slices=3,
            compute_slices=1,
            slices_total=7,
            gpu_instance_id=2,
            compute_instance_id=0,
        ),
    ]
    whole = catalog.lookup("H100 80GB HBM3")
    assert whole is not None
    assert specs[1].capacity_units == pytest.approx(whole.capacity_units / 7, abs=1e-3)


def test_mig_slices_from_the_name_when_attributes_are_unsupported(catalog: Catalog) -> None:
    """Bindings or drivers without nvmlDeviceGetAttributes: the profile in the name gives the
    slices (the a100_mig fixture's instances report no attributes)."""
    (gpu,) = NvmlBackend("n1", nvml=FakeNvml([a100_mig()])).discover()
    assert [(p.gpu_slices, p.slices, p.slices_total) for p in gpu.partitions] == [(3, 3, 7)] * 2
    (spec, _) = to_specs([gpu], "n1", catalog)
    assert spec.partition is not None and spec.partition.profile == "3g.20gb"


def test_h20_nvswitch_domain(catalog: Catalog) -> None:
    """Eight H20s behind NVSwitches share one NVLink domain; memory and power are read."""
    backend = NvmlBackend("n1", nvml=FakeNvml(h20_x8()))
    infos = backend.discover()
    assert len(infos) == 8 and {i.domain for i in infos} == {"nvlink0"}
    assert infos[0].memory_total_mib == 97871 and infos[0].power_limit_w == 500.0
    assert infos[0].mig_mode is False and not infos[0].partitions
    specs = to_specs(infos, "n1", catalog)
    assert {s.domain for s in specs} == {"n1/nvlink0"} and specs[0].model == "H20"


def test_t4_without_nvlink_mig_ecc() -> None:
    """A T4 reads None for MIG and ECC, has PCIe-only links and no domain."""
    fake = FakeNvml([t4(0), t4(1)])
    infos = NvmlBackend("n1", nvml=fake).discover()
    assert all(i.mig_mode is None and i.ecc is None and i.domain == "" for i in infos)
    assert [(link.peer_index, link.kind) for link in infos[0].links] == [(1, "phb")]
    assert infos[0].util_pct == 35.0 and infos[0].memory_used_mib == 100


def test_gpu_is_lost() -> None:
    """A GPU that reports NVML_ERROR_GPU_IS_LOST is listed as lost instead of failing discovery."""
    lost = t4(1)
    lost.lost = True
    samples = NvmlBackend("n1", nvml=FakeNvml([t4(0), lost])).sample()
    assert [s.health for s in samples] == [Health.HEALTHY, Health.LOST]


def test_process_fallback_to_v2() -> None:
    """Without the _v3 symbol the backend falls back to _v2; unknown memory stays None."""
    gpu = t4(0)
    gpu.v3_missing = True
    gpu.procs = [SimpleNamespace(pid=4242, usedGpuMemory=None)]
    fake = FakeNvml([gpu])
    (info,) = NvmlBackend("n1", nvml=fake).discover()
    assert "procs_v2" in fake.calls
    assert info.processes[0].pid == 4242 and info.processes[0].memory_used_mib is None


def test_hardware_xid_is_sticky() -> None:
    """XID 79 makes the GPU unhealthy and it stays so until clear_faults."""
    gpus = [t4(0), t4(1)]
    fake = FakeNvml(gpus)
    backend = NvmlBackend("n1", nvml=fake)
    fake.xid(gpus[1], 79)
    first = backend.sample()
    assert [(s.health, s.xid) for s in first] == [(Health.HEALTHY, None), (Health.UNHEALTHY, 79)]
    assert backend.sample()[1].health is Health.UNHEALTHY
    backend.clear_faults("GPU-t4-1")
    assert backend.sample()[1].health is Health.HEALTHY


@pytest.mark.parametrize("code", [13, 31, 43, 45, 68])
def test_application_xid_keeps_gpu_healthy(code: int) -> None:
    """Application XIDs are reported but the GPU stays healthy."""
    gpu = t4(0)
    fake = FakeNvml([gpu])
    backend = NvmlBackend("n1", nvml=fake)
    fake.xid(gpu, code)
    (sample,) = backend.sample()
    assert sample.health is Health.HEALTHY and sample.xid == code


def test_events_registered_for_supported_types() -> None:
    """Only the supported intersection of XID/ECC events is registered."""
    fake = FakeNvml([t4(0)])
    NvmlBackend("n1", nvml=fake)
    mask = pynvml.nvmlEventTypeXidCriticalError | pynvml.nvmlEventTypeDoubleBitEccError
    assert f"register:GPU-t4-0:{mask}" in fake.calls


def test_library_missing_is_backend_unavailable() -> None:
    """A missing libnvidia-ml is a clear BackendUnavailable, not a traceback."""
    with pytest.raises(BackendUnavailable, match="NVML unavailable"):
        NvmlBackend("n1", nvml=FakeNvml([], init_error=pynvml.NVMLError_LibraryNotFound))


def test_close_frees_events_and_shuts_down() -> None:
    """close() frees the event set, shuts NVML down once, and later calls fail cleanly."""
    fake = FakeNvml([t4(0)])
    backend = NvmlBackend("n1", nvml=fake)
    backend.close()
    backend.close()
    assert fake.calls.count("shutdown") == 1 and "event_free" in fake.calls
    with pytest.raises(BackendUnavailable, match="closed"):
        backend.sample()


def test_real_pynvml_without_driver() -> None:
    """On a machine without an NVIDIA driver the real module yields BackendUnavailable."""
    try:
        backend = NvmlBackend("n1")
    except BackendUnavailable as exc:
        assert "NVML" in str(exc)
    else:  # a GPU host: discovery must still work
        backend.discover()
        backend.close()
