"""Whether a device slice's memory and compute limits are enforced on the node.

The answer depends on what the lease-manager can write into the job's environment
(``services/lease-manager/.../env.py``; shared/docs/vendors.md §5) and on the isolation
mechanisms the catalog lists for the device (``DeviceSpec.isolation``):

* a whole device, or a whole hardware partition (a MIG instance, a vNPU), is isolated by
  construction;
* a share is enforced only through a mechanism that reads per-process limit variables:
  MPS (``CUDA_MPS_PINNED_DEVICE_MEM_LIMIT``) or HAMi-core (``CUDA_DEVICE_MEMORY_LIMIT_<i>``)
  on NVIDIA, HAMi's vNPU core (``NPU_MEM_QUOTA``) on Ascend;
* AMD and Hygon list no such mechanism (only visible-device variables exist), and Cambricon's
  sMLU and MIM instances are made by its device plugin from scheduler annotations
  (``CAMBRICON_DSMLU_PROFILE``), not read by the job: a share of those is not enforced;
* a share of a MIG instance gets no MPS or HAMi limits (the instance is the limit), so it is
  not enforced either: its neighbours in the instance are held to nothing.

"Enforced" trusts the catalog: a listed ``mps`` or ``hami-core`` means the operator runs it on
the node. An operator who does not should drop it from the device's ``isolation`` in the
catalog file named by ``XPUPOOL_CATALOG``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

from xpupool.contracts import Vendor

__all__ = ["ENV_LIMITED", "MIG_UUID_PREFIX", "is_mig_uuid", "slice_enforced"]

ENV_LIMITED: Final[dict[Vendor, frozenset[str]]] = {
    Vendor.NVIDIA: frozenset({"mps", "hami-core"}),
    Vendor.ASCEND: frozenset({"hami-core"}),
}
"""Per vendor, the isolation mechanisms whose limits the job environment carries."""

MIG_UUID_PREFIX: Final = "MIG-"


def is_mig_uuid(uuid: str) -> bool:
    """True for a MIG instance's UUID as NVML reports it (``MIG-<uuid>``, or on pre-R470
    drivers ``MIG-GPU-<uuid>/<gi>/<ci>``); both start with ``MIG-``."""
    return uuid.startswith(MIG_UUID_PREFIX)


def slice_enforced(
    vendor: Vendor, isolation: Iterable[str], whole: bool, *, uuid: str = ""
) -> bool:
    """Whether a slice of a device with these ``isolation`` mechanisms is held to its limits.

    ``uuid`` is the leased unit's UUID; a share of a MIG instance is never enforced, since
    the environment gives it no limits.
    """
    if whole:
        return True
    if vendor is Vendor.NVIDIA and is_mig_uuid(uuid):
        return False
    return not ENV_LIMITED.get(vendor, frozenset()).isdisjoint(isolation)
