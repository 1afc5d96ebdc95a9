"""JSON encoding of payloads: one reused encoder, one cached decoder per accepted type set."""

from __future__ import annotations

import re
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


DETAIL_LIMIT = 512
"""The most characters a decode error's detail carries (it is echoed to the sender)."""
FIELD_LIMIT = 128
"""The most characters of a field path (an unknown field's name is the sender's text)."""
VALUE_LIMIT = 64
"""The most characters of a rejected value quoted back (an enum value may be a megabyte)."""

# msgspec appends the JSON path of the offending value: `` - at `$.device.memory_mib` ``. The
# path is built from the schema's own field names, indices and ``[...]`` for mapping keys, so
# it never contains a backtick; anchoring at the end keeps a field name that merely contains
# " - at `$" from being mistaken for it.
_PATH = re.compile(r" - at `\$([^`]*)`\Z")
_FIELD_MESSAGE = re.compile(r"\AObject (contains unknown|missing required) field `(.*)`\Z", re.S)
_VALUE_MESSAGE = re.compile(r"\A(Invalid (?:enum )?value )(.*)\Z", re.S)


def clip(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, saying how long it was when cut."""
    if len(text) <= limit:
        return text
    suffix = f"... ({len(text)} chars)"
    return text[: max(limit - len(suffix), 0)] + suffix


def describe_error(error: BaseException) -> tuple[str | None, str]:
    """Split msgspec's message into the offending field path (``a.b``) and the reason.

    msgspec ends its messages with `` - at `$.device.memory_mib` ``; upstream users want the
    field name, not the JSON path syntax. An unknown or missing field is named in the message
    and belongs to the path (`` Object contains unknown field `compute_percent` - at `$.device` ``
    is field ``device.compute_percent``). Whatever the sender wrote (a field name, an enum value)
    comes back clipped: the field to ``FIELD_LIMIT`` characters, quoted values to
    ``VALUE_LIMIT``, the whole reason to ``DETAIL_LIMIT``.
    """
    message = str(error)
    reason, path = message, ""
    if at := _PATH.search(message):
        reason, path = message[: at.start()], at.group(1).lstrip(".")
    if named := _FIELD_MESSAGE.match(reason):
        name = clip(named.group(2), FIELD_LIMIT)
        path = f"{path}.{name}" if path else name
        reason = f"Object {named.group(1)} field `{name}`"
    elif quoted := _VALUE_MESSAGE.match(reason):
        reason = quoted.group(1) + clip(quoted.group(2), VALUE_LIMIT)
    return (clip(path, FIELD_LIMIT) or None), clip(reason, DETAIL_LIMIT)
