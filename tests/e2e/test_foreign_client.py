"""A client in another language, written from ``proto/`` alone, runs a job's whole life.

``foreign/proto_client.mjs`` is a tenant's client in JavaScript on the NATS wire protocol itself
(no NATS library, no xpupool code): it submits by request/reply and on the stream (twice, the
same job), renews, releases, and sends what a careless client would. This test checks what it
saw against ``proto/`` only (the AsyncAPI document's channels, operations and message headers,
and the JSON Schemas), never against the Python contracts: every message it sent and received is
valid where the document says it goes, and the invariants hold from the outside (one grant per
job, one end per lease, bad input answered with what was wrong). On the secure stack it connects
with its NKey seed over TLS, as a tenant in production does.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests.e2e.conftest import Ready
from xpupool.devstack.stack import NodeSpec, Stack

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.timeout(120),
    pytest.mark.skipif(shutil.which("node") is None, reason="needs node (Node.js) on PATH"),
]

PROTO = Path(__file__).resolve().parents[2] / "proto"
CLIENT = Path(__file__).resolve().parent / "foreign" / "proto_client.mjs"
TENANT = "polyglot"


@pytest.fixture(params=["plain", "secure"])
def stack_security(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@cache
def _document() -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load((PROTO / "asyncapi.yaml").read_text())
    return document


def _message_name(ref: str) -> str:
    return ref.rsplit("/", 1)[-1]


def _channel(subject: str) -> tuple[str, dict[str, Any]]:
    """The channel whose address (parameters as one token each) matches ``subject``."""
    for key, channel in _document()["channels"].items():
        pattern = re.sub(r"\\\{[a-z_]+\\\}", r"[^.]+", re.escape(channel["address"]))
        if re.fullmatch(pattern, subject):
            return key, channel
    raise AssertionError(f"no channel of proto/asyncapi.yaml has the address {subject}")


def _messages(channel: dict[str, Any]) -> list[str]:
    return [_message_name(m["$ref"]) for m in channel["messages"].values()]


def _replies(channel_key: str) -> list[str]:
    """The messages an operation on the channel answers with (its ``reply``)."""
    for operation in _document()["operations"].values():
        if operation["channel"]["$ref"].endswith("/" + channel_key) and "reply" in operation:
            return [_message_name(m["$ref"]) for m in operation["reply"]["messages"]]
    return []


def _validate(payload: Any, names: list[str], where: str) -> None:
    """``payload`` is valid against one of the named messages' JSON Schemas."""
    errors = []
    for name in names:
        schema = json.loads((PROTO / "schemas" / f"{name}.json").read_text())
        try:
            jsonschema.validate(payload, schema, format_checker=jsonschema.FormatChecker())
        except jsonschema.ValidationError as error:
            errors.append(f"{name}: {error.message}")
        else:
            return
    raise AssertionError(f"{where}: {payload!r} is none of {names}: {errors}")


def _check_headers(headers: dict[str, str], payload: dict[str, Any], where: str) -> None:
    """The CloudEvents headers every event carries (components.messages.*.headers)."""
    assert headers.get("ce-specversion") == "1.0", where
    assert headers.get("ce-type") == payload["type"], where
    assert headers.get("ce-id") and headers.get("ce-source"), where


async def _run_client(env: dict[str, str]) -> list[dict[str, Any]]:
    process = await asyncio.create_subprocess_exec(
        shutil.which("node") or "node",
        str(CLIENT),
        TENANT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), 90)
    finally:
        if process.returncode is None:
            process.kill()
    assert process.returncode == 0, err.decode()
    return [json.loads(line) for line in out.decode().splitlines()]


HOSTILE = ("proto-bad",)


async def test_a_javascript_client_from_proto_alone_runs_a_jobs_life(
    make_stack: Callable[..., Stack], ready: Ready, stack_security: str
) -> None:
    stack = make_stack([NodeSpec("node-p", "2xA100-80GB")], tenants=[TENANT])
    await ready(stack, 2)
    async with stack.client(TENANT) as client:
        await client.jobs()  # the scheduler serves: submissions before queries
    # Only what a tenant is given: the server's URL and, when secured, its NKey seed and the CA.
    env: dict[str, str] = {}
    if stack.material is not None:
        env.update(stack.tenant_env(TENANT))
    else:
        env["XPUPOOL_NATS_URL"] = stack.nats_url or ""
    lines = await _run_client(env)

    sent = {line["reply"]: line for line in lines if line["dir"] == "sent"}
    replies: dict[str, dict[str, Any]] = {}
    events: list[tuple[str, dict[str, Any]]] = []
    for line in lines:
        subject, payload, headers = line["subject"], line["payload"], line["headers"]
        if line["dir"] == "sent":
            _, channel = _channel(subject)
            if isinstance(payload, dict) and payload.get("job_id") not in HOSTILE:
                _validate(payload, _messages(channel), f"sent on {subject}")
        elif line["dir"] == "event":
            _, channel = _channel(subject)
            _validate(payload, _messages(channel), f"event on {subject}")
            _check_headers(headers, payload, f"event on {subject}")
            events.append((subject, payload))
        elif line["dir"] == "reply":
            request = sent[subject]
            key, _ = _channel(request["subject"])
            # A channel without a reply operation is a JetStream one: the server's own PubAck.
            if names := _replies(key):
                _validate(payload, names, subject)
            replies[subject] = {"to": request, "payload": payload}

    def answered(predicate: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        return [r["payload"] for r in replies.values() if predicate(r["to"])]

    def job(job_id: str) -> Callable[[dict[str, Any]], bool]:
        return lambda sent: (
            isinstance(sent["payload"], dict) and sent["payload"].get("job_id") == job_id
        )

    # The request/reply submission is answered with its grant; the stream's duplicate is one job.
    (first,) = answered(job("proto-1"))
    assert first["outcome"] == "granted" and first["granted"]["lease_secret"]
    acks = answered(job("proto-2"))
    assert [a["stream"] for a in acks] == ["XPUPOOL_JOBS"] * 2 and acks[1].get("duplicate") is True
    granted = [p for s, p in events if s == f"xpupool.tenant.v1.{TENANT}.events.granted"]
    assert sorted(p["job_id"] for p in granted) == ["proto-1", "proto-2"]
    assert all(p["lease_secret"] and p["env"] and p["slices"] for p in granted)
    # Each lease ended once, released, on the subject its reason names.
    ended = [(s, p) for s, p in events if p["type"] == "xpupool.alloc.ended.v1"]
    assert sorted(p["lease_id"] for _, p in ended) == sorted(p["lease_id"] for p in granted)
    assert all(s.endswith(".ended.released") and p["reason"] == "released" for s, p in ended)
    # The delivery promise (proto/asyncapi.yaml): per lease, the grant before any later event,
    # though proto-1 was renewed and released on the submit reply, before its grant's event.
    for lease_id in (p["lease_id"] for p in granted):
        kinds = [p["type"] for _, p in events if p.get("lease_id") == lease_id]
        assert kinds[0] == "xpupool.alloc.granted.v1" and kinds[-1] == "xpupool.alloc.ended.v1"
    done = next(line["payload"] for line in lines if line["dir"] == "done")
    assert done["renewed"] is True

    # Bad input is answered with what was wrong; a stranger's secret ends nothing.
    (bad,) = answered(job("proto-bad"))
    assert bad["outcome"] == "rejected" and bad["rejected"]["field_name"] == "count", bad
    (garbage,) = answered(lambda sent: sent["payload"] == "this is not JSON")
    assert garbage["outcome"] == "rejected" and garbage["rejected"]["reason"], garbage
    wrong_secret = answered(
        lambda sent: (
            isinstance(sent["payload"], dict) and sent["payload"].get("lease_secret") == "0" * 48
        )
    )
    assert [(r["ok"], r["error"]) for r in wrong_secret] == [(False, "bad_secret")]
    rejected = {p["job_id"] for s, p in events if s.endswith(".events.rejected")}
    assert "proto-bad" in rejected
