"""The xpupool command line against a running stack, and `xpupool dev up` start/stop."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable

import pytest

from tests.e2e.conftest import Ready
from xpupool.devstack.stack import NodeSpec, Stack

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def _cli(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(
        os.environ,
        XPUPOOL_NATS_URL=stack.nats_url or "",
        XPUPOOL_REDIS_URL=stack.redis_url or "",
        XPUPOOL_NAMESPACE=stack.namespace,
    )
    return subprocess.run(
        [sys.executable, "-m", "xpupool.cli.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


async def test_submit_wait_status_explain_release(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    """submit --wait prints the grant as JSON; status and explain show it; release frees it."""
    stack = make_stack([NodeSpec("node-c", "1xA100-80GB")])
    await ready(stack, 1)
    submitted = await asyncio.to_thread(
        _cli,
        stack,
        "submit",
        "--tenant",
        "cli",
        "--job-id",
        "cli-1",
        "--compute-pct",
        "50",
        "--wait",
    )
    assert submitted.returncode == 0, submitted.stderr
    grant = json.loads(submitted.stdout)
    assert grant["type"] == "xpupool.alloc.granted.v1" and grant["slices"][0]["compute_pct"] == 50

    status = json.loads(
        (await asyncio.to_thread(_cli, stack, "status", "--nodes", "--json")).stdout
    )
    device = status[0]["devices"][0]
    assert device["compute_free_pct"] == 50 and device["holders"] == 1

    explained = json.loads((await asyncio.to_thread(_cli, stack, "explain", "cli-1")).stdout)
    assert explained["lease_id"] == grant["lease_id"] and explained["lease_state"] == "active"

    holder = ["--tenant", grant["tenant"], "--secret", grant["lease_secret"]]
    stale = await asyncio.to_thread(
        _cli,
        stack,
        "release",
        grant["lease_id"],
        "--token",
        str(grant["fencing_token"] + 1),
        *holder,
    )
    assert stale.returncode == 1 and json.loads(stale.stdout)["error"] == "stale_token"
    released = await asyncio.to_thread(
        _cli, stack, "release", grant["lease_id"], "--token", str(grant["fencing_token"]), *holder
    )
    assert released.returncode == 0 and json.loads(released.stdout)["ok"] is True
    again = await asyncio.to_thread(
        _cli, stack, "release", grant["lease_id"], "--token", str(grant["fencing_token"]), *holder
    )
    assert again.returncode == 1 and json.loads(again.stdout)["error"] == "lease_ended"


async def test_submit_host_only_job(make_stack: Callable[..., Stack], ready: Ready) -> None:
    """submit --count 0 --cpu-milli asks for a host-only job: granted with no slice, its node in
    ``host``, which explain shows too."""
    stack = make_stack([NodeSpec("node-h", "1xA100-80GB")])
    await ready(stack, 1)
    args = ("--tenant", "cli", "--job-id", "cli-h", "--count", "0", "--cpu-milli", "2000")
    submitted = await asyncio.to_thread(_cli, stack, "submit", *args, "--wait")
    assert submitted.returncode == 0, submitted.stderr
    grant = json.loads(submitted.stdout)
    assert grant["slices"] == [] and grant["env"]["CUDA_VISIBLE_DEVICES"] == ""
    assert grant["host"] == [{"node_id": "node-h", "cpu_milli": 2000, "memory_mib": 0}]
    explained = json.loads((await asyncio.to_thread(_cli, stack, "explain", "cli-h")).stdout)
    assert explained["devices"] == [] and explained["host"]["node-h"]["cpu_milli"] == 2000


def test_dev_up_prints_urls_and_leaves_nothing_behind() -> None:
    """`xpupool dev up` starts servers and services, prints the URLs, and on Ctrl-C stops every
    process it started."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("XPUPOOL_NATS_URL", "XPUPOOL_REDIS_URL")
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "xpupool.cli.main", "dev", "up"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert process.stdout is not None
    lines = [process.stdout.readline() for _ in range(3)]
    assert lines[0].startswith("XPUPOOL_NATS_URL=nats://127.0.0.1:")
    assert lines[1].startswith("XPUPOOL_REDIS_URL=redis://127.0.0.1:")
    workdir = lines[2].split()[2].rstrip(";")
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=30) == 0
    process.stdout.close()
    leftovers = subprocess.run(["pgrep", "-f", workdir], capture_output=True, text=True)
    assert leftovers.stdout.strip() == ""
