"""Builders shared by the ledger's integration tests: device specs, reservations, and a direct
outbox running for a block and what it holds."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from nats.aio.client import Client

from xpupool.contracts import (
    AllocationGranted,
    DeviceSpec,
    LeaseEnded,
    LeaseRenewed,
    Vendor,
    decoder_for,
    subjects,
)
from xpupool.ledger import DirectOutbox, Ledger, Reservation, SliceClaim
from xpupool.ledger.outbox import Send


def device_spec(
    node: str, index: int, memory_mib: int = 81920, *, prefix: str = "nvidia"
) -> DeviceSpec:
    """An A100 ``<node>/<prefix><index>`` with ``memory_mib`` of memory."""
    return DeviceSpec(
        device_id=f"{node}/{prefix}{index}",
        vendor=Vendor.NVIDIA,
        model="A100",
        index=index,
        uuid=f"GPU-{node}-{index}",
        memory_mib=memory_mib,
    )


def reservation(job: str, *slices: SliceClaim, **kwargs: object) -> Reservation:
    """A reservation of ``slices`` for ``job`` (lease ``lease-<job>``); ``kwargs`` override."""
    fields: dict[str, object] = dict(
        job_id=job,
        lease_id=f"lease-{job}",
        tenant="t",
        queue="q",
        priority=500,
        owner="o",
        ttl_ms=60_000,
        hold_ms=60_000,
        slices=list(slices),
    )
    fields.update(kwargs)
    return Reservation(**fields)  # type: ignore[arg-type]


async def granted_whole_leases(ledger: Ledger, count: int, **kwargs: object) -> list[str]:
    """``count`` whole-device leases on one node ``n1`` (``lease-j<i>`` for job ``j<i>``),
    granted; ``kwargs`` go to each ``reservation``."""
    await ledger.register_node("n1", [device_spec("n1", i) for i in range(count)])
    leases = []
    for i in range(count):
        claim = SliceClaim(device_id=f"n1/nvidia{i}", memory_mib=81920, compute_pct=100, whole=True)
        assert (await ledger.reserve(reservation(f"j{i}", claim, **kwargs))).ok
        assert (await ledger.grant(f"lease-j{i}")).ok
        leases.append(f"lease-j{i}")
    return leases


@asynccontextmanager
async def running_direct_outbox(direct: DirectOutbox, send: Send) -> AsyncIterator[DirectOutbox]:
    """``direct`` running with ``send`` for the block, then stopped (what it holds confirmed)."""
    stop = asyncio.Event()
    running = asyncio.create_task(direct.run(send, stop))
    await asyncio.sleep(0)
    try:
        yield direct
    finally:
        stop.set()
        await asyncio.wait_for(running, 5)


async def direct_entries(ledger: Ledger) -> list[str]:
    """The ids of the entries the direct outbox holds, oldest first."""
    entries: Any = await ledger.redis.xrange(ledger.key("outbox", "direct"))
    return [i.decode() if isinstance(i, bytes) else str(i) for i, _ in entries]


LeaseEvent = AllocationGranted | LeaseRenewed | LeaseEnded
LEASE_EVENTS = decoder_for((AllocationGranted, LeaseRenewed, LeaseEnded))


async def stored_lease_events(nc: Client, stream: subjects.Stream) -> list[LeaseEvent]:
    """Every lease event ``stream`` holds, in the order it stored them (the streams hold jobs'
    and nodes' events too, which are left out)."""
    js = nc.jetstream()
    state = (await js.stream_info(stream.name)).state
    stored: list[LeaseEvent] = []
    for seq in range(state.first_seq, state.last_seq + 1):
        msg = await js.get_msg(stream.name, seq)
        try:
            stored.append(LEASE_EVENTS.decode(msg.data or b""))
        except msgspec.DecodeError:
            continue
    return stored
