"""Typed settings from the environment: one frozen Struct per service, ``XPUPOOL_*`` variables."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TypeVar

import msgspec

SettingsT = TypeVar("SettingsT", bound=msgspec.Struct)


def load_settings(
    settings_type: type[SettingsT], environ: Mapping[str, str] | None = None
) -> SettingsT:
    """Build ``settings_type`` from ``XPUPOOL_<FIELD>`` variables; unset fields keep defaults.

    Values are converted from strings by msgspec, so a bad value fails at start-up with the
    variable's name instead of deep inside the service.
    """
    source = os.environ if environ is None else environ
    values = {}
    for name in settings_type.__struct_fields__:
        variable = f"XPUPOOL_{name.upper()}"
        if variable in source:
            values[name] = source[variable]
    try:
        return msgspec.convert(values, settings_type, strict=False)
    except msgspec.ValidationError as error:
        raise SystemExit(f"invalid configuration: {error} (variables XPUPOOL_<FIELD>)") from error
