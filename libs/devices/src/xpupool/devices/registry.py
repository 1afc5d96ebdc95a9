"""Backends by name, for configuration (the collector's ``backend`` setting)."""

from __future__ import annotations

from typing import Final

from xpupool.contracts import Vendor
from xpupool.devices.backend import DeviceBackend
from xpupool.devices.catalog import Catalog, load_catalog

__all__ = ["BACKEND_NAMES", "create_backend"]

# Canonical name -> accepted aliases (vendor names included).
BACKEND_NAMES: Final[dict[str, tuple[str, ...]]] = {
    "nvml": ("nvml", "nvidia"),
    "npu-smi": ("npu-smi", "ascend"),
    "cnmon": ("cnmon", "cambricon"),
    "rocm-smi": ("rocm-smi", "amd"),
    "hy-smi": ("hy-smi", "hygon"),
    "simulated": ("simulated",),
}


def _canonical(name: str) -> str:
    wanted = name.strip().lower()
    for canonical, aliases in BACKEND_NAMES.items():
        if wanted in aliases:
            return canonical
    known = ", ".join(BACKEND_NAMES)
    raise ValueError(f"unknown device backend {name!r}; known: {known}")


def create_backend(
    name: str,
    node_id: str,
    catalog: Catalog | None = None,
    *,
    profile: str = "",
    seed: int = 0,
    timeout_s: float = 10.0,
) -> DeviceBackend:
    """Build the backend called ``name`` (see :data:`BACKEND_NAMES`) for ``node_id``.

    ``catalog`` defaults to :func:`load_catalog`. ``simulated`` needs ``profile``. Raises
    ``ValueError`` for an unknown name and
    :class:`~xpupool.devices.backend.BackendUnavailable` when NVML cannot load; CLI backends
    report a missing tool on first use.
    """
    canonical = _canonical(name)
    cat = catalog if catalog is not None else load_catalog()
    if canonical == "nvml":
        from xpupool.devices.nvml import NvmlBackend

        return NvmlBackend(node_id)
    if canonical == "npu-smi":
        from xpupool.devices.npu_smi import NpuSmiBackend

        return NpuSmiBackend(node_id, cat, timeout_s=timeout_s)
    if canonical == "cnmon":
        from xpupool.devices.cnmon import CnmonBackend

        return CnmonBackend(node_id, cat, timeout_s=timeout_s)
    if canonical in ("rocm-smi", "hy-smi"):
        from xpupool.devices.rocm_smi import RocmSmiBackend

        vendor = Vendor.HYGON if canonical == "hy-smi" else Vendor.AMD
        return RocmSmiBackend(node_id, cat, vendor=vendor, tool=canonical, timeout_s=timeout_s)
    if not profile:
        raise ValueError("the simulated backend needs a profile, e.g. '2xA100-80GB'")
    from xpupool.devices.simulated import SimulatedBackend

    return SimulatedBackend(node_id, profile, cat, seed)
