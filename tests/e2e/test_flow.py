"""The walking skeleton end to end: every service a real subprocess on real NATS and Redis."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Callable
from typing import TypeVar

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import eventually
from tests.e2e.conftest import EventLog, Ready
from xpupool.contracts import (
    AllocationGranted,
    DeviceDemand,
    DeviceSelector,
    HostDemand,
    HostShare,
    JobRejected,
    JobRequested,
    Vendor,
)
from xpupool.contracts.payloads import Isolation
from xpupool.devstack.servers import free_port
from xpupool.devstack.stack import NodeSpec, Stack
from xpupool.ledger import audit

T = TypeVar("T")

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]


@pytest.fixture(params=["plain", "secure"])
def stack_security(request: pytest.FixtureRequest) -> str:
    """Every test here runs on the open loopback stack and on the secure one."""
    return str(request.param)


async def test_submit_grant_release_returns_capacity(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    """A whole-GPU job is granted with the NVIDIA env, and releasing it frees the device."""
    stack = make_stack([NodeSpec("node-a", "2xA100-80GB")])
    ledger = await ready(stack, 2)
    assert stack.nats_url
    async with stack.client() as client:
        outcome = await client.submit_and_wait(JobRequested(job_id="job-1", tenant="team-a"))
        assert isinstance(outcome, AllocationGranted), outcome
        assert len(outcome.slices) == 1 and outcome.slices[0].whole
        assert outcome.env["CUDA_VISIBLE_DEVICES"] == outcome.slices[0].uuid
        assert outcome.env["NVIDIA_VISIBLE_DEVICES"].startswith("GPU-")
        device_id = outcome.slices[0].device_id

        async def device_busy() -> bool:
            nodes = await ledger.nodes()
            return any(d.spec.device_id == device_id and d.holders == 1 for d in nodes[0].devices)

        await eventually(device_busy)
        reply = await client.release(outcome.lease_id, outcome.fencing_token)
        assert reply.ok, reply

        async def device_free() -> bool:
            nodes = await ledger.nodes()
            return all(
                d.holders == 0 and d.memory_free_mib == d.memory_total_mib for d in nodes[0].devices
            )

        await eventually(device_free)


async def test_invalid_request_is_rejected_naming_the_field(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    """A request with a bad field gets a rejection event naming it."""
    stack = make_stack([NodeSpec("node-a", "1xA100-80GB")])
    await ready(stack, 1)
    assert stack.nats_url
    async with stack.client() as client:
        future = client.expect("bad-1")
        await client.submit_raw(b'{"job_id": "bad-1", "tenant": "t", "count": -1}', tenant="t")
        outcome = await future_with_timeout(future)
        assert isinstance(outcome, JobRejected)
        assert outcome.field_name == "count"
        assert outcome.reason == "invalid_request"


async def test_host_only_job_gets_cpu_and_no_device(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    """A host-only job (count 0) is granted its CPU and memory on a node with no device and
    every visible-device variable empty; released, the node's CPU comes back. One that asks a
    device share as well is rejected naming the field."""
    stack = make_stack([NodeSpec("node-a", "2xA100-80GB", cpu_milli=16_000, memory_mib=65_536)])
    ledger = await ready(stack, 2)
    assert stack.nats_url
    async with stack.client() as client:
        outcome = await client.submit_and_wait(
            JobRequested(
                job_id="cpu-1",
                tenant="t",
                count=0,
                host=HostDemand(cpu_milli=6_000, memory_mib=4_096),
            )
        )
        assert isinstance(outcome, AllocationGranted), outcome
        assert outcome.slices == []
        assert outcome.host == [HostShare(node_id="node-a", cpu_milli=6_000, memory_mib=4_096)]
        for name in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES"):
            assert outcome.env[name] == "", name
        assert outcome.env["XPUPOOL_LEASE_ID"] == outcome.lease_id

        async def cpu_free() -> int:
            return (await ledger.nodes())[0].cpu_free_milli

        assert await cpu_free() == 10_000
        assert all(d.holders == 0 for d in (await ledger.nodes())[0].devices)
        reply = await client.release(outcome.lease_id, outcome.fencing_token)
        assert reply.ok, reply

        async def cpu_back() -> bool:
            return await cpu_free() == 16_000

        await eventually(cpu_back)
        assert await audit(ledger) == []

        bad = await client.submit_and_wait(
            JobRequested(
                job_id="cpu-bad",
                tenant="t",
                count=0,
                device=DeviceDemand(compute_pct=10),
                host=HostDemand(cpu_milli=1_000),
            )
        )
        assert isinstance(bad, JobRejected), bad
        assert (bad.reason, bad.field_name) == ("invalid_request", "device.compute_pct")


async def future_with_timeout(future: asyncio.Future[T], timeout_s: float = 20.0) -> T:
    """Await a future with a bound."""
    return await asyncio.wait_for(future, timeout_s)


async def test_share_request_gets_limits(make_stack: Callable[..., Stack], ready: Ready) -> None:
    """A fractional request gets a share with memory and compute limits in its env."""
    stack = make_stack([NodeSpec("node-a", "1xA100-80GB")])
    await ready(stack, 1)
    assert stack.nats_url
    async with stack.client() as client:
        outcome = await client.submit_and_wait(
            JobRequested(
                job_id="share-1", tenant="t", device=DeviceDemand(memory_mib=20000, compute_pct=25)
            )
        )
        assert isinstance(outcome, AllocationGranted), outcome
        assert not outcome.slices[0].whole
        assert outcome.env["CUDA_DEVICE_MEMORY_LIMIT_0"] == "20000m"
        assert outcome.env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"


async def test_hard_share_is_a_whole_mig_instance_and_shares_say_if_enforced(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    """isolation: hard on a GPU in MIG mode gets the smallest MIG instance that holds it, whole,
    named by its MIG- UUID and without MPS limits; an MPS share says enforced, a Cambricon share
    (no limit a job's process reads) says it is not."""
    stack = make_stack(
        [
            NodeSpec("node-m", "1xA100-80GB:mig=3g.40gb+1g.10gb"),
            NodeSpec("node-a", "1xA100-80GB"),
            NodeSpec("node-c", "1xMLU370-X8"),
        ]
    )
    await ready(stack, 4)
    async with stack.client() as client:
        hard = await client.submit_and_wait(
            JobRequested(
                job_id="hard-1",
                tenant="t",
                device=DeviceDemand(memory_mib=8000),
                selector=DeviceSelector(isolation=Isolation.HARD),
            )
        )
        assert isinstance(hard, AllocationGranted), hard
        (s,) = hard.slices
        assert s.whole and s.enforced and s.uuid.startswith("MIG-"), s
        assert s.memory_mib < 20_000  # the 1g.10gb instance, not the 3g.40gb one
        assert hard.env["CUDA_VISIBLE_DEVICES"] == s.uuid
        assert not any("MPS" in k or "MEMORY_LIMIT" in k for k in hard.env)
        soft = await client.submit_and_wait(
            JobRequested(
                job_id="soft-1",
                tenant="t",
                device=DeviceDemand(memory_mib=8000),
                selector=DeviceSelector(device_ids=["node-a/nvidia0"]),
            )
        )
        assert isinstance(soft, AllocationGranted), soft
        assert not soft.slices[0].whole and soft.slices[0].enforced
        mlu = await client.submit_and_wait(
            JobRequested(
                job_id="mlu-1",
                tenant="t",
                device=DeviceDemand(memory_mib=8000),
                selector=DeviceSelector(vendor=Vendor.CAMBRICON),
            )
        )
        assert isinstance(mlu, AllocationGranted), mlu
        assert not mlu.slices[0].whole and not mlu.slices[0].enforced
        too_big = await client.submit_and_wait(
            JobRequested(
                job_id="hard-2",
                tenant="t",
                device=DeviceDemand(memory_mib=60_000),
                selector=DeviceSelector(isolation=Isolation.HARD),
            )
        )
        assert isinstance(too_big, JobRejected) and too_big.reason.value == "no_matching_device"


async def test_unrenewed_lease_expires_and_renewed_one_lives(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    """A lease renewed in time outlives its term; one left alone expires and frees its device."""
    from xpupool.contracts import EndReason, LeaseEnded

    stack = make_stack([NodeSpec("node-a", "2xA100-80GB")])
    ledger = await ready(stack, 2)
    assert stack.nats_url
    log = EventLog()
    async with stack.client() as client:
        await log.attach(client.nc)
        kept = await client.submit_and_wait(
            JobRequested(job_id="kept", tenant="t", lease_ttl_s=1.5)
        )
        left = await client.submit_and_wait(
            JobRequested(job_id="left", tenant="t", lease_ttl_s=1.5)
        )
        assert isinstance(kept, AllocationGranted) and isinstance(left, AllocationGranted)
        import asyncio

        for _ in range(8):  # 4 s, well past the 1.5 s term
            reply = await client.renew(kept.lease_id, kept.fencing_token)
            assert reply.ok, reply
            await asyncio.sleep(0.5)
        ended = await eventually(lambda: log.of(LeaseEnded, "left"))
        assert ended[0].reason is EndReason.EXPIRED
        assert not log.of(LeaseEnded, "kept")
        lease = await ledger.get_lease(kept.lease_id)
        assert lease is not None and lease.state == "active"
        stale = await client.renew(kept.lease_id, kept.fencing_token + 1)
        assert not stale.ok and stale.error == "stale_token"


async def test_duplicate_job_id_yields_one_lease(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    """The same job id submitted several times (with and without dedup headers) is one lease."""
    import asyncio

    stack = make_stack([NodeSpec("node-a", "4xA100-80GB")])
    ledger = await ready(stack, 4)
    assert stack.nats_url
    log = EventLog()
    async with stack.client() as client:
        await log.attach(client.nc)
        request = JobRequested(job_id="dup", tenant="t")
        from xpupool.contracts import encode

        await client.submit(request)
        await client.submit(request)
        await client.submit_raw(
            encode(request), tenant="t"
        )  # no Nats-Msg-Id: only the ledger dedups it
        await asyncio.sleep(0.5)
        await client.submit_raw(encode(request), msg_id="another-id", tenant="t")
        await eventually(lambda: log.of(AllocationGranted, "dup"))
        await asyncio.sleep(1.5)
        assert len(log.of(AllocationGranted, "dup")) == 1
        leases = [lease for lease in await ledger.leases() if lease.job_id == "dup"]
        assert len(leases) == 1


async def test_waiting_job_is_granted_when_capacity_frees(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    """A job that does not fit waits with a reason, and is granted when a lease ends: the
    lease's end wakes the scheduler's cycle (its periodic wake is set far past the test's
    bounds, so it could not be what places the job)."""
    from xpupool.contracts import JobPending

    stack = make_stack(
        [NodeSpec("node-a", "1xA100-80GB")], extra_env={"XPUPOOL_RETRY_INTERVAL_S": "600"}
    )
    await ready(stack, 1)
    assert stack.nats_url
    log = EventLog()
    async with stack.client() as client:
        await log.attach(client.nc)
        first = await client.submit_and_wait(JobRequested(job_id="first", tenant="t"))
        assert isinstance(first, AllocationGranted)
        waiting = client.expect("second")
        await client.submit(JobRequested(job_id="second", tenant="t"))
        pending = await eventually(lambda: log.of(JobPending, "second"))
        assert pending[0].reason == "insufficient_capacity"
        await client.release(first.lease_id, first.fencing_token)
        outcome = await future_with_timeout(waiting)
        assert isinstance(outcome, AllocationGranted)


def _admission_views(port: int) -> dict[str, float]:
    """The scheduler's ``xpupool_scheduler_admission_views_total`` by its ``view`` label."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return {
        s.labels["view"]: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "xpupool_scheduler_admission_views_total"
    }


async def test_lone_arrivals_are_placed_on_the_kept_copy_of_the_ledger(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    """One job at a time, each released before the next: the scheduler follows the ledger's
    change feed (its ACL lets it, and lets every service's scripts announce their changes), so
    most arrivals are placed on its kept copy without a read of their own; each is granted a
    device that is free at that moment, and the ledger audits clean."""
    port = free_port()
    stack = make_stack(
        [NodeSpec("node-a", "2xA100-80GB")],
        extra_env={
            "XPUPOOL_SCHEDULER_METRICS_PORT": str(port),
            "XPUPOOL_SAMPLE_INTERVAL_S": "5",
        },
    )
    ledger = await ready(stack, 2)
    jobs = 12
    async with stack.client() as client:
        for i in range(jobs):
            outcome = await client.submit_and_wait(
                JobRequested(job_id=f"lone-{i}", tenant="t", device=DeviceDemand(memory_mib=4096))
            )
            assert isinstance(outcome, AllocationGranted), outcome
            reply = await client.release(outcome.lease_id, outcome.fencing_token)
            assert reply.ok, reply
            await asyncio.sleep(0.05)  # the release's announcement reaches the scheduler
    views = _admission_views(port)
    kept, changed = views["kept"], views["changed"]
    assert kept - changed >= jobs // 2, (kept, changed)
    assert await audit(ledger) == []


async def test_two_schedulers_and_200_concurrent_requests_never_over_allocate(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    """Two scheduler replicas race over 200 requests for a tiny pool; the ledger never
    over-allocates, every grant is unique, and grants match the ledger's live leases."""
    import asyncio

    from xpupool.contracts import JobPending
    from xpupool.ledger import audit

    stack = make_stack([NodeSpec("node-a", "2xA100-80GB")], schedulers=2)
    ledger = await ready(stack, 2)
    assert stack.nats_url
    log = EventLog()
    shapes = [
        DeviceDemand(),  # whole
        DeviceDemand(memory_mib=16384, compute_pct=20),
        DeviceDemand(compute_pct=30),
        DeviceDemand(memory_pct=25),
    ]
    async with stack.client() as client:
        await log.attach(client.nc)
        requests = [
            JobRequested(job_id=f"race-{i}", tenant=f"t{i % 3}", device=shapes[i % len(shapes)])
            for i in range(200)
        ]
        await asyncio.gather(*(client.submit(r) for r in requests))

        def settled() -> bool:
            decided = {
                e.job_id for e in log.events if isinstance(e, AllocationGranted | JobPending)
            }
            return len(decided) == 200

        await eventually(settled, timeout_s=60)
        await asyncio.sleep(1.0)
        assert await audit(ledger) == []
        granted = log.of(AllocationGranted)
        assert len({g.job_id for g in granted}) == len(granted)
        live = await ledger.leases()
        assert {g.lease_id for g in granted} == {lease.lease_id for lease in live}
        assert 2 <= len(granted) < 200
