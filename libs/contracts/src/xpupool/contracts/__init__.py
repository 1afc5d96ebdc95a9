"""xpupool's public contracts: payload Structs, the subject registry, codecs and schema output."""

from xpupool.contracts.codec import ce_type, decoder_for, describe_error, encode, encode_finite
from xpupool.contracts.payloads import *  # noqa: F403  (the payload module is the public API)
from xpupool.contracts.payloads import __all__ as _payload_names

__all__ = ["ce_type", "decoder_for", "describe_error", "encode", "encode_finite", *_payload_names]
