"""Crash edges: a process killed at an unlucky moment, the streams read back afterwards.

Each test counts every job's terminal events as JetStream stored them (the operator's
``XPUPOOL_EVENTS`` and the tenant's ``XPUPOOL_TENANT_EVENTS``), one per event id, since a
subscriber may have missed or doubled what the streams keep once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from collections.abc import Callable

import pytest
from redis.asyncio import Redis

from tests.conftest import eventually
from tests.e2e.conftest import Ready, terminal_counts
from xpupool.contracts import (
    AllocationGranted,
    JobRequested,
    subjects,
)
from xpupool.devstack.stack import NodeSpec, Stack
from xpupool.ledger import audit

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

# Keeps Redis busy (one script runs at a time, and nothing else meanwhile) for ARGV[1] ms, well
# under its busy-reply threshold (5 s), past which it would answer other clients BUSY.
_HOLD_REDIS = """
local t = redis.call('TIME')
local until_us = t[1] * 1000000 + t[2] + tonumber(ARGV[1]) * 1000
repeat t = redis.call('TIME') until t[1] * 1000000 + t[2] >= until_us
return 1
"""


async def hold_redis(redis: Redis, ms: int) -> None:
    """Keep Redis busy for ``ms`` (``_HOLD_REDIS``): whatever is sent to it meanwhile waits."""
    await redis.eval(_HOLD_REDIS, 0, str(ms))


async def test_request_whose_ack_was_lost_is_not_rejected_after_its_job_ended(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    """The scheduler admits a request, and its ack is lost: nats-server is killed before it
    reads it (a scheduler killed after its admission script and before its ack leaves the
    ledger the same way). The job is granted and its holder releases it; then the request,
    never acked, is delivered again when its ack_wait (30 s) runs out. It is the same request,
    whose job has had its outcome, so it must publish nothing: the job ends in one grant and one
    LeaseEnded, never a JobRejected (``duplicate_job``) on top of them."""
    # Requests wait for a cycle: the admission script is the first thing an arrival sends.
    stack = make_stack(
        [NodeSpec("node-c", "2xA100-80GB")], extra_env={"XPUPOOL_PLACE_ON_ADMISSION": "0"}
    )
    ledger = await ready(stack, 2)
    await stack.wait_until_pulling()
    assert stack.redis_url and stack.nats and stack.nats.process
    blocker = Redis.from_url(stack.redis_url)
    try:
        async with stack.client() as client:
            waiting = client.expect("once")
            # Redis held: the scheduler takes the request and waits on its admission.
            hold = asyncio.create_task(hold_redis(blocker, 2000))
            await asyncio.sleep(0.3)
            delivered = time.monotonic()
            await client.submit(JobRequested(job_id="once", tenant="t"))

            async def taken() -> bool:
                info = await client.js.consumer_info(
                    subjects.SCHEDULER_JOBS.stream.name, subjects.SCHEDULER_JOBS.name
                )
                return bool(info.num_ack_pending == 1)

            await eventually(taken, timeout_s=1.5)
            # nats-server frozen: the ack the scheduler sends once admitted is never read.
            os.kill(stack.nats.process.pid, signal.SIGSTOP)
            await hold

            async def admitted() -> bool:
                return await ledger.get_job("once") is not None

            await eventually(admitted, timeout_s=5)
            await asyncio.sleep(0.3)  # the scheduler has written its ack
            stack.nats.restart()
            grant = await asyncio.wait_for(waiting, 30)
            assert isinstance(grant, AllocationGranted)
            reply = await client.release(grant.lease_id, grant.fencing_token)
            assert reply.ok, reply
            # Past the request's redelivery (ack_wait after its delivery), and its handling.
            await asyncio.sleep(max(0.0, delivered + 33 - time.monotonic()))
            counts = await terminal_counts(client.nc, "once")
            one_grant_one_end = Counter({"AllocationGranted": 1, "LeaseEnded": 1})
            assert counts == {
                subjects.EVENTS_STREAM.name: one_grant_one_end,
                subjects.TENANT_EVENTS_STREAM.name: one_grant_one_end,
            }
        assert await audit(ledger) == []
    finally:
        await blocker.aclose()


async def test_collector_killed_holds_its_device_until_the_lease_ends_lost(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    """A node's collector is killed (SIGKILL) under a live lease while another job waits for a
    device: the dead node's device is granted to no one while that lease lives, nor after it
    ends ``lost`` (the node is lost); the waiting job gets it once the collector is back. Each
    job ends once, in both streams. (A second, busy node of the model keeps the waiting job
    waiting: were the dead node the model's only one, the job would be rejected as never
    fitting, ``exceeds_node_capacity``.)"""
    nodes = [NodeSpec("node-k", "1xA100-80GB"), NodeSpec("node-o", "1xA100-80GB")]
    stack = make_stack(
        nodes, extra_env={"XPUPOOL_NODE_GRACE_S": "2", "XPUPOOL_SAMPLE_INTERVAL_S": "0.3"}
    )
    ledger = await ready(stack, 2)
    collector = next(s for s in stack.services if s.env.get("XPUPOOL_NODE_ID") == "node-k")
    async with stack.client() as client:
        held: dict[str, AllocationGranted] = {}
        for job_id in ("held-1", "held-2"):
            grant = await client.submit_and_wait(JobRequested(job_id=job_id, tenant="t"))
            assert isinstance(grant, AllocationGranted)
            held[grant.slices[0].node_id] = grant
        on_dead = held["node-k"]
        waiting = client.expect("next")
        await client.submit(JobRequested(job_id="next", tenant="t"))

        async def pending() -> bool:
            job = await ledger.get_job("next")
            return job is not None and job.state == "pending"

        await eventually(pending)
        stack.kill(collector)

        async def ended_lost() -> bool:
            lease = await ledger.get_lease(on_dead.lease_id)
            return lease is not None and lease.state == "ended" and lease.end_reason == "lost"

        await eventually(ended_lost, timeout_s=15)
        await asyncio.sleep(1.5)
        assert not waiting.done(), waiting.result()  # its node is lost: nothing to grant on
        stack.restart(collector)
        second = await asyncio.wait_for(waiting, 30)
        assert isinstance(second, AllocationGranted)
        assert second.slices[0].device_id == on_dead.slices[0].device_id
        for grant in (second, held["node-o"]):
            reply = await client.release(grant.lease_id, grant.fencing_token)
            assert reply.ok, reply
        await asyncio.sleep(1.0)
        for job_id in ("held-1", "held-2", "next"):
            counts = await terminal_counts(client.nc, job_id)
            expected = Counter({"AllocationGranted": 1, "LeaseEnded": 1})
            assert counts == {
                subjects.EVENTS_STREAM.name: expected,
                subjects.TENANT_EVENTS_STREAM.name: expected,
            }, job_id
    assert await audit(ledger) == []


async def test_lease_manager_and_nats_killed_between_release_and_its_event(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    """The lease-manager ends a lease on its holder's release, and dies with nats-server before
    its LeaseEnded reaches the stream (the event sits in a frozen server's socket): the entry
    its release script left in the direct outbox is published by the restarted lease-manager's
    sweep, once, and the device is free again."""
    stack = make_stack([NodeSpec("node-m", "1xA100-80GB")])
    ledger = await ready(stack, 1)
    await stack.wait_until_pulling()
    assert stack.redis_url and stack.nats and stack.nats.process
    lease_manager = next(s for s in stack.services if s.name == "lease-manager")
    blocker = Redis.from_url(stack.redis_url)
    try:
        async with stack.client() as client:
            grant = await client.submit_and_wait(JobRequested(job_id="freed", tenant="t"))
            assert isinstance(grant, AllocationGranted)
            # Redis held: the lease-manager takes the release and waits on its script.
            hold = asyncio.create_task(hold_redis(blocker, 2000))
            await asyncio.sleep(0.3)
            release = asyncio.create_task(client.release(grant.lease_id, grant.fencing_token))
            await asyncio.sleep(0.5)
            os.kill(stack.nats.process.pid, signal.SIGSTOP)
            await hold

            async def ended() -> bool:
                lease = await ledger.get_lease(grant.lease_id)
                return lease is not None and lease.state == "ended"

            await eventually(ended, timeout_s=5)
            await asyncio.sleep(0.3)  # its LeaseEnded is written to the frozen server
            stack.kill(lease_manager)
            stack.nats.restart()
            with pytest.raises(Exception):  # noqa: B017,PT011  (no reply ever came)
                await release
            stack.restart(lease_manager)

            # The sweep publishes what stayed in the direct outbox past DIRECT_STALE_MS (10 s).
            async def left() -> int:
                return int(await ledger.redis.xlen(ledger.key("outbox", "direct")))

            assert await left() == 1  # the release's entry, never confirmed

            async def swept() -> bool:
                return await left() == 0

            await eventually(swept, timeout_s=30)
            after = await client.submit_and_wait(JobRequested(job_id="after", tenant="t"))
            assert isinstance(after, AllocationGranted)
            counts = await terminal_counts(client.nc, "freed")
            expected = Counter({"AllocationGranted": 1, "LeaseEnded": 1})
            assert counts == {
                subjects.EVENTS_STREAM.name: expected,
                subjects.TENANT_EVENTS_STREAM.name: expected,
            }
        assert await audit(ledger) == []
    finally:
        await blocker.aclose()
