"""The per-device health model: pure, fed one tick of samples at a time.

A device's health is what its backend reports (XID, ECC, temperature, vendor health) while it
reports; a device missing from ``missed_limit`` consecutive ticks is ``lost``. Only changes are
returned, so each transition becomes exactly one event.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from xpupool.contracts import DeviceSample, Health


@dataclass(frozen=True)
class Transition:
    """One device moving from one health state to another."""

    device_id: str
    previous: Health
    current: Health
    reason: str


@dataclass
class HealthModel:
    """Tracks the health of a node's devices across ticks."""

    missed_limit: int
    states: dict[str, Health] = field(default_factory=dict)
    missed: dict[str, int] = field(default_factory=dict)

    def observe(self, known: Iterable[str], samples: Iterable[DeviceSample]) -> list[Transition]:
        """Feed one tick: ``known`` are the device ids the ledger holds for this node."""
        seen = {s.device_id: s for s in samples}
        transitions = []
        for device_id in sorted(set(known) | set(seen)):
            previous = self.states.get(device_id, Health.HEALTHY)
            sample = seen.get(device_id)
            if sample is not None:
                self.missed[device_id] = 0
                current, reason = sample.health, reason_of(sample)
            else:
                self.missed[device_id] = self.missed.get(device_id, 0) + 1
                if self.missed[device_id] < self.missed_limit:
                    continue
                current, reason = Health.LOST, f"no sample for {self.missed[device_id]} ticks"
            self.states[device_id] = current
            if current is not previous:
                transitions.append(Transition(device_id, previous, current, reason))
        return transitions


def reason_of(sample: DeviceSample) -> str:
    """Why a sample reads the health it does, in a few words."""
    if sample.health is Health.HEALTHY:
        return "reporting normally"
    if sample.xid is not None:
        return f"xid {sample.xid}"
    if sample.temperature_c is not None:
        return f"temperature {sample.temperature_c:.0f} C"
    return "vendor health"
