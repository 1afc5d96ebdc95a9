"""Accelerator discovery and telemetry for xpupool: the device catalog, the backend protocol,
a simulated backend, and vendor backends (NVML, npu-smi, cnmon, rocm-smi).

Vendor backends live in their own modules (``xpupool.devices.nvml``, ``.npu_smi``, ``.cnmon``,
``.rocm_smi``) so importing this package never touches a vendor library.
"""

from xpupool.devices.backend import (
    APPLICATION_XIDS,
    BackendUnavailable,
    DeviceBackend,
    DeviceInfo,
    EccCounts,
    LinkInfo,
    PartitionInfo,
    ProcessInfo,
    to_sample,
    to_samples,
    to_spec,
    to_specs,
    xid_health,
)
from xpupool.devices.catalog import Catalog, CatalogEntry, CatalogError, load_catalog
from xpupool.devices.enforcement import is_mig_uuid, slice_enforced
from xpupool.devices.simulated import (
    Disappear,
    Fault,
    NodeKilled,
    Overheat,
    SimulatedBackend,
    Xid,
    parse_profile,
)

__all__ = [
    "APPLICATION_XIDS",
    "BackendUnavailable",
    "Catalog",
    "CatalogEntry",
    "CatalogError",
    "DeviceBackend",
    "DeviceInfo",
    "Disappear",
    "EccCounts",
    "Fault",
    "LinkInfo",
    "NodeKilled",
    "Overheat",
    "PartitionInfo",
    "ProcessInfo",
    "SimulatedBackend",
    "Xid",
    "is_mig_uuid",
    "load_catalog",
    "parse_profile",
    "slice_enforced",
    "to_sample",
    "to_samples",
    "to_spec",
    "to_specs",
    "xid_health",
]
