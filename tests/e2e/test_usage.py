"""xpupool usage against a running stack: a job granted, run and released shows up in the
usage report with its device-hours, cost and efficiency, and in --idle while it holds an idle
device."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import jsonschema
import msgspec
import pytest

from tests.e2e.conftest import Ready
from tests.e2e.test_cli import _cli
from xpupool.contracts import UsageRecord
from xpupool.devstack.stack import NodeSpec, Stack

PROTO = Path(__file__).resolve().parents[2] / "proto"

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


async def test_a_released_job_is_in_the_usage_report(
    make_stack: Callable[..., Stack], ready: Ready
) -> None:
    stack = make_stack([NodeSpec("node-u", "1xA100-80GB")])
    await ready(stack, 1)
    submitted = await asyncio.to_thread(
        _cli, stack, "submit", "--tenant", "acct", "--job-id", "u-1", "--wait"
    )
    assert submitted.returncode == 0, submitted.stderr
    grant = json.loads(submitted.stdout)
    await asyncio.sleep(1.0)

    running = await asyncio.to_thread(_cli, stack, "usage", "--json")
    assert running.returncode == 0, running.stderr
    (row,) = json.loads(running.stdout)
    assert row["key"] == "acct" and row["leases"] == 1 and row["device_hours"] > 0

    idle = await asyncio.to_thread(_cli, stack, "usage", "--idle", "--below", "1.01", "--json")
    assert idle.returncode == 0, idle.stderr
    (holding,) = json.loads(idle.stdout)  # below 101 %: every running lease is listed
    assert holding["lease_id"] == grant["lease_id"] and holding["tenant"] == "acct"

    holder = ["--tenant", "acct", "--secret", grant["lease_secret"]]
    released = await asyncio.to_thread(
        _cli, stack, "release", grant["lease_id"], "--token", str(grant["fencing_token"]), *holder
    )
    assert released.returncode == 0, released.stderr

    report = await asyncio.to_thread(_cli, stack, "usage", "--by", "model", "--json")
    assert report.returncode == 0, report.stderr
    (model,) = json.loads(report.stdout)
    assert model["key"].startswith("A100") and model["leases"] == 1
    assert model["device_hours"] >= 1.0 / 3600
    assert model["cost"] > 0 and model["capacity_hours"] == pytest.approx(model["device_hours"])
    assert model["efficiency"] is not None and 0.0 <= model["efficiency"] <= 1.0

    exported = await asyncio.to_thread(_cli, stack, "usage", "--records", "--since", "1h")
    assert exported.returncode == 0, exported.stderr
    (line,) = exported.stdout.splitlines()
    # What a billing store written from proto/ alone reads: the published schema holds.
    schema = json.loads((PROTO / "schemas" / "UsageRecord.json").read_text())
    jsonschema.validate(json.loads(line), schema)
    record = msgspec.json.decode(line, type=UsageRecord)
    assert (record.lease_id, record.tenant, record.end_reason) == (
        grant["lease_id"],
        "acct",
        "released",
    )
    assert not record.running and record.slices[0].granted_capacity_s > 0
    csv_out = (await asyncio.to_thread(_cli, stack, "usage", "--csv", "--since", "1h")).stdout
    assert csv_out.splitlines()[0].startswith("tenant,leases") and "acct," in csv_out
    bad = await asyncio.to_thread(_cli, stack, "usage", "--since", "yesterday-ish")
    assert bad.returncode == 2 and "not a duration" in bad.stderr
