"""JSON encoding of payloads: one reused encoder, one cached decoder per accepted type set."""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import msgspec

_ENCODER = msgspec.json.Encoder()


def encode(event: msgspec.Struct) -> bytes:
    """The JSON bytes of an event, ``type`` tag included."""
    return _ENCODER.encode(event)


@lru_cache(maxsize=64)
def decoder_for(types: tuple[type, ...]) -> msgspec.json.Decoder[Any]:
    """A decoder for one payload type or a tagged union of several; cached and reused."""
    target: Any = types[0] if len(types) == 1 else _union(types)
    return msgspec.json.Decoder(target)


def _union(types: tuple[type, ...]) -> Any:
    union: Any = types[0]
    for extra in types[1:]:
        union = union | extra
    return union


def ce_type(payload_type: type) -> str:
    """The CloudEvents type of a payload Struct, which is also its ``type`` tag."""
    tag = payload_type.__struct_config__.tag  # type: ignore[attr-defined]
    if not isinstance(tag, str):
        raise TypeError(f"{payload_type.__name__} has no string tag")
    return tag


def describe_error(error: msgspec.ValidationError | msgspec.DecodeError) -> tuple[str | None, str]:
    """Split msgspec's message into the offending field path (``a.b``) and the reason.

    msgspec ends its messages with `` - at `$.device.memory_mib` ``; upstream users want the
    field name, not the JSON path syntax.
    """
    message = str(error)
    marker = " - at `$"
    if marker not in message:
        return None, message
    reason, _, path = message.partition(marker)
    path = path.rstrip("`").lstrip(".")
    return (path or None), reason
