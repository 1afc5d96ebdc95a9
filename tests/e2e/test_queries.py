"""Tenant queries by request/reply: its jobs, its leases, one lease; nobody else's."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable

import pytest

from tests.conftest import eventually
from tests.e2e.conftest import Ready, cli_env
from xpupool.contracts import (
    AllocationGranted,
    JobRequested,
    JobState,
    LeaseState,
    QueryError,
)
from xpupool.contracts import subjects as s
from xpupool.devstack.stack import NodeSpec, Stack
from xpupool.ledger import Retention

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

OWNER, OTHER = "alpha", "beta"


@pytest.fixture(params=["plain", "secure"])
def stack_security(request: pytest.FixtureRequest) -> str:
    return str(request.param)


async def test_a_tenant_sees_its_jobs_and_leases_and_no_one_elses(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    stack = make_stack(
        [NodeSpec("node-q", "1xA100-80GB")],
        tenants=[OWNER, OTHER],
        extra_env={"XPUPOOL_JOB_RETENTION_S": "7200", "XPUPOOL_LEASE_RETENTION_S": "3600"},
    )
    ledger = await ready(stack, 1)
    async with stack.client(OWNER) as owner, stack.client(OTHER) as other:
        grant = await owner.submit_and_wait(JobRequested(job_id="q-run", tenant=OWNER))
        assert isinstance(grant, AllocationGranted)
        await owner.submit(JobRequested(job_id="q-wait", tenant=OWNER))

        async def listed() -> dict[str, JobState]:
            jobs = (await owner.jobs()).jobs
            states = {j.job_id: j.state for j in jobs}
            decided = any(j.reason and j.reason.value != "queued" for j in jobs)
            return states if states.get("q-wait") is JobState.PENDING and decided else {}

        assert await eventually(listed) == {"q-wait": JobState.PENDING, "q-run": JobState.LEASED}
        (waiting, running) = (await owner.jobs()).jobs  # newest first
        assert waiting.job_id == "q-wait" and waiting.reason is not None
        assert waiting.reason.value == "insufficient_capacity"
        assert running.lease_id == grant.lease_id and running.reason is None

        leases = await owner.leases()
        (lease,) = leases.leases
        assert lease.lease_id == grant.lease_id and lease.state is LeaseState.ACTIVE
        assert lease.fencing_token == grant.fencing_token and lease.slices == grant.slices
        one = await owner.lease(grant.lease_id)
        assert one.ok and one.leases == [lease]
        assert grant.lease_secret and grant.lease_secret not in str(leases)

        # Another tenant: nothing of alpha's, not even that the lease exists.
        assert (await other.jobs()).jobs == []
        assert (await other.leases()).leases == []
        foreign = await other.lease(grant.lease_id)
        assert not foreign.ok and foreign.error is QueryError.UNKNOWN_LEASE

        # Ended leases can still be looked up by id.
        assert (await owner.release(grant.lease_id, grant.fencing_token)).ok

        async def ended() -> bool:
            got = (await owner.lease(grant.lease_id)).leases
            return bool(got) and got[0].state is LeaseState.ENDED

        await eventually(ended)
        (after,) = (await owner.lease(grant.lease_id)).leases
        assert after.end_reason is not None and after.end_reason.value == "released"
        # ... for the lease retention the lease-manager gave the ledger; the job's id is taken
        # for the job retention.
        assert await ledger.retention() == Retention(job_s=7200, lease_s=3600)
        lease_ttl = await ledger.redis.ttl(ledger.key("lease", grant.lease_id))
        job_ttl = await ledger.redis.ttl(ledger.key("job", "q-run"))
        assert 3500 < lease_ttl <= 3600 and 7100 < job_ttl <= 7200
        assert await ledger.redis.ttl(ledger.key("job", "q-wait")) == -1

        # A malformed query is answered, naming the field.
        raw = await owner.nc.request(s.JOB_LIST.subject(tenant=OWNER), b'{"limit": 0}', timeout=5)
        bad = json.loads(raw.data)
        assert bad["ok"] is False and bad["error"] == "invalid_request" and "limit" in bad["detail"]


async def test_cli_jobs_and_leases(make_stack: Callable[..., Stack], ready: Ready) -> None:
    stack = make_stack([NodeSpec("node-q", "1xA100-80GB")], tenants=[OWNER])
    await ready(stack, 1)
    async with stack.client(OWNER) as owner:
        grant = await owner.submit_and_wait(JobRequested(job_id="cli-q", tenant=OWNER))
        assert isinstance(grant, AllocationGranted)
    env = cli_env(stack, OWNER)
    for command, needle in (("jobs", "cli-q"), ("leases", grant.lease_id)):
        done = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "xpupool.cli.main",
            command,
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(done.communicate(), 60)
        assert done.returncode == 0, err.decode()
        assert needle in out.decode()


async def test_a_tenant_polling_too_fast_is_refused_and_others_are_answered(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    """Past its query burst a tenant's lists are refused ``rate_limited`` (saying when to retry)
    by the scheduler and the lease-manager alike, before any ledger read; another tenant's
    queries are answered meanwhile, and the refused tenant's again once its bucket refills."""
    stack = make_stack(
        [NodeSpec("node-r", "1xA100-80GB")],
        tenants=[OWNER, OTHER],
        extra_env={"XPUPOOL_QUERY_RATE_PER_S": "2", "XPUPOOL_QUERY_BURST": "3"},
    )
    await ready(stack, 1)
    async with stack.client(OWNER) as owner, stack.client(OTHER) as other:
        jobs = [await owner.jobs() for _ in range(5)]
        leases = [await owner.leases() for _ in range(5)]
        for answers in (jobs, leases):
            assert [a.ok for a in answers[:3]] == [True] * 3, answers
            refused = [a for a in answers if not a.ok]
            assert refused and all(a.error is QueryError.RATE_LIMITED for a in refused), answers
            assert "retry in" in refused[0].detail
        assert (await other.jobs()).ok and (await other.leases()).ok
        await asyncio.sleep(1.0)
        assert (await owner.jobs()).ok and (await owner.leases()).ok
