"""A client in another language, written from ``proto/`` alone, runs a job's whole life.

``foreign/proto_client.mjs`` is a tenant's client in JavaScript on the NATS wire protocol itself
(no NATS library, no xpupool code): it submits by request/reply and on the stream (twice, the
same job), renews (by request and fire and forget), releases, lists its jobs and leases, gets
a lease, cancels a waiting and a granted job, follows a maximum run time to its end, and sends
what a careless client would (a payload at and over the document's size limit, a reply subject
that is no inbox). The same script, as the operator, follows every subject of the document
meanwhile. This test checks what both saw against ``proto/`` only (the AsyncAPI document's
channels, operations, replies and message headers, and the JSON Schemas with their formats),
never against the Python contracts: every message sent and received is valid where the document
says it goes, and the invariants hold from the outside (one grant per job, one end per lease,
bad input answered with what was wrong). On the secure stack both connect with their NKey seed
over TLS, as a tenant and an operator in production do.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
from collections.abc import Callable
from datetime import datetime
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


# jsonschema checks "date-time" only with an optional package installed, and passes anything
# without it: a strict foreign validator would not.
FORMATS = jsonschema.FormatChecker()
RFC3339 = re.compile(r"\d{4}-\d\d-\d\d[Tt]\d\d:\d\d:\d\d(\.\d+)?([Zz]|[+-]\d\d:\d\d)")


def _is_date_time(value: object) -> bool:
    if not isinstance(value, str) or not RFC3339.fullmatch(value):
        return False
    try:
        datetime.fromisoformat(value.upper().replace("Z", "+00:00"))
    except ValueError:
        return False
    return True


FORMATS.checks("date-time")(_is_date_time)


def test_the_format_checker_checks_timestamps() -> None:
    """A timestamp without a zone, or no timestamp at all, fails the schemas' date-time."""
    assert FORMATS.conforms("2026-12-02T12:00:00.123456Z", "date-time")
    assert FORMATS.conforms("2026-12-02T12:00:00+00:00", "date-time")
    assert not FORMATS.conforms("2026-12-02T12:00:00", "date-time")
    assert not FORMATS.conforms("2026-13-02T12:00:00Z", "date-time")
    assert not FORMATS.conforms("yesterday", "date-time")


def _validate(payload: Any, names: list[str], where: str) -> None:
    """``payload`` is valid against one of the named messages' JSON Schemas."""
    errors = []
    for name in names:
        schema = json.loads((PROTO / "schemas" / f"{name}.json").read_text())
        try:
            jsonschema.validate(payload, schema, format_checker=FORMATS)
        except jsonschema.ValidationError as error:
            errors.append(f"{name}: {error.message}")
        else:
            return
    raise AssertionError(f"{where}: {payload!r} is none of {names}: {errors}")


def _validate_reply(payload: Any, headers: dict[str, str], names: list[str], where: str) -> None:
    """A reply is one of the operation's reply messages: a JSON payload valid against its schema,
    or, for a message the document gives no payload (ServiceError), an empty body whose headers
    are valid against the message's header schema."""
    messages = _document()["components"]["messages"]
    if payload == "":
        bodiless = [n for n in names if "payload" not in messages[n]]
        assert bodiless, f"{where}: an empty reply, and every reply of {names} has a payload"
        for name in bodiless:
            jsonschema.validate(headers, messages[name]["headers"], format_checker=FORMATS)
        return
    _validate(payload, [n for n in names if "payload" in messages[n]], where)


def _check_headers(subject: str, headers: dict[str, str], payload: dict[str, Any]) -> None:
    """The CloudEvents headers every event carries, valid against its message's header schema
    (components.messages.*.headers): ce-type is the payload's type, ce-id its Nats-Msg-Id."""
    _, channel = _channel(subject)
    for name in _messages(channel):
        schema = _document()["components"]["messages"][name]["headers"]
        jsonschema.validate(headers, schema, format_checker=FORMATS)
    assert headers.get("ce-specversion") == "1.0", subject
    assert headers.get("ce-type") == payload["type"], subject
    assert headers.get("ce-id") and headers.get("ce-source"), subject
    assert headers["ce-id"] == headers.get("Nats-Msg-Id"), subject
    assert FORMATS.conforms(headers.get("ce-time"), "date-time"), subject


async def _start(env: dict[str, str], *args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        shutil.which("node") or "node",
        str(CLIENT),
        *args,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        limit=1 << 20,  # a line carries a payload of up to the size limit, and more
    )


async def _run_client(env: dict[str, str]) -> list[dict[str, Any]]:
    limit = _document()["x-xpupool-max-request-bytes"]
    process = await _start(env, TENANT, str(limit))
    try:
        out, err = await asyncio.wait_for(process.communicate(), 90)
    finally:
        if process.returncode is None:
            process.kill()
    assert process.returncode == 0, err.decode()
    return [json.loads(line) for line in out.decode().splitlines()]


async def _observer(env: dict[str, str]) -> asyncio.subprocess.Process:
    """The operator's follower of every subject, once it is subscribed."""
    process = await _start(env, "--observe")
    assert process.stdout is not None
    line = await asyncio.wait_for(process.stdout.readline(), 30)
    assert json.loads(line)["dir"] == "ready", line
    return process


async def _observed(process: asyncio.subprocess.Process) -> list[dict[str, Any]]:
    process.terminate()
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, err.decode()
    return [json.loads(line) for line in out.decode().splitlines()]


HOSTILE = ("proto-bad", "proto-edge", "proto-huge")


def _sends(channel_key: str) -> bool:
    """Whether upstream sends on the channel (its operation's action is send)."""
    return any(
        o["channel"]["$ref"].endswith("/" + channel_key) and o["action"] == "send"
        for o in _document()["operations"].values()
    )


async def test_a_javascript_client_from_proto_alone_runs_a_jobs_life(
    make_stack: Callable[..., Stack], ready: Ready, stack_security: str
) -> None:
    stack = make_stack([NodeSpec("node-p", "2xA100-80GB")], tenants=[TENANT])
    await ready(stack, 2)
    async with stack.client(TENANT) as client:
        await client.jobs()  # the scheduler serves: submissions before queries
    # Only what a tenant is given: the server's URL and, when secured, its NKey seed and the CA.
    env: dict[str, str] = {}
    operator: dict[str, str] = {}
    if stack.material is not None:
        env.update(stack.tenant_env(TENANT))
        operator.update(stack.operator_env())
    else:
        env["XPUPOOL_NATS_URL"] = operator["XPUPOOL_NATS_URL"] = stack.nats_url or ""
    observer = await _observer(operator)
    try:
        lines = await _run_client(env)
    finally:
        observed = await _observed(observer)

    sent = {line["reply"]: line for line in lines if line["dir"] == "sent"}
    replies: dict[str, dict[str, Any]] = {}
    events: list[tuple[str, dict[str, Any]]] = []
    event_ids: set[str] = set()
    for line in lines:
        subject, payload, headers = line["subject"], line["payload"], line["headers"]
        if line["dir"] == "sent":
            _, channel = _channel(subject)
            if isinstance(payload, dict) and payload.get("job_id") not in HOSTILE:
                _validate(payload, _messages(channel), f"sent on {subject}")
        elif line["dir"] == "event":
            _, channel = _channel(subject)
            _validate(payload, _messages(channel), f"event on {subject}")
            _check_headers(subject, headers, payload)
            if headers["ce-id"] not in event_ids:  # a copy after a fault (info.description)
                event_ids.add(headers["ce-id"])
                events.append((subject, payload))
        elif line["dir"] == "reply":
            request = sent[subject]
            key, _ = _channel(request["subject"])
            # A channel without a reply operation is a JetStream one: the server's own PubAck.
            if names := _replies(key):
                _validate_reply(payload, headers, names, subject)
            replies[subject] = {"to": request, "payload": payload}

    def answered(predicate: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        return [r["payload"] for r in replies.values() if predicate(r["to"])]

    def job(job_id: str) -> Callable[[dict[str, Any]], bool]:
        return lambda sent: (
            isinstance(sent["payload"], dict) and sent["payload"].get("job_id") == job_id
        )

    # The request/reply submission is answered with its grant; the stream's duplicate is one job.
    # Once the job ended, the same request again is answered known (no second outcome), and
    # another request under its id is refused.
    first, retried, reused = answered(job("proto-1"))
    assert first["outcome"] == "granted" and first["granted"]["lease_secret"]
    assert (retried["outcome"], retried["state"]) == ("known", "ended"), retried
    assert retried["granted"] is None and retried["rejected"] is None, retried
    assert reused["rejected"]["reason"] == "duplicate_job", reused
    proto_1_outcomes = [
        p["type"]
        for s, p in events
        if p.get("job_id") == "proto-1"
        and p["type"].startswith(("xpupool.alloc.granted", "xpupool.job."))
    ]
    assert proto_1_outcomes == ["xpupool.alloc.granted.v1", "xpupool.job.rejected.v1"]
    acks = answered(job("proto-2"))
    assert [a["stream"] for a in acks] == ["XPUPOOL_JOBS"] * 2 and acks[1].get("duplicate") is True
    granted = [p for s, p in events if s == f"xpupool.tenant.v1.{TENANT}.events.granted"]
    assert sorted(p["job_id"] for p in granted) == [
        "proto-1",
        "proto-2",
        "proto-hold",
        "proto-short",
    ]
    assert all(p["lease_secret"] and p["env"] and p["slices"] for p in granted)
    # Each lease ended once, released (proto-short: at its maximum run time), on the subject its
    # reason names.
    ended = [(s, p) for s, p in events if p["type"] == "xpupool.alloc.ended.v1"]
    assert sorted(p["lease_id"] for _, p in ended) == sorted(p["lease_id"] for p in granted)
    assert all(s.endswith(f".ended.{p['reason']}") for s, p in ended)
    jobs_of = {p["lease_id"]: p["job_id"] for p in granted}
    assert {jobs_of[p["lease_id"]]: p["reason"] for _, p in ended} == {
        "proto-1": "released",
        "proto-2": "released",
        "proto-hold": "released",
        "proto-short": "max_runtime",
    }
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

    def answers(operation: str, job_id: str | None = None) -> list[dict[str, Any]]:
        """The replies to requests on ``{space}.<operation>`` (of one job, if given)."""
        return answered(
            lambda sent: (
                sent["subject"] == f"xpupool.tenant.v1.{TENANT}.{operation}"
                and (job_id is None or job(job_id)(sent))
            )
        )

    # The size the document gives: a payload of that many bytes is read, one byte more is not.
    (edge,) = answers("jobs.submit", "proto-edge")
    assert edge["rejected"]["reason"] == "invalid_request", edge
    assert edge["rejected"]["field_name"] == "count", edge
    huge = [r for r in answers("jobs.submit") if r["job_id"] == "proto-huge"]
    assert [r["rejected"]["reason"] for r in huge] == ["payload_too_large"], huge
    assert ("proto-huge", "payload_too_large") in {
        (p["job_id"], p["reason"]) for s, p in events if s.endswith(".events.rejected")
    }
    # A request whose reply subject is no inbox is not answered there (nor anywhere).
    assert not [p for _, p in events if p["type"] == "xpupool.job.list_reply.v1"]
    stray = f"xpupool.tenant.v1.{TENANT}.events.rejected"
    assert sent[stray]["subject"].endswith(".jobs.list") and stray not in replies

    # Queries: jobs with their state, a lease by id (ended: why and when), none without a secret.
    listed = answers("jobs.list")
    assert all(r["ok"] for r in listed), listed
    states = {j["job_id"]: j["state"] for j in listed[0]["jobs"]}
    assert states["proto-1"] == states["proto-2"] == "ended", states
    pending = [p for s, p in events if s.endswith(".events.pending")]
    assert {p["job_id"] for p in pending} == {"proto-wait"}, pending
    assert pending[0]["reason"] == "insufficient_capacity", pending
    waiting = {j["job_id"]: j for j in listed[1]["jobs"]}["proto-wait"]
    assert (waiting["state"], waiting["reason"]) == ("pending", "insufficient_capacity"), waiting
    final = {j["job_id"]: j["state"] for j in listed[-1]["jobs"]}
    assert final["proto-wait"] == "cancelled" and final["proto-short"] == "ended", final
    got = answers("leases.get")
    assert not any("lease_secret" in lease for r in got for lease in r["leases"])
    (lease1,) = [r for r in got if r["leases"] and r["leases"][0]["job_id"] == "proto-1"]
    assert (lease1["leases"][0]["state"], lease1["leases"][0]["end_reason"]) == (
        "ended",
        "released",
    )
    assert [(r["ok"], r["error"]) for r in got if not r["ok"]] == [(False, "unknown_lease")]
    hold = next(p for s, p in events if s.endswith(".granted") and p["job_id"] == "proto-hold")
    held = [r["leases"][0] for r in got if r["leases"] and r["leases"][0]["job_id"] == "proto-hold"]
    assert [(h["state"], h["end_reason"]) for h in held] == [
        ("active", None),
        ("ended", "released"),
    ]
    (live,) = answers("leases.list")
    assert [lease["lease_id"] for lease in live["leases"]] == [hold["lease_id"]], live

    # A renewal with a token that is not the lease's is refused; one fired and forgotten renews.
    assert [(r["ok"], r["error"]) for r in answers("leases.renew") if not r["ok"]] == [
        (False, "stale_token")
    ]
    assert hold["lease_id"] in {p["lease_id"] for s, p in events if s.endswith(".renewed")}

    # Cancel: a waiting job ends cancelled (once), a held one's lease ends released.
    cancels = {(r["job_id"], r["ok"], r["outcome"], r["error"]) for r in answers("jobs.cancel")}
    assert cancels == {
        ("proto-wait", True, "cancelled", None),
        ("proto-wait", False, None, "job_ended"),
        ("proto-nobody", False, None, "unknown_job"),
        ("proto-hold", True, "releasing", None),
    }, cancels
    assert [p["job_id"] for s, p in events if s.endswith(".events.cancelled")] == ["proto-wait"]

    # A maximum run time: the warning, then the end on the subject its reason names.
    short = next(p for s, p in events if s.endswith(".granted") and p["job_id"] == "proto-short")
    (warning,) = [p for s, p in events if s.endswith(".events.ending")]
    assert (warning["lease_id"], warning["reason"]) == (short["lease_id"], "max_runtime")
    (end,) = [s for s, p in events if p.get("lease_id") == short["lease_id"] and "ended" in s]
    assert end.endswith(".ended.max_runtime"), end

    # The operator follows every subject of the document: each message is where it says and
    # valid against it; its grants carry no secret, and it sees each of the tenant's leases.
    operator_grants = set()
    for line in observed:
        if line["dir"] != "observed":
            continue
        subject, payload, headers = line["subject"], line["payload"], line["headers"]
        key, channel = _channel(subject)
        if _sends(key):
            continue  # a client's command (the tenant's own are checked above)
        _validate(payload, _messages(channel), f"observed on {subject}")
        _check_headers(subject, headers, payload)
        if subject == "xpupool.alloc.v1.granted":
            assert payload["lease_secret"] is None, payload
            operator_grants.add(payload["lease_id"])
    tenant_grants = {p["lease_id"] for s, p in events if s.endswith(".events.granted")}
    assert tenant_grants <= operator_grants, (tenant_grants, operator_grants)
    seen = {_channel(line["subject"])[0] for line in observed if line["dir"] == "observed"}
    assert {
        "xpupool_alloc_v1_ending",
        "xpupool_sched_v1_end_lease",
        "xpupool_telemetry_v1_node_id",
        "xpupool_tenant_v1_tenant_events_ending",
    } <= seen, seen
