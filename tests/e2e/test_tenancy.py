"""Tenants you can trust, end to end on the secure configuration: TLS, one NKey identity per
tenant and per service, and the lease-manager's holder checks. Every hostile attempt is refused
and leaves the ledger as it was; the pool keeps serving the other tenants."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from tests.conftest import eventually
from tests.e2e.conftest import Ready
from xpupool.bus.connection import connect_client
from xpupool.client import XpupoolClient
from xpupool.contracts import (
    AllocationGranted,
    DeviceDemand,
    JobReason,
    JobRejected,
    JobRequested,
    LeaseError,
    encode,
)
from xpupool.contracts import subjects as s
from xpupool.devstack.stack import NodeSpec, Stack
from xpupool.ledger import audit

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

QUEUES = """
tenant_limits:
  flood: {rate_per_s: 2, burst: 3, max_pending: 100}
queues:
  - {name: shared, tenants: ["*"]}
  - {name: private, tenants: [alice]}
"""


@pytest.fixture
def secure_stack(tmp_path: Path) -> Iterator[Stack]:
    """One secure stack (TLS, NKeys, Redis ACLs) with tenants alice, bob, mallory and flood."""
    config = tmp_path / "queues.yaml"
    config.write_text(QUEUES)
    stack = Stack(
        nodes=[NodeSpec("node-a", "4xA100-80GB")],
        secure=True,
        tenants=["alice", "bob", "mallory", "flood"],
        workdir=tmp_path / "stack",
        extra_env={"XPUPOOL_QUEUE_CONFIG": str(config)},
    )
    stack.workdir.mkdir(parents=True, exist_ok=True)
    stack.start()
    yield stack
    stack.stop()


async def raw_tenant_connection(stack: Stack, tenant: str, errors: list[Exception]) -> Client:
    """A bare NATS connection with ``tenant``'s credentials that records permission errors."""
    env = stack.tenant_env(tenant)

    async def on_error(error: Exception) -> None:
        errors.append(error)

    return await connect_client(
        env["XPUPOOL_NATS_URL"],
        name=f"raw-{tenant}",
        creds=env["XPUPOOL_NATS_CREDS"],
        tls_ca=env["XPUPOOL_NATS_TLS_CA"],
        inbox_prefix=f"_INBOX.t.{tenant}",
        error_cb=on_error,
    )


async def _granted(client: XpupoolClient, job_id: str, **fields: object) -> AllocationGranted:
    outcome = await client.submit_and_wait(JobRequested(job_id=job_id, **fields), timeout_s=20)  # type: ignore[arg-type]
    assert isinstance(outcome, AllocationGranted), outcome
    return outcome


async def test_another_tenant_cannot_renew_release_or_read_a_lease(
    secure_stack: Stack, ready: Ready
) -> None:
    """Bob, knowing Alice's lease id, token and even her secret, is refused (not_owner) on his
    own subjects and cannot publish on hers or read her events; the lease is untouched."""
    ledger = await ready(secure_stack, 4)
    async with secure_stack.client("alice") as alice, secure_stack.client("bob") as bob:
        grant = await _granted(alice, "alice-1")
        assert grant.lease_secret and len(grant.lease_secret) >= 22  # >= 128 bits, base64
        before = await ledger.get_lease(grant.lease_id)
        for attempt in (
            bob.renew(grant.lease_id, grant.fencing_token, 1, secret=grant.lease_secret),
            bob.release(grant.lease_id, grant.fencing_token, secret=grant.lease_secret),
        ):
            reply = await attempt
            assert not reply.ok and reply.error == LeaseError.NOT_OWNER
        errors: list[Exception] = []
        raw = await raw_tenant_connection(secure_stack, "bob", errors)
        try:
            seen: list[bytes] = []

            async def keep(msg: Msg) -> None:
                seen.append(msg.data)

            await raw.subscribe(f"{s.TENANT_SPACE}.alice.events.>", cb=keep)
            await raw.publish(
                s.LEASE_RELEASE.subject(tenant="alice"),
                b'{"lease_id":"%s","lease_secret":"%s","fencing_token":%d}'
                % (grant.lease_id.encode(), grant.lease_secret.encode(), grant.fencing_token),
            )
            await raw.flush()
            await eventually(lambda: len(errors) >= 2, timeout_s=5)
            assert all("permissions violation" in str(e).lower() for e in errors), errors
            await alice.renew(grant.lease_id, grant.fencing_token)  # an event on Alice's subject
            await asyncio.sleep(0.5)
            assert seen == []
        finally:
            await raw.close()
        after = await ledger.get_lease(grant.lease_id)
        assert after is not None and before is not None
        assert after.state == "active" and after.token == before.token
        assert (await alice.release(grant.lease_id, grant.fencing_token)).ok
    assert await audit(ledger) == []


async def test_guessed_secret_stale_token_and_replayed_release_are_refused(
    secure_stack: Stack, ready: Ready
) -> None:
    """A wrong secret is bad_secret, an old token stale_token, and a release replayed after the
    lease ended is lease_ended, never ok; none of them changes the lease."""
    ledger = await ready(secure_stack, 4)
    async with secure_stack.client("alice") as alice:
        grant = await _granted(alice, "alice-2")
        token, lease_id = grant.fencing_token, grant.lease_id
        for guess in ("A" * 32, grant.lease_secret[:-1] + "x"):  # type: ignore[index]
            reply = await alice.renew(lease_id, token, 1, secret=guess)
            assert reply.error == LeaseError.BAD_SECRET
        assert (await alice.renew(lease_id, token - 1)).error == LeaseError.STALE_TOKEN
        lease = await ledger.get_lease(lease_id)
        assert lease is not None and lease.state == "active"
        assert (await alice.release(lease_id, token)).ok
        replay = await alice.release(lease_id, token)
        assert not replay.ok and replay.error == LeaseError.LEASE_ENDED
        assert (await alice.renew(lease_id, token)).error == LeaseError.LEASE_ENDED


async def test_submitting_as_another_tenant_or_on_a_foreign_queue_is_rejected(
    secure_stack: Stack, ready: Ready
) -> None:
    """A payload claiming another tenant and a queue the tenant may not charge are rejected to
    the sender, naming the field; publishing on another tenant's subject is not even accepted."""
    await ready(secure_stack, 4)
    async with secure_stack.client("mallory") as mallory:
        claim = await mallory.submit_and_wait(
            JobRequested(job_id="m-1", tenant="alice"), timeout_s=20
        )
        assert isinstance(claim, JobRejected)
        assert (claim.reason, claim.field_name, claim.tenant) == (
            JobReason.TENANT_MISMATCH,
            "tenant",
            "mallory",
        )
        queue = await mallory.submit_and_wait(
            JobRequested(job_id="m-2", queue="private"), timeout_s=20
        )
        assert isinstance(queue, JobRejected)
        assert (queue.reason, queue.field_name) == (JobReason.QUEUE_NOT_ALLOWED, "queue")
        shared = await mallory.submit_and_wait(
            JobRequested(job_id="m-3", queue="shared"), timeout_s=20
        )
        assert isinstance(shared, AllocationGranted) and shared.tenant == "mallory"
        with pytest.raises((nats.errors.Error, TimeoutError)):  # no PubAck: never stored
            await mallory.js.publish(
                s.JOB_REQUESTED.subject(tenant="alice"),
                encode(JobRequested(job_id="m-4")),
                timeout=2,
            )
        await mallory.release(shared.lease_id, shared.fencing_token)


async def test_a_flooding_tenant_is_rate_limited_while_others_are_served(
    secure_stack: Stack, ready: Ready
) -> None:
    """Over its rate limit a tenant gets rate_limited rejections; another tenant's job is
    granted meanwhile."""
    await ready(secure_stack, 4)
    async with secure_stack.client("flood") as flood, secure_stack.client("bob") as bob:
        futures = [flood.expect(f"f-{i}") for i in range(12)]
        for i in range(12):
            await flood.submit(JobRequested(job_id=f"f-{i}", device=DeviceDemand(memory_pct=5)))
        started = time.perf_counter()
        granted = await _granted(bob, "bob-calm")
        waited = time.perf_counter() - started
        outcomes = await asyncio.wait_for(asyncio.gather(*futures), 30)
        limited = [o for o in outcomes if isinstance(o, JobRejected)]
        assert limited and all(o.reason == JobReason.RATE_LIMITED for o in limited)
        assert sum(isinstance(o, AllocationGranted) for o in outcomes) >= 3
        assert granted.tenant == "bob"
        print(f"bob granted {waited:.3f}s after the flood")


async def test_forged_events_and_fault_commands_never_reach_anyone(
    secure_stack: Stack, ready: Ready
) -> None:
    """A tenant publishing forged grants, lease ends, node registrations and fault commands is
    refused by the server (nothing reaches any subscriber or stream), and another tenant's job
    is granted right after."""
    ledger = await ready(secure_stack, 4)
    operator = await secure_stack.connect_operator()
    seen: list[str] = []

    async def spy(msg: Msg) -> None:
        if b"forged" in msg.data:
            seen.append(msg.subject)

    for pattern in ("xpupool.alloc.v1.>", "xpupool.nodes.v1.>", "xpupool.sim.v1.>", ">"):
        await operator.subscribe(pattern, cb=spy)
    errors: list[Exception] = []
    raw = await raw_tenant_connection(secure_stack, "mallory", errors)
    forged = b'{"job_id":"forged","lease_id":"forged","node_id":"node-a","fault":"kill_node"}'
    targets = (
        "xpupool.alloc.v1.granted",
        "xpupool.alloc.v1.ended.released",
        "xpupool.nodes.v1.registered",
        "xpupool.sim.v1.fault.node-a",
        "xpupool.sched.v1.end_lease",
        "xpupool.tenant.v1.bob.events.granted",
        "$JS.API.STREAM.PURGE.XPUPOOL_EVENTS",
    )
    try:
        for subject in targets:
            await raw.publish(subject, forged)
        await raw.flush()
        await eventually(lambda: len(errors) >= len(targets), timeout_s=10)
    finally:
        await raw.close()
    assert all("permissions violation" in str(e).lower() for e in errors), errors
    async with secure_stack.client("bob") as bob:
        started = time.perf_counter()
        granted = await _granted(bob, "bob-after-forgery")
        print(f"bob granted {time.perf_counter() - started:.3f}s after the forgeries")
        await bob.release(granted.lease_id, granted.fencing_token)
    await asyncio.sleep(0.5)
    assert seen == []
    nodes = await ledger.nodes()
    assert [n.status for n in nodes] == ["up"]  # the forged kill_node never reached the fleet
    events = await operator.jetstream().stream_info(s.EVENTS_STREAM.name)
    assert events.state.messages > 0  # not purged
    await operator.close()
