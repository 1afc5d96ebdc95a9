"""JSON encoding of payloads: one reused encoder, one cached decoder per accepted type set."""

from __future__ import annotations

import math
import re
from functools import lru_cache
from typing import Any

import msgspec
import msgspec.inspect

_ENCODER = msgspec.json.Encoder()


def encode(event: msgspec.Struct) -> bytes:
    """The JSON bytes of an event, ``type`` tag included."""
    return _ENCODER.encode(event)


def encode_finite(event: msgspec.Struct) -> bytes:
    """``encode``, refusing a number that JSON cannot carry (``ValueError`` naming the field).

    msgspec writes NaN and infinity as ``null``, and a receiver reads ``null`` in an optional
    field as "not given": a renewal for ``inf`` seconds would renew for the lease's own term and
    succeed, a job with ``max_wait_s=nan`` would wait for ever. What a client sends goes
    through this; a service's own events are computed, not typed in."""
    if (found := _non_finite(event)) is not None:
        raise ValueError(f"{'.'.join(reversed(found)).replace('.[', '[')} must be a finite number")
    return _ENCODER.encode(event)


def _non_finite(value: object) -> list[str] | None:
    """Where the first NaN or infinity in ``value`` (a Struct, its nested Structs, lists and
    dicts) lies, innermost step first; None when there is none. Only fields whose type can hold
    a number are visited, and the path is built only for a value found: a job request is checked
    in a few microseconds."""
    if type(value) is float:
        return None if math.isfinite(value) else []
    if value is None or type(value) is int:
        return None
    if isinstance(value, msgspec.Struct):
        for name in _float_fields(type(value)):
            if (found := _non_finite(getattr(value, name))) is not None:
                return [*found, name]
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            if (found := _non_finite(item)) is not None:
                return [*found, f"[{index}]"]
    elif isinstance(value, dict):
        for key, item in value.items():
            if (found := _non_finite(item)) is not None:
                return [*found, f"[{key}]"]
    return None


@lru_cache(maxsize=256)
def _float_fields(struct: type[msgspec.Struct]) -> tuple[str, ...]:
    """The fields of ``struct`` whose type can hold a number, directly or nested."""
    info = msgspec.inspect.type_info(struct)
    assert isinstance(info, msgspec.inspect.StructType)
    return tuple(f.name for f in info.fields if _holds_float(f.type, set()))


def _holds_float(kind: msgspec.inspect.Type, seen: set[type]) -> bool:
    mi = msgspec.inspect
    # An int field too: Python does not stop a float there, and a NaN in ``memory_pct`` (a
    # percentage worked out by division) would be sent as no share at all, a whole device.
    if isinstance(kind, mi.FloatType | mi.IntType | mi.AnyType):
        return True
    if isinstance(kind, mi.Metadata):
        return _holds_float(kind.type, seen)
    if isinstance(kind, mi.UnionType):
        return any(_holds_float(member, seen) for member in kind.types)
    if isinstance(kind, mi.ListType | mi.VarTupleType | mi.SetType | mi.FrozenSetType):
        return _holds_float(kind.item_type, seen)
    if isinstance(kind, mi.TupleType):
        return any(_holds_float(member, seen) for member in kind.item_types)
    if isinstance(kind, mi.DictType):
        return _holds_float(kind.value_type, seen)
    if isinstance(kind, mi.StructType):
        if kind.cls in seen:  # a recursive type: its floats are found where it first appears
            return False
        seen.add(kind.cls)
        return any(_holds_float(f.type, seen) for f in kind.fields)
    return False


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
