"""The operator console against a running stack: ``status`` totals after a grant, ``events``
with its filters, one frame of ``top``."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.conftest import eventually
from tests.e2e.conftest import Ready
from tests.e2e.test_cli import _cli
from xpupool.devstack.stack import NodeSpec, Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


async def test_status_events_top_after_a_grant(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    stack = make_stack(
        [NodeSpec("node-k", "2xA100-80GB")],
        extra_env={"XPUPOOL_SCHEDULER_METRICS_REFRESH_S": "0.3"},
    )
    await ready(stack, 1)
    submitted = await asyncio.to_thread(
        _cli,
        stack,
        "submit",
        "--tenant",
        "con",
        "--job-id",
        "con-1",
        "--compute-pct",
        "50",
        "--wait",
    )
    assert submitted.returncode == 0, submitted.stderr
    grant = json.loads(submitted.stdout)

    shown = await asyncio.to_thread(_cli, stack, "status", "--json")
    assert shown.returncode == 0, shown.stderr
    status = json.loads(shown.stdout)
    [pool] = status["pool"]
    assert pool["devices"] == 2 and pool["healthy"] == 2
    # 50% of one of two devices: a quarter of the group's compute.
    assert pool["compute_used_pct"] == 25.0
    taken = grant["slices"][0]["memory_mib"]
    assert taken > 0 and pool["memory_used_mib"] == taken
    assert pool["memory_free_mib"] == pool["memory_total_mib"] - taken
    assert sum(q["running"] for q in status["queues"]) == 1
    assert sum(q["pending"] for q in status["queues"]) == 0
    assert sum(q["pool_compute_share"] for q in status["queues"]) == 0.25

    listed = await asyncio.to_thread(_cli, stack, "events", "--type", "granted")
    assert listed.returncode == 0, listed.stderr
    lines = [json.loads(x) for x in listed.stdout.splitlines()]
    assert [(x["type"], x["tenant"], x["job"], x["lease"]) for x in lines] == [
        ("alloc.granted", "con", "con-1", grant["lease_id"])
    ]
    assert "node-k/" in lines[0]["summary"]
    mine = await asyncio.to_thread(_cli, stack, "events", "--tenant", "con")
    assert mine.returncode == 0, mine.stderr
    assert {json.loads(x)["job"] for x in mine.stdout.splitlines()} == {"con-1"}
    others = await asyncio.to_thread(_cli, stack, "events", "--tenant", "nobody")
    assert others.returncode == 0 and others.stdout == ""

    top = await asyncio.to_thread(_cli, stack, "top", "--once")
    assert top.returncode == 0, top.stderr
    assert "pool" in top.stdout and "latest events" in top.stdout
    assert "alloc.granted" in top.stdout and "con-1" in top.stdout

    def fair_share() -> list[tuple[str, float, float]]:
        """The queues' fair-share usage once the scheduler has published one with usage."""
        done = _cli(stack, "status", "--json")
        assert done.returncode == 0, done.stderr
        rows = json.loads(done.stdout)["queues"]
        return [
            (q["queue"], q["fair_share_usage"], q["fair_share_fraction"])
            for q in rows
            if q["fair_share_usage"]
        ]

    # The scheduler folds what queues hold into its fair-share history when it decides: a
    # second request makes it fold the first lease in, and publish that for the console.
    second = await asyncio.to_thread(
        _cli,
        stack,
        "submit",
        "--tenant",
        "con",
        "--job-id",
        "con-2",
        "--compute-pct",
        "50",
        "--wait",
    )
    assert second.returncode == 0, second.stderr
    # The running leases' queue is the only one that has used anything.
    [(_, used, fraction)] = await eventually(lambda: asyncio.to_thread(fair_share), timeout_s=20)
    assert used > 0 and fraction == 1.0


async def test_events_follow_prints_a_new_grant(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    stack = make_stack([NodeSpec("node-f", "1xA100-80GB")])
    await ready(stack, 1)
    env = dict(
        os.environ,
        XPUPOOL_NATS_URL=stack.nats_url or "",
        XPUPOOL_REDIS_URL=stack.redis_url or "",
        XPUPOOL_NAMESPACE=stack.namespace,
    )
    follower = await asyncio.to_thread(
        subprocess.Popen,
        [sys.executable, "-m", "xpupool.cli.main", "events", "--follow", "--type", "granted"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert follower.stderr is not None and follower.stdout is not None
        banner = await asyncio.wait_for(asyncio.to_thread(follower.stderr.readline), 30)
        assert banner.startswith("following "), banner
        submitted = await asyncio.to_thread(
            _cli, stack, "submit", "--tenant", "fol", "--job-id", "fol-1", "--count", "1", "--wait"
        )
        assert submitted.returncode == 0, submitted.stderr
        first = await asyncio.wait_for(asyncio.to_thread(follower.stdout.readline), 30)
        line = json.loads(first)
        assert (line["type"], line["tenant"], line["job"]) == ("alloc.granted", "fol", "fol-1")
    finally:
        follower.send_signal(signal.SIGINT)
        await asyncio.to_thread(follower.communicate, timeout=10)
    assert follower.returncode == 130


def _cli_as(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "xpupool.cli.main", *args],
        env=dict(os.environ, **env),
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_on_the_secure_stack_a_tenant_sees_only_its_own_events(
    tmp_path: Path, ready: Ready
) -> None:
    stack = Stack(
        nodes=[NodeSpec("node-s", "1xA100-80GB")],
        secure=True,
        tenants=["alice", "bob"],
        workdir=tmp_path / "stack",
    )
    stack.workdir.mkdir(parents=True, exist_ok=True)
    stack.start()
    try:
        await ready(stack, 1)
        alice, operator = stack.tenant_env("alice"), stack.operator_env()
        follower = await asyncio.to_thread(
            subprocess.Popen,
            [sys.executable, "-m", "xpupool.cli.main", "events", "--follow", "--tenant", "alice"],
            env=dict(os.environ, **alice),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert follower.stderr is not None and follower.stdout is not None
            banner = await asyncio.wait_for(asyncio.to_thread(follower.stderr.readline), 30)
            assert banner.startswith("following xpupool.tenant.v1.alice.events"), banner
            submitted = await asyncio.to_thread(
                _cli_as, alice, "submit", "--tenant", "alice", "--job-id", "sec-1", "--wait"
            )
            assert submitted.returncode == 0, submitted.stderr
            lines: list[dict[str, str]] = []
            while not any(x["type"] == "alloc.granted" for x in lines):
                raw = await asyncio.wait_for(asyncio.to_thread(follower.stdout.readline), 30)
                lines.append(json.loads(raw))
            assert {(x["tenant"], x["job"]) for x in lines} == {("alice", "sec-1")}
        finally:
            follower.send_signal(signal.SIGINT)
            await asyncio.to_thread(follower.communicate, timeout=10)

        # Alice's credentials cannot read bob's subjects: the server refuses, the CLI says so.
        snooping = await asyncio.to_thread(_cli_as, alice, "events", "--follow", "--tenant", "bob")
        assert snooping.returncode == 2 and "refused" in snooping.stderr, snooping.stderr
        assert snooping.stdout == ""
        # Nor the event streams (no JetStream API for a tenant).
        history = await asyncio.to_thread(_cli_as, alice, "events", "--tenant", "alice")
        assert history.returncode == 2 and "--follow" in history.stderr, history.stderr

        # Operator credentials see every tenant's events in the stream.
        seen = await asyncio.to_thread(_cli_as, operator, "events", "--type", "granted")
        assert seen.returncode == 0, seen.stderr
        assert [json.loads(x)["job"] for x in seen.stdout.splitlines()] == ["sec-1"]
    finally:
        stack.stop()
