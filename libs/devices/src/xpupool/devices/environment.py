"""The environment a job must run with: each vendor's visible-device variables and share limits.

Two kinds of variable (see shared/docs/vendors.md §5): runtime variables, read by a container
toolkit that mounts device nodes, take physical ids or UUIDs; backend variables, read by the
framework inside the process, filter devices. For NVIDIA both get UUIDs, which CUDA accepts and
which stay right whether or not a container renumbered the devices. Other vendors' backends only
take indices, so they get the host's indices (bare-metal semantics).
Share limits are emitted for each mechanism the vendor supports (MPS and HAMi-core for NVIDIA,
hami-vnpu-core for Ascend); only the one running on the node enforces them.
A MIG instance is leased as its own unit: its slice's ``uuid`` is the ``MIG-<uuid>`` NVML
reports, which both NVIDIA variables take, and it gets no MPS or HAMi-core limits (the instance
is the limit; a CUDA process uses one MIG device, so a job should hold one).
Cambricon, AMD and Hygon shares get visible-device variables only: AMD and Hygon have no
per-process limit mechanism, and Cambricon's sMLU and MIM instances are made by its device plugin
from scheduler annotations (``CAMBRICON_DSMLU_PROFILE``), not read by the job. Their slices say
``enforced: false`` (``xpupool.devices.enforcement`` decides that where slices are made).
A host-only job (no slices) gets every vendor's visible-device variables set to the empty
string, which each runtime and backend reads as "no device" (for ``NVIDIA_VISIBLE_DEVICES``,
like ``void``: no GPU mounted), so it cannot touch an accelerator by accident.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

from xpupool.contracts import DeviceSlice, Vendor

# What NVML calls a MIG instance's UUID (R470+: MIG-<uuid>; before: MIG-GPU-<uuid>/<gi>/<ci>).
_MIG_PREFIX = "MIG-"


def _ids(slices: Sequence[DeviceSlice], use_uuid: bool = False) -> str:
    return ",".join(s.uuid if use_uuid else str(s.index) for s in slices)


def _nvidia(slices: Sequence[DeviceSlice]) -> dict[str, str]:
    env = {
        "NVIDIA_VISIBLE_DEVICES": _ids(slices, use_uuid=True),
        "CUDA_VISIBLE_DEVICES": _ids(slices, use_uuid=True),
    }
    # Limits are per visible index, in the order of CUDA_VISIBLE_DEVICES.
    limited = [
        (position, s)
        for position, s in enumerate(slices)
        if not s.whole and not s.uuid.startswith(_MIG_PREFIX)
    ]
    if limited:
        for position, s in limited:
            env[f"CUDA_DEVICE_MEMORY_LIMIT_{position}"] = f"{s.memory_mib}m"
        env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = ",".join(
            f"{position}={s.memory_mib}M" for position, s in limited
        )
        compute = min(s.compute_pct for _, s in limited)
        if compute > 0:
            env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(compute)
            env["CUDA_DEVICE_SM_LIMIT"] = str(compute)
    return env


def _ascend(slices: Sequence[DeviceSlice]) -> dict[str, str]:
    env = {
        "ASCEND_VISIBLE_DEVICES": _ids(slices),
        "ASCEND_RT_VISIBLE_DEVICES": _ids(slices),
    }
    shares = [s for s in slices if not s.whole]
    if shares:
        env["NPU_MEM_QUOTA"] = str(min(s.memory_mib for s in shares))
    return env


EnvBuilder = Callable[[Sequence[DeviceSlice]], dict[str, str]]


def _indexed(runtime_var: str, *backend_vars: str) -> EnvBuilder:
    def build(slices: Sequence[DeviceSlice]) -> dict[str, str]:
        return {name: _ids(slices) for name in (runtime_var, *backend_vars)}

    return build


_BUILDERS: dict[Vendor, EnvBuilder] = {
    Vendor.NVIDIA: _nvidia,
    Vendor.ASCEND: _ascend,
    Vendor.CAMBRICON: _indexed("CAMBRICON_VISIBLE_DEVICES", "MLU_VISIBLE_DEVICES"),
    Vendor.AMD: _indexed("AMD_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"),
    Vendor.HYGON: _indexed("HYGON_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"),
    Vendor.SIMULATED: _indexed("XPUPOOL_SIMULATED_VISIBLE_DEVICES"),
}


def job_environment(
    slices: Sequence[DeviceSlice], job_id: str, lease_id: str, fencing_token: int
) -> dict[str, str]:
    """Everything the job's process needs, for every vendor among its slices; with no slices
    (a host-only job), every vendor's visible-device variables, empty."""
    by_vendor: dict[Vendor, list[DeviceSlice]] = defaultdict(list)
    for s in slices:
        by_vendor[s.vendor].append(s)
    env = {
        "XPUPOOL_JOB_ID": job_id,
        "XPUPOOL_LEASE_ID": lease_id,
        "XPUPOOL_FENCING_TOKEN": str(fencing_token),
    }
    if not slices:
        for builder in _BUILDERS.values():
            env.update(builder([]))
    for vendor, group in by_vendor.items():
        builder = _BUILDERS[vendor]
        env.update(builder(sorted(group, key=lambda s: s.index)))
    return env
