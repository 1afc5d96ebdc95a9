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

The catalog says what a model supports; whether a node runs it is the node's own fact. Seen on
an H200 (``libs/devices/tests/data/nvidia/SOURCES.md``): with the MPS control daemon running, a
16 GiB, 25 % share could not allocate 20 GiB and got 30 % of the whole GPU's bf16 rate; without
it, the same environment allocated 20 GiB and ran at the full rate. So the collector registers a
device's limit mechanisms as :func:`running_share_limits` finds them on the node
(``XPUPOOL_SHARE_LIMITS``), and a share is enforced only through one that runs.
"""

from __future__ import annotations

import errno
import os
import socket
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Final

from xpupool.contracts import Vendor

__all__ = [
    "ENV_LIMITED",
    "MIG_UUID_PREFIX",
    "SHARE_LIMITS",
    "is_mig_uuid",
    "mps_running",
    "running_share_limits",
    "slice_enforced",
    "running_isolation",
]

ENV_LIMITED: Final[dict[Vendor, frozenset[str]]] = {
    Vendor.NVIDIA: frozenset({"mps", "hami-core"}),
    Vendor.ASCEND: frozenset({"hami-core"}),
}
"""Per vendor, the isolation mechanisms whose limits the job environment carries."""

SHARE_LIMITS: Final = frozenset().union(*ENV_LIMITED.values())
"""Every mechanism whose share limits a job's environment carries, whatever the vendor."""

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


MPS_PIPE_DEFAULT: Final = "/tmp/nvidia-mps"
"""Where the MPS control daemon makes its pipes unless ``CUDA_MPS_PIPE_DIRECTORY`` says."""


def mps_running(pipe_directory: str | None = None) -> bool:
    """Whether an MPS control daemon serves this node: it answers on ``control`` in the pipe
    directory (``CUDA_MPS_PIPE_DIRECTORY``, else ``/tmp/nvidia-mps``), which jobs find the same
    way. Driver 580 makes ``control`` a UNIX socket (SOCK_SEQPACKET) and leaves it behind when
    the daemon quits, refusing connections then (seen on an H200): the file alone proves
    nothing, the socket must accept a connection (an older driver's FIFO must have a reader)."""
    directory = pipe_directory or os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_PIPE_DEFAULT
    path = Path(directory) / "control"
    try:
        mode = path.stat().st_mode
    except OSError:
        return False
    if stat.S_ISSOCK(mode):
        # The daemon listens with SOCK_SEQPACKET (driver 580); a stream socket is refused with
        # EPROTOTYPE, so it is only tried second.
        for kind in (socket.SOCK_SEQPACKET, socket.SOCK_STREAM):
            with socket.socket(socket.AF_UNIX, kind) as control:
                control.settimeout(1.0)
                try:
                    control.connect(str(path))
                except OSError as error:
                    if error.errno == errno.EPROTOTYPE:
                        continue
                    return False
                return True
        return False
    if stat.S_ISFIFO(mode):
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # ENXIO: nobody reads it
        except OSError:
            return False
        return True
    return False


def running_share_limits(setting: str, *, simulated: bool) -> frozenset[str] | None:
    """The share limit mechanisms (``ENV_LIMITED``'s) running on this node, per
    ``XPUPOOL_SHARE_LIMITS``; None: trust the catalog's list.

    * ``auto`` (the default): a simulated node trusts the catalog (it stands for a node whose
      operator runs what the catalog lists); a real one runs MPS when :func:`mps_running` says
      so, and HAMi-core never (its library is injected into containers by HAMi's device
      plugin, which a node cannot see: name it to claim it);
    * ``catalog``: trust the catalog;
    * a comma list (``mps``, ``hami-core``, ``mps,hami-core``) or ``none``: exactly those.
    """
    words = {w.strip() for w in setting.split(",") if w.strip()}
    if words == {"catalog"}:
        return None
    if words == {"auto"}:
        return None if simulated else (frozenset({"mps"}) if mps_running() else frozenset())
    unknown = words - SHARE_LIMITS - {"none"}
    if unknown:
        raise ValueError(
            f"XPUPOOL_SHARE_LIMITS: unknown {sorted(unknown)}; expected auto, catalog, none "
            f"or a comma list of {sorted(SHARE_LIMITS)}"
        )
    return frozenset(words - {"none"})


def running_isolation(isolation: Iterable[str], running: frozenset[str] | None) -> list[str]:
    """The mechanisms of ``isolation`` the node has: all but the share limit mechanisms that
    do not run there (all of them when ``running`` is None: the catalog is trusted)."""
    return [m for m in isolation if running is None or m not in SHARE_LIMITS or m in running]
