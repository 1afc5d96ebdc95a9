"""Over-use detection: leases whose processes use more device memory than they were granted.

Pure: the collector feeds it one tick of device usage and the leases holding each device.

The collector sees, per device, the memory in use and (on real backends) the processes holding
memory; it does not know which process belongs to which lease. The rule is therefore:

- **one holder**: a device held by exactly one lease charges all of its memory in use to that
  lease (nothing else is entitled to it);
- **several holders**: a process is charged to a lease only when its lease is known. The
  lease-manager puts ``XPUPOOL_LEASE_ID`` into every grant's environment, so
  :func:`read_lease_env` reads it from ``/proc/<pid>/environ`` (the collector needs the host
  PID namespace and ``CAP_SYS_PTRACE`` or root to read other users' processes). Processes with
  no readable lease are charged to none, so without that permission several holders are never
  reported. The reader is injected (:data:`LeaseOfPid`), so tests pass a dict lookup.

Whole-device leases are never over-using (their grant is the device), and reservations not yet
granted are never charged (no process runs for them). :class:`OveruseEpisodes` turns the
per-tick findings into one report per lease per episode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

from xpupool.devices import ProcessInfo

__all__ = [
    "LEASE_ENV",
    "DeviceUse",
    "Holder",
    "LeaseOfPid",
    "Overuse",
    "OveruseEpisodes",
    "Verdict",
    "assess",
    "device_overuse",
    "read_lease_env",
]

LEASE_ENV: Final = "XPUPOOL_LEASE_ID"
_LEASE_PREFIX: Final = LEASE_ENV.encode() + b"="

LeaseOfPid = Callable[[int], str | None]
"""Maps a host PID to the lease id its process runs under, or ``None`` when unknown."""


@dataclass(frozen=True)
class Holder:
    """One lease's share of one device, as the ledger recorded it."""

    lease_id: str
    job_id: str
    granted_memory_mib: int
    whole: bool = False
    # False for a reservation not yet granted: nothing runs for it.
    active: bool = True


@dataclass(frozen=True)
class DeviceUse:
    """What one leasable unit (device or partition) uses now."""

    device_id: str
    memory_used_mib: int | None
    processes: Sequence[ProcessInfo] = ()


@dataclass(frozen=True)
class Overuse:
    """A lease using more memory on a device than it was granted there."""

    lease_id: str
    job_id: str
    device_id: str
    granted_memory_mib: int
    used_memory_mib: int


@dataclass(frozen=True)
class Verdict:
    """One tick's findings: the over-uses, and every lease whose use could be judged."""

    overuses: list[Overuse]
    judged: frozenset[str]


def read_lease_env(pid: int, proc: Path = Path("/proc")) -> str | None:
    """The ``XPUPOOL_LEASE_ID`` a process was started with, or ``None`` when it has none or its
    environment cannot be read (process gone, no permission)."""
    try:
        raw = (proc / str(pid) / "environ").read_bytes()
    except OSError:
        return None
    for entry in raw.split(b"\0"):
        if entry.startswith(_LEASE_PREFIX):
            return entry[len(_LEASE_PREFIX) :].decode(errors="replace") or None
    return None


def _chargeable(holders: Iterable[Holder]) -> dict[str, Holder]:
    return {h.lease_id: h for h in holders if h.active and not h.whole}


def device_overuse(
    use: DeviceUse,
    holders: Sequence[Holder],
    lease_of_pid: LeaseOfPid,
    tolerance_mib: int = 0,
) -> tuple[list[Overuse], set[str]]:
    """Apply the rule to one device: the over-using leases and the leases that were judged.

    ``tolerance_mib`` is added to every grant before comparing (driver and context overhead).
    """
    chargeable = _chargeable(holders)
    if not chargeable:
        return [], set()
    used: dict[str, int]
    if len(holders) == 1:
        if use.memory_used_mib is None:
            return [], set()
        used = {holders[0].lease_id: use.memory_used_mib}
    else:
        used = dict.fromkeys(chargeable, 0)
        for process in use.processes:
            lease_id = lease_of_pid(process.pid)
            if lease_id in used and process.memory_used_mib is not None:
                used[lease_id] += process.memory_used_mib
    overuses = [
        Overuse(
            lease_id=lease_id,
            job_id=chargeable[lease_id].job_id,
            device_id=use.device_id,
            granted_memory_mib=chargeable[lease_id].granted_memory_mib,
            used_memory_mib=mib,
        )
        for lease_id, mib in sorted(used.items())
        if mib > chargeable[lease_id].granted_memory_mib + tolerance_mib
    ]
    return overuses, set(used)


def assess(
    uses: Iterable[DeviceUse],
    holders: Mapping[str, Sequence[Holder]],
    lease_of_pid: LeaseOfPid,
    tolerance_mib: int = 0,
) -> Verdict:
    """Apply the rule to every device of a tick; ``holders`` maps device ids to their leases.

    Each PID's lease is looked up once per tick, however many devices the process uses.
    """
    memo: dict[int, str | None] = {}

    def cached(pid: int) -> str | None:
        if pid not in memo:
            memo[pid] = lease_of_pid(pid)
        return memo[pid]

    overuses: list[Overuse] = []
    judged: set[str] = set()
    for use in uses:
        found, seen = device_overuse(use, holders.get(use.device_id, ()), cached, tolerance_mib)
        overuses.extend(found)
        judged |= seen
    return Verdict(overuses, frozenset(judged))


@dataclass
class OveruseEpisodes:
    """Which leases are over their grant now, so each episode is reported exactly once.

    An episode starts the first tick a lease is found over its grant (on any device) and ends
    the first tick it is judged and found within it, or when it no longer holds a device of this
    node. A lease that could not be judged this tick (its device sent no sample) keeps its
    episode, so a flaky reading does not repeat the report. Episodes live in memory: a restarted
    collector reports a still-running episode once more.
    """

    open: dict[str, Overuse] = field(default_factory=dict)

    def update(self, verdict: Verdict, holding: Iterable[str]) -> list[Overuse]:
        """Feed one tick; ``holding`` are the leases holding a device of this node. Returns the
        over-uses that start an episode (one per lease, its first device in id order)."""
        over: dict[str, Overuse] = {}
        for found in sorted(verdict.overuses, key=lambda o: (o.lease_id, o.device_id)):
            over.setdefault(found.lease_id, found)
        live = set(holding)
        for lease_id in list(self.open):
            ended = lease_id not in live
            if ended or (lease_id in verdict.judged and lease_id not in over):
                del self.open[lease_id]
        started = [o for lease_id, o in over.items() if lease_id not in self.open]
        self.open.update((o.lease_id, o) for o in started)
        return started
