"""What a sender writes comes back bounded: decode errors, sizes, status-looking messages."""

from __future__ import annotations

import enum

import msgspec
import pytest
from nats.aio.msg import Msg

from xpupool.bus.consumer import is_stream_message
from xpupool.bus.publisher import encoded_size
from xpupool.contracts.codec import DETAIL_LIMIT, FIELD_LIMIT, describe_error


class Vendor(enum.Enum):
    """An enum, whose invalid values msgspec quotes back."""

    NVIDIA = "nvidia"


class Device(msgspec.Struct, forbid_unknown_fields=True):
    """A nested struct that refuses unknown fields."""

    memory_mib: int = 0


class Request(msgspec.Struct, forbid_unknown_fields=True):
    """A request with a nested struct, a list of them and an enum."""

    device: Device | None = None
    devices: list[Device] = []
    vendor: Vendor = Vendor.NVIDIA


def _error(raw: bytes) -> tuple[str | None, str]:
    with pytest.raises((msgspec.ValidationError, msgspec.DecodeError)) as caught:
        msgspec.json.decode(raw, type=Request)
    return describe_error(caught.value)


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (b'{"device":{"compute_percent":30}}', "device.compute_percent"),
        (b'{"devices":[{},{"x":1}]}', "devices[1].x"),
        (b'{"typo":1}', "typo"),
        (b'{"device":{"memory_mib":"a"}}', "device.memory_mib"),
        (b"[1]", None),
    ],
)
def test_the_field_to_blame_is_named_as_a_path(raw: bytes, field: str | None) -> None:
    """Unknown fields belong to the path of the object that holds them."""
    assert _error(raw)[0] == field


def test_a_huge_enum_value_is_not_quoted_back() -> None:
    """An invalid enum value of a megabyte comes back clipped, the whole detail bounded."""
    field, detail = _error(b'{"vendor":"' + b"v" * 1_000_000 + b'"}')
    assert field == "vendor" and len(detail) <= 200 and "(1000002 chars)" in detail


def test_a_huge_unknown_field_name_is_clipped() -> None:
    """An unknown field whose name is huge, and pretends to carry a path, stays bounded."""
    field, detail = _error(b'{"' + b"k" * 100_000 + b' - at `$.vendor`":1}')
    assert field is not None and len(field) <= FIELD_LIMIT and field.startswith("kkk")
    assert len(detail) <= DETAIL_LIMIT


def test_encoded_size_counts_the_header_block_as_nats_py_writes_it() -> None:
    """Payload plus "NATS/1.0\\r\\n", one "key: value\\r\\n" per header and the closing "\\r\\n"."""
    assert encoded_size(b"abc", None) == 3
    assert encoded_size(b"abc", {"k": "v", "kk": " vv "}) == 3 + 12 + len("k: v\r\nkk: vv\r\n")
    # In bytes as sent (UTF-8), not characters, where a header is not ASCII.
    non_ascii = {"ké": "välue €"}
    assert encoded_size(b"", non_ascii) == 12 + len("ké: välue €\r\n".encode())


def test_only_messages_with_an_ack_subject_are_stream_messages() -> None:
    """A status line in the headers does not matter; the ack reply subject does."""
    stored = Msg(None, subject="s", reply="$JS.ACK.S.c.1.2.3.4.0", headers={"Status": "503"})  # type: ignore[arg-type]
    status = Msg(None, subject="_INBOX.x", reply="", headers={"Status": "404"})  # type: ignore[arg-type]
    assert is_stream_message(stored) and not is_stream_message(status)
