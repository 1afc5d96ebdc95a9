"""Slices say whether their limits are enforced, and records from before the field stay honest."""

from __future__ import annotations

import msgspec

from xpupool.contracts import DeviceSlice, DeviceSpec
from xpupool.ledger import SliceMeta, TakenSlice

OLD_SHARE = (
    b'{"device_id":"n/amd0","node_id":"n","vendor":"amd","model":"RX7800XT","index":0,'
    b'"uuid":"u","memory_mib":4096,"compute_pct":25,"whole":false}'
)


def test_a_slice_from_before_the_field_is_not_claimed_enforced() -> None:
    """An old payload decodes; nobody said its share was enforced, so it is not."""
    old = msgspec.json.decode(OLD_SHARE, type=DeviceSlice)
    assert old.enforced is False


def test_an_old_spec_has_no_partition() -> None:
    """A DeviceSpec without the partition field decodes as a whole device."""
    spec = msgspec.json.decode(
        b'{"device_id":"n/nvidia0","vendor":"nvidia","model":"T4","index":0,"uuid":"GPU-1",'
        b'"memory_mib":15360}',
        type=DeviceSpec,
    )
    assert spec.partition is None and spec.parent_uuid is None


def test_ledger_slices_carry_the_schedulers_word_and_whole_is_enforced() -> None:
    """The ledger keeps enforced in the slice's meta; a whole slice is enforced even from a
    record written before the field, a share only when the scheduler said so."""
    old_meta = msgspec.json.decode(b'{"vendor":"nvidia","model":"T4","index":0,"uuid":"G"}',
                                   type=SliceMeta)  # fmt: skip
    whole = TakenSlice("n/nvidia0", "n", True, 15360, 100, old_meta).to_contract()
    share = TakenSlice("n/nvidia0", "n", False, 4096, 25, old_meta).to_contract()
    told = TakenSlice(
        "n/nvidia0", "n", False, 4096, 25, SliceMeta("nvidia", "T4", 0, "G", enforced=True)
    ).to_contract()
    assert (whole.enforced, share.enforced, told.enforced) == (True, False, True)
