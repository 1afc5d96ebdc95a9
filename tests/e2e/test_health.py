"""Device health end to end: simulated faults drive transitions through NATS and Redis."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from nats.aio.msg import Msg

from tests.conftest import eventually
from tests.e2e.conftest import EventLog, Ready
from xpupool.client import connected
from xpupool.contracts import (
    AllocationGranted,
    DeviceHealthChanged,
    DeviceSelector,
    EndReason,
    Health,
    InjectFault,
    JobPending,
    JobRequested,
    LeaseEnded,
    Vendor,
    encode,
)
from xpupool.contracts.subjects import SIM_FAULT
from xpupool.devstack.stack import NodeSpec, Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]


async def test_xid_makes_device_unhealthy_and_recovery_returns_it(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    """An XID 79 turns the device unhealthy (no new grants land on it); clearing the fault
    brings it back into service without a restart."""
    stack = make_stack([NodeSpec("node-h", "1xA100-80GB")])
    ledger = await ready(stack, 1)
    assert stack.nats_url
    log = EventLog()
    async with connected(stack.nats_url) as client:
        await log.attach(client.nc)

        async def health_events(_: object) -> None:
            pass

        device_events: list[DeviceHealthChanged] = []

        async def on_health(msg: Msg) -> None:
            from xpupool.contracts import decoder_for

            device_events.append(decoder_for((DeviceHealthChanged,)).decode(msg.data))

        await client.nc.subscribe("xpupool.devices.v1.health", cb=on_health)
        fault = InjectFault(node_id="node-h", device_id="node-h/nvidia0", fault="xid", xid_code=79)
        await client.nc.publish(SIM_FAULT.subject(node_id="node-h"), encode(fault))
        await eventually(lambda: any(e.current is Health.UNHEALTHY for e in device_events))

        async def unhealthy_in_ledger() -> bool:
            nodes = await ledger.nodes()
            return nodes[0].devices[0].health is Health.UNHEALTHY

        await eventually(unhealthy_in_ledger)
        waiting = client.expect("after-xid")
        await client.submit(JobRequested(job_id="after-xid", tenant="t"))
        await eventually(lambda: log.of(JobPending, "after-xid"))
        assert not waiting.done()

        clear = InjectFault(node_id="node-h", device_id="node-h/nvidia0", fault="clear")
        await client.nc.publish(SIM_FAULT.subject(node_id="node-h"), encode(clear))
        outcome = await asyncio.wait_for(waiting, 20)
        assert isinstance(outcome, AllocationGranted)
        assert any(e.current is Health.HEALTHY for e in device_events)


async def test_vanished_device_and_dead_node_end_leases_as_lost(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    """A device that disappears ends its lease as lost; a node that stops heartbeating is
    declared lost and every lease on it ends as lost."""
    stack = make_stack(
        [NodeSpec("node-v", "2xA100-80GB"), NodeSpec("node-d", "1xAscend910B")],
        extra_env={"XPUPOOL_NODE_GRACE_S": "2", "XPUPOOL_SAMPLE_INTERVAL_S": "0.3"},
    )
    await ready(stack, 3)
    assert stack.nats_url
    log = EventLog()
    async with connected(stack.nats_url) as client:
        await log.attach(client.nc)
        on_gpu = await client.submit_and_wait(
            JobRequested(
                job_id="on-gpu", tenant="t", selector=DeviceSelector(models=["A100-SXM4-80GB"])
            )
        )
        on_npu = await client.submit_and_wait(
            JobRequested(job_id="on-npu", tenant="t", selector=DeviceSelector(vendor=Vendor.ASCEND))
        )
        assert isinstance(on_gpu, AllocationGranted) and isinstance(on_npu, AllocationGranted)
        gone = InjectFault(
            node_id="node-v", device_id=on_gpu.slices[0].device_id, fault="disappear"
        )
        await client.nc.publish(SIM_FAULT.subject(node_id="node-v"), encode(gone))
        ended = await eventually(lambda: log.of(LeaseEnded, "on-gpu"))
        assert ended[0].reason is EndReason.LOST

        await client.nc.publish(
            SIM_FAULT.subject(node_id="node-d"),
            encode(InjectFault(node_id="node-d", fault="kill_node")),
        )
        ended = await eventually(lambda: log.of(LeaseEnded, "on-npu"))
        assert ended[0].reason is EndReason.LOST
        assert len(log.of(LeaseEnded, "on-gpu")) == 1
