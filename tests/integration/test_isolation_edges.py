"""The secure configuration's NATS permissions at their edges, on real servers: what a service's
identity must be able to publish beyond its own subjects for the JetStream features it uses."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import eventually
from xpupool.bus.connection import connect_client
from xpupool.contracts import access
from xpupool.contracts import subjects as s
from xpupool.devstack.stack import Stack
from xpupool.lease_manager.grant_watch import StoredGrants

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

# Well past the point where nats-server asks a push consumer for flow control (half of its
# 2 MiB pending-bytes window: JsFlowControlMaxPending / 16): 1500 grants with 2 KiB of headers.
GRANTS = 1500
HEADER_PAD = "x" * 2048


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    """Secured nats-server and redis-server (no services), streams declared by the operator."""
    secured = Stack(nodes=[], secure=True, tenants=["team-a"], workdir=tmp_path / "stack")
    secured.start_servers()
    yield secured
    secured.stop()


async def test_the_lease_managers_grant_watch_keeps_following_past_flow_control(
    stack: Stack,
) -> None:
    """The lease-manager follows the stored grants with an ordered (push) consumer, which
    nats-server paces with flow control: the client answers each flow-control request by
    publishing on its ``$JS.FC.…`` subject. As the lease-manager's identity, that answer must be
    allowed; refused, the server stops delivering after a couple of MiB of grants, for good,
    and every later renew or release whose grant is not yet confirmed waits out its timeout and
    publishes a copy."""
    assert stack.material is not None
    env = stack.material.service_env(access.LEASE_MANAGER)
    errors: list[str] = []

    async def record(error: Exception) -> None:
        errors.append(str(error))

    lease_manager = await connect_client(
        env["XPUPOOL_NATS_URL"],
        creds=env["XPUPOOL_NATS_CREDS"],
        tls_ca=env["XPUPOOL_NATS_TLS_CA"],
        inbox_prefix=access.service_inbox(access.LEASE_MANAGER),
        error_cb=record,
    )
    operator = await stack.connect_operator()
    watch = StoredGrants(keep_s=3600.0)
    stop = asyncio.Event()
    following = asyncio.create_task(watch.run(lease_manager.jetstream(), stop))
    try:
        await eventually(lambda: watch.following)
        js = operator.jetstream()
        for i in range(GRANTS):
            await js.publish(
                s.ALLOC_GRANTED.address,
                b"{}",
                headers={"Nats-Msg-Id": f"lease-{i}:granted", "x-pad": HEADER_PAD},
            )
        await eventually(lambda: watch.seen(f"lease-{GRANTS - 1}"), timeout_s=30)
        assert all(watch.seen(f"lease-{i}") for i in range(GRANTS))
        assert not [e for e in errors if "permissions violation" in e.lower()], errors[:3]
    finally:
        stop.set()
        await following
        await lease_manager.close()
        await operator.close()
