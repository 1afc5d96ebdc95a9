"""NVIDIA GPUs through NVML (``import pynvml`` from the ``nvidia-ml-py`` distribution).

Every NVML call goes through :meth:`NvmlBackend._call`, so a query the board does not support
(``NVMLError_NotSupported``, ``NoPermission``, ``FunctionNotFound``, ``NotFound``) reads as
``None`` instead of failing discovery; ``NVML_ERROR_GPU_IS_LOST`` marks the device ``lost``.
Health comes from XID and double-bit-ECC events drained at every call
(``NVMLError_Timeout`` means "no event").
A hardware XID keeps the GPU unhealthy until :meth:`NvmlBackend.clear_faults`, as NVIDIA's
device plugin does; application XIDs (13, 31, 43, 45, 68) are reported but leave it healthy.

The ``pynvml`` module is injected through the constructor so tests can pass a fake.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from typing import Any, Final

from msgspec import structs

from xpupool.contracts import DeviceSample, Health, Vendor
from xpupool.devices.backend import (
    MIG_SLICES,
    BackendUnavailable,
    DeviceInfo,
    EccCounts,
    LinkInfo,
    PartitionInfo,
    ProcessInfo,
    assign_domains,
    to_samples,
    worst_health,
    xid_health,
)

__all__ = ["NvmlBackend"]

_MIB: Final = 1024 * 1024
# A MIG device's name ends in its profile: "NVIDIA A100-SXM4-40GB MIG 3g.20gb", or
# "... MIG 1c.3g.20gb" when the GPU instance is split into compute instances.
_MIG_PROFILE: Final = re.compile(r"MIG\s+((?:(\d+)c\.)?(\d+)g\.\d+gb)", re.IGNORECASE)
# NVML_TOPOLOGY_* -> the nvidia-smi topo -m words.
_TOPOLOGY: Final = {0: "x", 10: "pix", 20: "pxb", 30: "phb", 40: "node", 50: "sys"}
# NVML_ERROR_* codes that mean "this board cannot answer", not a fault. Compared by code, not
# class name: the generated classes are spelled e.g. NVMLError_GpuIsLost, not ...GPUIsLost.
_BENIGN_CODES: Final = (
    "NVML_ERROR_NOT_SUPPORTED",
    "NVML_ERROR_NO_PERMISSION",
    "NVML_ERROR_FUNCTION_NOT_FOUND",
    "NVML_ERROR_NOT_FOUND",
)


class _GpuLost(Exception):
    """Internal: a call reported NVML_ERROR_GPU_IS_LOST."""


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class NvmlBackend:
    """NVIDIA GPUs via NVML. ``nvml`` is the ``pynvml`` module (imported when ``None``).

    Raises :class:`BackendUnavailable` at construction when nvidia-ml-py is not installed or
    libnvidia-ml cannot be loaded or initialised.
    """

    def __init__(self, node_id: str, *, nvml: Any = None, event_timeout_ms: int = 0) -> None:
        self._node_id = node_id
        self._event_timeout_ms = event_timeout_ms
        if nvml is None:
            try:
                nvml = importlib.import_module("pynvml")
            except ImportError as exc:
                raise BackendUnavailable("nvidia-ml-py (pynvml) is not installed") from exc
        self._nv: Any = nvml
        self._benign = {self._code(n) for n in _BENIGN_CODES} - {None}
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise BackendUnavailable(f"NVML unavailable: {_text(exc)}") from exc
        self._closed = False
        # uuid -> (health, reason, last xid); sticky until clear_faults.
        self._faults: dict[str, tuple[Health, str, int | None]] = {}
        self._event_set: Any = None
        self._handles: list[Any] = []
        self._setup_events()

    # ----------------------------------------------------------------------- plumbing --

    @property
    def vendor(self) -> Vendor:
        """``Vendor.NVIDIA``."""
        return Vendor.NVIDIA

    @property
    def node_id(self) -> str:
        """The node id given at construction."""
        return self._node_id

    def _call(self, name: str, *args: Any, reasons: list[str] | None = None) -> Any:
        """Call ``pynvml.<name>``; ``None`` when unsupported, raise ``_GpuLost`` when lost.

        Unexpected NVML errors also read as ``None`` but are recorded in ``reasons``.
        """
        fn: Callable[..., Any] | None = getattr(self._nv, name, None)
        if fn is None:
            return None
        try:
            return fn(*args)
        except self._nv.NVMLError as exc:
            code = getattr(exc, "value", None)
            if code == self._code("NVML_ERROR_GPU_IS_LOST"):
                raise _GpuLost from exc
            if code not in self._benign and reasons is not None:
                reasons.append(f"{name}: {_text(exc)}")
            return None

    def _code(self, name: str) -> int | None:
        value = getattr(self._nv, name, None)
        return int(value) if value is not None else None

    def _setup_events(self) -> None:
        nv = self._nv
        count = self._call("nvmlDeviceGetCount") or 0
        self._event_set = self._call("nvmlEventSetCreate")
        wanted = (
            nv.nvmlEventTypeXidCriticalError
            | nv.nvmlEventTypeDoubleBitEccError
            | nv.nvmlEventTypeSingleBitEccError
        )
        for index in range(count):
            try:
                handle = self._call("nvmlDeviceGetHandleByIndex", index)
                if handle is None or self._event_set is None:
                    continue
                supported = self._call("nvmlDeviceGetSupportedEventTypes", handle) or 0
                # Registering an unsupported type fails the whole call: use the intersection.
                if supported & wanted:
                    self._call(
                        "nvmlDeviceRegisterEvents", handle, supported & wanted, self._event_set
                    )
            except _GpuLost:
                continue

    def _poll_events(self) -> None:
        if self._event_set is None:
            return
        nv = self._nv
        while True:
            try:
                event = nv.nvmlEventSetWait_v2(self._event_set, self._event_timeout_ms)
            except nv.NVMLError:
                # NVMLError_Timeout is the normal "no event"; anything else ends the drain.
                return
            try:
                uuid = _text(nv.nvmlDeviceGetUUID(event.device))
            except nv.NVMLError:
                continue
            if event.eventType & nv.nvmlEventTypeXidCriticalError:
                xid = int(event.eventData)
                health = xid_health(xid)
                previous = self._faults.get(uuid)
                if previous is not None and previous[0] is Health.UNHEALTHY:
                    health = Health.UNHEALTHY
                self._faults[uuid] = (health, f"xid {xid}", xid)
            elif event.eventType & nv.nvmlEventTypeDoubleBitEccError:
                last = self._faults.get(uuid, (Health.HEALTHY, "", None))[2]
                self._faults[uuid] = (Health.UNHEALTHY, "double-bit ECC error", last)

    def clear_faults(self, uuid: str | None = None) -> None:
        """Forget sticky XID/ECC faults of one GPU (or all), e.g. after an operator reset."""
        if uuid is None:
            self._faults.clear()
        else:
            self._faults.pop(uuid, None)

    # ---------------------------------------------------------------------- readings --

    def _read_device(self, index: int, bus_to_index: dict[str, int]) -> DeviceInfo:
        nv = self._nv
        reasons: list[str] = []
        try:
            handle = self._call("nvmlDeviceGetHandleByIndex", index, reasons=reasons)
            if handle is None:
                raise _GpuLost
            name = _text(self._call("nvmlDeviceGetName", handle) or "unknown")
            uuid = _text(self._call("nvmlDeviceGetUUID", handle) or "")
            pci = self._call("nvmlDeviceGetPciInfo", handle)
            bus = _text(pci.busId) if pci is not None else ""
            memory = self._call("nvmlDeviceGetMemoryInfo", handle, reasons=reasons)
            util = self._call("nvmlDeviceGetUtilizationRates", handle)
            temp = self._call("nvmlDeviceGetTemperature", handle, nv.NVML_TEMPERATURE_GPU)
            power_mw = self._call("nvmlDeviceGetPowerUsage", handle)
            limit_mw = self._call("nvmlDeviceGetEnforcedPowerLimit", handle)
            sm = self._call("nvmlDeviceGetClockInfo", handle, nv.NVML_CLOCK_SM)
            sm_max = self._call("nvmlDeviceGetMaxClockInfo", handle, nv.NVML_CLOCK_SM)
            mig = self._mig_mode(handle)
            info = DeviceInfo(
                vendor=Vendor.NVIDIA,
                index=index,
                name=name,
                uuid=uuid,
                pci_bus_id=bus,
                serial=_text(self._call("nvmlDeviceGetSerial", handle) or ""),
                driver_version=_text(self._call("nvmlSystemGetDriverVersion") or ""),
                memory_total_mib=memory.total // _MIB if memory is not None else None,
                memory_used_mib=memory.used // _MIB if memory is not None else None,
                memory_free_mib=memory.free // _MIB if memory is not None else None,
                # NVML does not report utilisation of a MIG-enabled GPU (NotSupported).
                util_pct=float(util.gpu) if util is not None else None,
                memory_util_pct=float(util.memory) if util is not None else None,
                temperature_c=float(temp) if temp is not None else None,
                memory_temperature_c=self._memory_temperature(handle),
                power_w=power_mw / 1000 if power_mw is not None else None,
                power_limit_w=limit_mw / 1000 if limit_mw is not None else None,
                sm_clock_mhz=sm,
                sm_clock_max_mhz=sm_max,
                ecc=self._ecc(handle),
                mig_mode=mig,
                partitions=self._partitions(handle) if mig else [],
                processes=self._processes(handle),
                links=self._links(handle, index, bus_to_index),
                numa_node=self._call("nvmlDeviceGetNumaNodeId", handle),
                health_reasons=reasons,
            )
        except _GpuLost:
            return DeviceInfo(
                vendor=Vendor.NVIDIA,
                index=index,
                name="unknown",
                health=Health.LOST,
                health_reasons=["GPU is lost (NVML_ERROR_GPU_IS_LOST)"],
            )
        fault = self._faults.get(info.uuid)
        if fault is not None:
            health, reason, xid = fault
            info = structs.replace(
                info,
                health=worst_health(info.health, health),
                health_reasons=[*info.health_reasons, reason],
                xid=xid,
            )
        return info

    def _memory_temperature(self, handle: Any) -> float | None:
        nv = self._nv
        field_id = getattr(nv, "NVML_FI_DEV_MEMORY_TEMP", None)
        if field_id is None:
            return None
        values = self._call("nvmlDeviceGetFieldValues", handle, [field_id])
        if not values or values[0].nvmlReturn != nv.NVML_SUCCESS:
            return None
        return float(values[0].value.uiVal)

    def _ecc(self, handle: Any) -> EccCounts | None:
        nv = self._nv
        mode = self._call("nvmlDeviceGetEccMode", handle)
        if mode is None or mode[0] != nv.NVML_FEATURE_ENABLED:
            return None

        def count(kind: int, counter: int) -> int | None:
            value = self._call("nvmlDeviceGetTotalEccErrors", handle, kind, counter)
            return int(value) if value is not None else None

        corrected, uncorrected = (
            nv.NVML_MEMORY_ERROR_TYPE_CORRECTED,
            nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
        )
        return EccCounts(
            volatile_corrected=count(corrected, nv.NVML_VOLATILE_ECC),
            volatile_uncorrected=count(uncorrected, nv.NVML_VOLATILE_ECC),
            aggregate_corrected=count(corrected, nv.NVML_AGGREGATE_ECC),
            aggregate_uncorrected=count(uncorrected, nv.NVML_AGGREGATE_ECC),
        )

    def _mig_mode(self, handle: Any) -> bool | None:
        mode = self._call("nvmlDeviceGetMigMode", handle)
        if mode is None:
            return None
        return bool(mode[0] == self._nv.NVML_DEVICE_MIG_ENABLE)

    def _partitions(self, handle: Any) -> list[PartitionInfo]:
        parts: list[PartitionInfo] = []
        for slot in range(self._call("nvmlDeviceGetMaxMigDeviceCount", handle) or 0):
            mig = self._call("nvmlDeviceGetMigDeviceHandleByIndex", handle, slot)
            if mig is None:
                continue  # an empty slot reads NotFound
            memory = self._call("nvmlDeviceGetMemoryInfo", mig)
            profile = _MIG_PROFILE.search(_text(self._call("nvmlDeviceGetName", mig) or ""))
            gpu_slices, compute_slices = self._mig_slices(mig, profile)
            parts.append(
                PartitionInfo(
                    index=slot,
                    # NVML (R470+) names a MIG device "MIG-<uuid>", the form
                    # NVIDIA_VISIBLE_DEVICES and CUDA_VISIBLE_DEVICES take.
                    uuid=_text(self._call("nvmlDeviceGetUUID", mig) or ""),
                    profile=profile.group(1).lower() if profile else "",
                    gpu_instance_id=self._call("nvmlDeviceGetGpuInstanceId", mig),
                    compute_instance_id=self._call("nvmlDeviceGetComputeInstanceId", mig),
                    memory_total_mib=memory.total // _MIB if memory is not None else None,
                    memory_used_mib=memory.used // _MIB if memory is not None else None,
                    slices=compute_slices,
                    slices_total=MIG_SLICES if compute_slices is not None else None,
                    gpu_slices=gpu_slices,
                )
            )
        return parts

    def _mig_slices(self, mig: Any, profile: re.Match[str] | None) -> tuple[int | None, int | None]:
        """(GPU-instance, compute-instance) slices of a MIG device: from its attributes, which
        NVML reports for MIG handles, else from the profile in its name."""
        attrs = self._call("nvmlDeviceGetAttributes", mig)
        gpu = getattr(attrs, "gpuInstanceSliceCount", 0) if attrs is not None else 0
        compute = getattr(attrs, "computeInstanceSliceCount", 0) if attrs is not None else 0
        if gpu and compute:
            return int(gpu), int(compute)
        if profile is None:
            return None, None
        named_gpu = int(profile.group(3))
        return named_gpu, int(profile.group(2) or named_gpu)

    def _processes(self, handle: Any) -> list[ProcessInfo]:
        nv = self._nv
        try:
            procs = self._call("nvmlDeviceGetComputeRunningProcesses", handle)
        except nv.NVMLLibraryMismatchError:
            # New bindings on an old driver lack the _v3 symbol; _v2 has the same fields.
            procs = self._call("nvmlDeviceGetComputeRunningProcesses_v2", handle)
        out: list[ProcessInfo] = []
        for proc in procs or []:
            used = getattr(proc, "usedGpuMemory", None)
            gi = getattr(proc, "gpuInstanceId", None)
            ci = getattr(proc, "computeInstanceId", None)
            name = self._call("nvmlSystemGetProcessName", proc.pid)
            out.append(
                ProcessInfo(
                    pid=int(proc.pid),
                    name=_text(name) if name is not None else "",
                    memory_used_mib=int(used) // _MIB if used is not None else None,
                    # 0xFFFFFFFF means "not in a MIG instance".
                    gpu_instance_id=gi if gi is not None and gi != 0xFFFFFFFF else None,
                    compute_instance_id=ci if ci is not None and ci != 0xFFFFFFFF else None,
                )
            )
        return out

    def _links(self, handle: Any, index: int, bus_to_index: dict[str, int]) -> list[LinkInfo]:
        nv = self._nv
        lanes: dict[int, int] = {}
        active = 0
        for link in range(int(getattr(nv, "NVML_NVLINK_MAX_LINKS", 0))):
            try:
                state = nv.nvmlDeviceGetNvLinkState(handle, link)
            except nv.NVMLError as exc:
                code = getattr(exc, "value", None)
                if code == self._code("NVML_ERROR_GPU_IS_LOST"):
                    raise _GpuLost from exc
                # PCIe-only boards (T4, L40S) fail on link 0; others fail past their last link.
                if link == 0 or code == self._code("NVML_ERROR_NOT_SUPPORTED"):
                    break
                continue
            if state != nv.NVML_FEATURE_ENABLED:
                continue
            active += 1
            remote = self._call("nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
            peer = bus_to_index.get(_text(remote.busId).lower()) if remote is not None else None
            if peer is not None:
                lanes[peer] = lanes.get(peer, 0) + 1
        links: list[LinkInfo] = []
        for peer_index in sorted(set(bus_to_index.values()) - {index}):
            if peer_index in lanes:
                links.append(
                    LinkInfo(peer_index=peer_index, kind="nvlink", lanes=lanes[peer_index])
                )
                continue
            peer_handle = self._call("nvmlDeviceGetHandleByIndex", peer_index)
            if peer_handle is None:
                continue
            if active:
                # Through an NVSwitch the remote end is the switch: ask for P2P over NVLink.
                status = self._call(
                    "nvmlDeviceGetP2PStatus", handle, peer_handle, nv.NVML_P2P_CAPS_INDEX_NVLINK
                )
                if status == nv.NVML_P2P_STATUS_OK:
                    links.append(LinkInfo(peer_index=peer_index, kind="nvlink"))
                    continue
            level = self._call("nvmlDeviceGetTopologyCommonAncestor", handle, peer_handle)
            if level is not None:
                links.append(LinkInfo(peer_index=peer_index, kind=_TOPOLOGY.get(level, "sys")))
        return links

    def _bus_map(self, count: int) -> dict[str, int]:
        out: dict[str, int] = {}
        for index in range(count):
            try:
                handle = self._call("nvmlDeviceGetHandleByIndex", index)
                pci = self._call("nvmlDeviceGetPciInfo", handle) if handle is not None else None
            except _GpuLost:
                continue
            if pci is not None:
                out[_text(pci.busId).lower()] = index
        return out

    # ------------------------------------------------------------------------ protocol --

    def discover(self) -> list[DeviceInfo]:
        """Read every GPU (and its MIG instances). Raises BackendUnavailable after close or
        when the device count cannot be read."""
        if self._closed:
            raise BackendUnavailable("NVML backend is closed")
        self._poll_events()
        try:
            count = int(self._nv.nvmlDeviceGetCount())
        except self._nv.NVMLError as exc:
            raise BackendUnavailable(f"NVML cannot count GPUs: {_text(exc)}") from exc
        bus_to_index = self._bus_map(count)
        infos = [self._read_device(i, bus_to_index) for i in range(count)]
        return assign_domains(infos, "nvlink")

    def sample(self) -> list[DeviceSample]:
        """Samples of every leasable unit (MIG instances on MIG-enabled GPUs)."""
        return to_samples(self.discover(), self._node_id)

    def close(self) -> None:
        """Free the event set and shut NVML down; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._event_set is not None:
            self._call("nvmlEventSetFree", self._event_set)
        self._call("nvmlShutdown")
