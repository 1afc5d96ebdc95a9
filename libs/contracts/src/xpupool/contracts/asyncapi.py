"""Generate ``proto/``: one JSON Schema per payload and an AsyncAPI 3.0 document, from the Structs
and the subject registry. Never edit the output by hand: ``just proto`` rewrites it and a test
fails when the committed files drift from the code."""

from __future__ import annotations

import ast
import inspect
import json
from enum import Enum
from functools import cache
from pathlib import Path
from typing import Any

import msgspec
import yaml

from xpupool.contracts import access
from xpupool.contracts import payloads as p
from xpupool.contracts.codec import ce_type
from xpupool.contracts.payloads import UsageRecord
from xpupool.contracts.subjects import (
    CHANNELS,
    DELIVERY,
    MAX_REQUEST_BYTES,
    REQUESTS,
    SERVICE_ERROR_HEADERS,
    STREAMS,
    TENANT_SPACE,
    Channel,
)

REF = "#/components/schemas/{name}"
HEADERS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "CloudEvents binary mode over NATS headers, plus W3C trace context.",
    "properties": {
        "ce-specversion": {"type": "string", "const": "1.0"},
        "ce-id": {"type": "string", "description": "Unique per event; also Nats-Msg-Id."},
        "ce-source": {"type": "string", "description": "URI reference of the sender."},
        "ce-type": {"type": "string", "description": "Equals the payload's `type` tag."},
        "ce-time": {"type": "string", "format": "date-time"},
        "Nats-Msg-Id": {
            "type": "string",
            "description": (
                "JetStream deduplication id (events); for job requests, the job_id (the ledger, "
                "not the stream, deduplicates job requests)."
            ),
        },
        "traceparent": {"type": "string", "description": "W3C trace context."},
        "tracestate": {"type": "string"},
    },
}


SERVICE_ERROR: dict[str, Any] = {
    "name": "ServiceError",
    "title": "service error",
    "summary": "A reply with no body: the service could not answer with the reply message.",
    "description": (
        "Sent instead of the operation's reply when the service failed to handle the request, "
        "or its reply would exceed the server's max_payload. The body is empty (no JSON)."
    ),
    "headers": {
        "type": "object",
        "required": list(SERVICE_ERROR_HEADERS),
        "properties": {
            SERVICE_ERROR_HEADERS[0]: {"type": "string", "description": "What went wrong."},
            SERVICE_ERROR_HEADERS[1]: {
                "type": "string",
                "description": "An HTTP-like status code: 500.",
            },
        },
    },
}
REPLY_ADDRESS: dict[str, Any] = {
    "location": "$message.header#/_reply",
    "description": (
        "The request's NATS reply subject (the reply-to of PUB or HPUB, not a header), under "
        "_INBOX. (on the secure server _INBOX.t.<tenant>.); any other is not answered."
    ),
}


# Public formats that travel outside NATS: ``xpupool usage --records`` writes UsageRecords.
FILE_FORMATS: tuple[type, ...] = (UsageRecord,)


def _payload_types() -> list[type]:
    seen: dict[str, type] = {}
    for channel in CHANNELS:
        for t in (*channel.payloads, *((channel.reply,) if channel.reply else ())):
            seen.setdefault(t.__name__, t)
    for t in FILE_FORMATS:
        seen.setdefault(t.__name__, t)
    return list(seen.values())


def _strip_discriminators(node: Any) -> Any:
    """AsyncAPI's discriminator is a bare property name; msgspec emits OpenAPI's object form."""
    if isinstance(node, dict):
        return {
            k: _strip_discriminators(v)
            for k, v in node.items()
            if not (k == "discriminator" and isinstance(v, dict))
        }
    if isinstance(node, list):
        return [_strip_discriminators(v) for v in node]
    return node


@cache
def _attribute_docs() -> dict[str, dict[str, str]]:
    """The docstrings written under fields and enum members in ``payloads`` (``{class: {name:
    text}}``): msgspec reads only class docstrings, and a foreign client has nothing else."""
    docs: dict[str, dict[str, str]] = {}
    for node in ast.parse(inspect.getsource(p)).body:
        if not isinstance(node, ast.ClassDef):
            continue
        body = node.body
        for statement, following in zip(body, body[1:], strict=False):
            target: ast.expr | None = None
            if isinstance(statement, ast.AnnAssign):
                target = statement.target
            elif isinstance(statement, ast.Assign) and len(statement.targets) == 1:
                target = statement.targets[0]
            if (
                isinstance(target, ast.Name)
                and isinstance(following, ast.Expr)
                and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)
            ):
                text = inspect.cleandoc(following.value.value)
                docs.setdefault(node.name, {})[target.id] = " ".join(text.split())
    return docs


def _describe_members(name: str, schema: dict[str, Any]) -> None:
    """Add what each documented field or enum member means to ``name``'s schema."""
    docs = _attribute_docs().get(name)
    kind = getattr(p, name, None)
    if not docs or kind is None:
        return
    if isinstance(kind, type) and issubclass(kind, Enum):
        meanings = [f"`{getattr(kind, m).value}`: {text}" for m, text in docs.items()]
        schema["description"] = "\n".join([schema.get("description", ""), "", *meanings]).strip()
        return
    for field_name, text in docs.items():
        prop = schema.get("properties", {}).get(field_name)
        if prop is not None:
            prop["description"] = " ".join(filter(None, [text, prop.get("description")]))


def schemas() -> dict[str, Any]:
    """Every component schema, keyed by Struct name."""
    _, components = msgspec.json.schema_components(_payload_types(), ref_template=REF)
    components = _strip_discriminators(components)
    for name, schema in components.items():
        _describe_members(name, schema)
    return components  # type: ignore[no-any-return]


def _channel_id(channel: Channel) -> str:
    return channel.address.replace(".", "_").replace("{", "").replace("}", "")


def asyncapi() -> dict[str, Any]:
    """The AsyncAPI 3.0 document of every channel."""
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    for channel in CHANNELS:
        cid = _channel_id(channel)
        channel_messages = {}
        for t in channel.payloads:
            messages[t.__name__] = {
                "name": t.__name__,
                "title": ce_type(t),
                "summary": (t.__doc__ or "").strip().split("\n")[0],
                "contentType": "application/json",
                "headers": HEADERS_SCHEMA,
                "payload": {"$ref": REF.format(name=t.__name__)},
            }
            channel_messages[t.__name__] = {"$ref": f"#/components/messages/{t.__name__}"}
        entry: dict[str, Any] = {
            "address": channel.address,
            "description": channel.description,
            "messages": channel_messages,
        }
        if channel.parameters:
            entry["parameters"] = {k: {"description": v} for k, v in channel.parameters.items()}
        if channel.stream is not None:
            entry["x-jetstream-stream"] = channel.stream.name
        if channel.tenant_scoped:
            entry["x-tenant-scoped"] = True
        channels[cid] = entry
        operation: dict[str, Any] = {
            "action": "receive" if channel.sender != "upstream" else "send",
            "channel": {"$ref": f"#/channels/{cid}"},
            "summary": f"{channel.sender} -> {', '.join(channel.receivers)}",
        }
        if channel.reply is not None:
            reply = channel.reply.__name__
            messages[reply] = {
                "name": reply,
                "contentType": "application/json",
                "payload": {"$ref": REF.format(name=reply)},
            }
            messages["ServiceError"] = SERVICE_ERROR
            operation["description"] = (
                f"Request/reply: answered with a {reply}, or with a ServiceError (an empty body "
                "and error headers); see info.description for the reply subject and size rules."
            )
            operation["reply"] = {
                "address": REPLY_ADDRESS,
                "messages": [
                    {"$ref": f"#/components/messages/{reply}"},
                    {"$ref": "#/components/messages/ServiceError"},
                ],
            }
        operations[f"{operation['action']}_{cid}"] = operation
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "xpupool",
            "version": "1.0.0",
            "description": (
                "Events and commands of the xpupool accelerator pool. Payloads are JSON; every "
                "event carries CloudEvents binary-mode headers. JetStream streams: "
                + "; ".join(f"{s.name} ({', '.join(s.subjects)})" for s in STREAMS)
                + ". "
                + DELIVERY
                + " "
                + REQUESTS
            ),
        },
        "defaultContentType": "application/json",
        "servers": {
            "secure": {
                "host": "nats.example.internal:4222",
                "protocol": "nats",
                "description": (
                    "Production: TLS with the operator's CA (plaintext refused) and one NKey "
                    "user per tenant and per service. A tenant connects with its seed file, the "
                    f"inbox prefix `{access.tenant_inbox('<tenant>')}`, and may use only "
                    f"`{TENANT_SPACE}.<tenant>.…` (see x-xpupool-permissions)."
                ),
                "security": [
                    {"$ref": "#/components/securitySchemes/nkey"},
                    {"$ref": "#/components/securitySchemes/tls"},
                ],
            },
            "local": {
                "host": "127.0.0.1:4222",
                "protocol": "nats",
                "description": "INSECURE development stack (`just demo`): no authentication.",
            },
        },
        "channels": channels,
        "operations": operations,
        "components": {
            "messages": messages,
            "schemas": schemas(),
            "securitySchemes": {
                "nkey": {
                    "type": "asymmetricEncryption",
                    "description": (
                        "NATS NKeys: the client signs the server's nonce with its Ed25519 seed "
                        "(nats-py `nkeys_seed=`, Go `nats.NkeyOptionFromSeed`); the server only "
                        "knows the public key. A NATS JWT `.creds` file is accepted where the "
                        "operator runs decentralized auth."
                    ),
                },
                "tls": {
                    "type": "X509",
                    "description": (
                        "TLS verified against the operator's CA; client certificates optional."
                    ),
                },
            },
        },
        "x-xpupool-permissions": _permissions(),
        "x-xpupool-max-request-bytes": MAX_REQUEST_BYTES,
    }


def _permissions() -> dict[str, Any]:
    """The NATS permissions of every identity, as the secure configuration grants them."""
    out: dict[str, Any] = {}
    for role in access.SERVICE_ROLES:
        perms = access.service_permissions(role)
        out[role] = {"publish": list(perms.publish), "subscribe": list(perms.subscribe)}
        if perms.publish_deny:
            out[role]["publish_deny"] = list(perms.publish_deny)
    tenant = access.tenant_permissions("TENANT")
    out["tenant <TENANT>"] = {"publish": list(tenant.publish), "subscribe": list(tenant.subscribe)}
    return out


def render() -> dict[str, str]:
    """Every generated file, relative to ``proto/``, with its text."""
    files = {"asyncapi.yaml": yaml.safe_dump(asyncapi(), sort_keys=False, width=100)}
    all_schemas = schemas()
    for name in sorted(all_schemas):
        standalone = {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": f"https://xpupool.dev/schemas/{name}.json",
            **all_schemas[name],
            "$defs": {k: v for k, v in all_schemas.items() if k != name},
        }
        text = json.dumps(standalone, indent=2, sort_keys=True).replace(
            "#/components/schemas/", "#/$defs/"
        )
        files[f"schemas/{name}.json"] = text + "\n"
    return files


def write(directory: Path) -> list[Path]:
    """Write (and prune) the generated files under ``directory``."""
    files = render()
    schema_dir = directory / "schemas"
    schema_dir.mkdir(parents=True, exist_ok=True)
    for stale in schema_dir.glob("*.json"):
        if f"schemas/{stale.name}" not in files:
            stale.unlink()
    written = []
    for relative, text in files.items():
        path = directory / relative
        path.write_text(text)
        written.append(path)
    return written


if __name__ == "__main__":
    import sys

    target = Path(sys.argv[1] if len(sys.argv) > 1 else "proto")
    for path in write(target):
        print(path)
