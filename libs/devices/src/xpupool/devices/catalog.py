"""The device catalog: published specs, normalised capacity and prices per accelerator model.

The data lives in ``catalog.toml`` next to this module. An operator replaces or extends it with
``load_catalog(path)`` or the ``XPUPOOL_CATALOG`` environment variable (see the file header).

Normalised capacity (``CatalogEntry.capacity_units``) is dense BF16 TFLOPS (FP16 where the
model has no BF16) divided by the reference figure in ``[catalog]`` (an A100's 312), so quotas
can compare an Ascend 910B with an A100. It is a throughput proxy, not a benchmark.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Iterator, Mapping
from importlib import resources
from pathlib import Path
from typing import Any, Final, Literal

import msgspec
from msgspec import Struct, field

from xpupool.contracts import Vendor

__all__ = [
    "CATALOG_ENV",
    "Catalog",
    "CatalogEntry",
    "CatalogError",
    "Interconnect",
    "load_catalog",
    "normalize_name",
]

CATALOG_ENV: Final = "XPUPOOL_CATALOG"

Interconnect = Literal["nvlink", "nvswitch", "hccs", "mlu-link", "pcie"]
IsolationMechanism = Literal["mig", "mps", "hami-core", "vnpu", "smlu", "mim", "none"]

# Vendor words tools prepend inconsistently ("NVIDIA A100…", "Tesla T4", "Ascend910B1").
_PREFIXES: Final = ("nvidia", "tesla", "huawei", "ascend", "cambricon", "amd", "hygon")
_NON_ALNUM: Final = re.compile(r"[^a-z0-9]+")
_MIG_PROFILE: Final = re.compile(r"^(\d+)g\.(\d+)gb$")
_VNPU_PROFILE: Final = re.compile(r"^vir(\d+)(?:_(\d+)c)?(?:_(\d+)g)?$")
_MIG_SLICES: Final = 7


class CatalogError(ValueError):
    """The catalog file is missing, malformed or inconsistent."""


def normalize_name(name: str) -> str:
    """Canonical lookup key: lower case, vendor prefixes and punctuation dropped.

    ``"NVIDIA A100-SXM4-80GB"`` -> ``"a100sxm480gb"``; ``"Ascend 910B1"`` -> ``"910b1"``.
    """
    key = name.strip().lower()
    stripped = True
    while stripped:
        stripped = False
        for prefix in _PREFIXES:
            if key.startswith(prefix):
                key = key[len(prefix) :].lstrip(" -_")
                stripped = True
    return _NON_ALNUM.sub("", key)


class CatalogEntry(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One accelerator model. Throughput figures are dense (no sparsity); memory is per device
    (per chip for multi-chip cards). ``unverified`` names the fields whose figure is
    second-hand, inferred or conflicting."""

    name: str
    vendor: Vendor
    aliases: list[str] = field(default_factory=list)
    pci_device_ids: list[str] = field(default_factory=list)
    memory_gb: int | None = None
    memory_visible_mib: int | None = None
    bf16_tflops: float | None = None
    fp16_tflops: float | None = None
    bf16: bool = False
    tdp_w: float | None = None
    interconnect: Interconnect = "pcie"
    domain_size: int = 1
    partition_profiles: list[str] = field(default_factory=list)
    isolation: list[IsolationMechanism] = field(default_factory=list)
    capabilities: list[str] = field(default_factory=list)
    ai_cores: int | None = None
    cost_per_hour: float = 0.0
    # Filled by Catalog from the figures unless the file overrides it.
    capacity_units: float = 0.0
    unknown: bool = False
    unverified: list[str] = field(default_factory=list)
    sources: str = ""
    notes: str = ""

    @property
    def memory_nominal_mib(self) -> int | None:
        """Nominal memory in MiB (``memory_gb`` x 1024)."""
        return self.memory_gb * 1024 if self.memory_gb is not None else None

    @property
    def dense_tflops(self) -> float | None:
        """The throughput the capacity is based on: BF16 where supported, else FP16."""
        if self.bf16 and self.bf16_tflops is not None:
            return self.bf16_tflops
        return self.fp16_tflops

    @property
    def verified(self) -> bool:
        """True when every figure of this entry was read in a cited source."""
        return not self.unverified and not self.unknown

    def is_verified(self, figure: str) -> bool:
        """Whether one figure (a field name such as ``"tdp_w"``) was read in a cited source."""
        return not self.unknown and figure not in self.unverified

    def capability_list(self) -> list[str]:
        """Capabilities for ``DeviceSpec.capabilities``: ``bf16`` when supported, then the rest."""
        caps = ["bf16"] if self.bf16 else []
        return caps + [c for c in self.capabilities if c != "bf16"]

    def partition_share(self, profile: str) -> float | None:
        """The compute share of a MIG profile (``3g.20gb`` -> 3/7) or vNPU template
        (``vir05_1c_16g`` -> 5 / ai_cores); ``None`` when it cannot be told."""
        mig = _MIG_PROFILE.match(profile)
        if mig:
            return min(int(mig.group(1)) / _MIG_SLICES, 1.0)
        vnpu = _VNPU_PROFILE.match(profile)
        if vnpu and self.ai_cores:
            return min(int(vnpu.group(1)) / self.ai_cores, 1.0)
        return None

    def profile_for_memory(self, memory_mib: int | None) -> str | None:
        """The MIG profile whose memory is nearest ``memory_mib`` (within 15 %), for tools that
        report a MIG device's memory but not its profile (``nvidia-smi -q -x``)."""
        if not memory_mib:
            return None
        best: tuple[float, str] | None = None
        for profile in self.partition_profiles:
            match = _MIG_PROFILE.match(profile)
            if match is None:
                continue
            error = abs(int(match.group(2)) * 1024 - memory_mib) / memory_mib
            if error <= 0.15 and (best is None or error < best[0]):
                best = (error, profile)
        return best[1] if best else None


class _CatalogHeader(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    schema_version: int = 1
    reference_model: str = ""
    reference_dense_tflops: float = 312.0
    extends: Literal["builtin"] | None = None


class _CatalogFile(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    catalog: _CatalogHeader = field(default_factory=_CatalogHeader)
    model: list[dict[str, Any]] = field(default_factory=list)


class Catalog:
    """An immutable, indexed set of :class:`CatalogEntry`."""

    def __init__(
        self,
        entries: list[CatalogEntry],
        *,
        reference_dense_tflops: float = 312.0,
        reference_model: str = "",
    ) -> None:
        if reference_dense_tflops <= 0:
            raise CatalogError("reference_dense_tflops must be positive")
        self.reference_dense_tflops: Final = reference_dense_tflops
        self.reference_model: Final = reference_model
        resolved: list[CatalogEntry] = []
        by_key: dict[str, CatalogEntry] = {}
        by_pci: dict[tuple[Vendor, str], CatalogEntry] = {}
        for raw in entries:
            entry = self._with_capacity(raw)
            resolved.append(entry)
            for alias in (entry.name, *entry.aliases):
                key = normalize_name(alias)
                other = by_key.get(key)
                if other is not None and other.name != entry.name:
                    raise CatalogError(
                        f"alias {alias!r} of {entry.name} collides with {other.name}"
                    )
                by_key[key] = entry
            for pci in entry.pci_device_ids:
                by_pci.setdefault((entry.vendor, pci.lower()), entry)
        self._entries: Final = tuple(resolved)
        self._by_key: Final = by_key
        self._by_pci: Final = by_pci

    def _with_capacity(self, entry: CatalogEntry) -> CatalogEntry:
        if entry.capacity_units > 0:
            return entry
        tflops = entry.dense_tflops
        if tflops is None:
            raise CatalogError(
                f"{entry.name}: no bf16/fp16 TFLOPS and no capacity_units; give one of them"
            )
        return msgspec.structs.replace(
            entry, capacity_units=round(tflops / self.reference_dense_tflops, 4)
        )

    def __iter__(self) -> Iterator[CatalogEntry]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.lookup(name) is not None

    @property
    def entries(self) -> tuple[CatalogEntry, ...]:
        """All entries in file order."""
        return self._entries

    def lookup(self, name_as_printed: str) -> CatalogEntry | None:
        """The entry whose name or alias matches ``name_as_printed`` after
        :func:`normalize_name`; ``None`` for unknown or anonymised names (``xxx``)."""
        return self._by_key.get(normalize_name(name_as_printed))

    def get(self, name: str) -> CatalogEntry:
        """Like :meth:`lookup` but raises ``KeyError`` for an unknown name."""
        entry = self.lookup(name)
        if entry is None:
            raise KeyError(name)
        return entry

    def lookup_pci(self, vendor: Vendor, device_id: str) -> CatalogEntry | None:
        """The entry for a PCI device id (``0xd801``), for tools that print anonymised names."""
        return self._by_pci.get((vendor, device_id.lower()))

    def capacity(self, name: str) -> float | None:
        """Normalised capacity of a model (A100 = 1.0), or ``None`` if unknown."""
        entry = self.lookup(name)
        return entry.capacity_units if entry is not None else None

    def by_vendor(self, vendor: Vendor) -> list[CatalogEntry]:
        """Entries of one vendor, in file order."""
        return [e for e in self._entries if e.vendor is vendor]


def _read_toml(text: str, origin: str) -> _CatalogFile:
    try:
        return msgspec.convert(tomllib.loads(text), _CatalogFile)
    except (tomllib.TOMLDecodeError, msgspec.ValidationError) as exc:
        raise CatalogError(f"{origin}: {exc}") from exc


def _entries(models: list[dict[str, Any]], origin: str) -> list[CatalogEntry]:
    try:
        return [msgspec.convert(m, CatalogEntry) for m in models]
    except msgspec.ValidationError as exc:
        raise CatalogError(f"{origin}: {exc}") from exc


def _merge(base: list[dict[str, Any]], overrides: list[dict[str, Any]]) -> list[dict[str, Any]]:
    merged = {str(m["name"]): dict(m) for m in base}
    for m in overrides:
        name = str(m.get("name", ""))
        merged[name] = {**merged.get(name, {}), **m}
    return list(merged.values())


def _builtin_text() -> str:
    return resources.files("xpupool.devices").joinpath("catalog.toml").read_text("utf-8")


def load_catalog(path: Path | None = None, *, env: Mapping[str, str] | None = None) -> Catalog:
    """Load the catalog from ``path``, else ``$XPUPOOL_CATALOG``, else the shipped file.

    An operator file with ``[catalog] extends = "builtin"`` is merged over the shipped one by
    model name. Raises :class:`CatalogError` with the file name on any problem.
    """
    environ = os.environ if env is None else env
    if path is None and environ.get(CATALOG_ENV):
        path = Path(environ[CATALOG_ENV])
    builtin = _read_toml(_builtin_text(), "builtin catalog.toml")
    if path is None:
        data, models = builtin, builtin.model
    else:
        try:
            text = path.read_text("utf-8")
        except OSError as exc:
            raise CatalogError(f"cannot read catalog {path}: {exc.strerror}") from exc
        data = _read_toml(text, str(path))
        models = _merge(builtin.model, data.model) if data.catalog.extends else data.model
    origin = str(path) if path else "builtin catalog.toml"
    header = data.catalog
    try:
        return Catalog(
            _entries(models, origin),
            reference_dense_tflops=header.reference_dense_tflops,
            reference_model=header.reference_model or builtin.catalog.reference_model,
        )
    except CatalogError as exc:
        if str(exc).startswith(origin):
            raise
        raise CatalogError(f"{origin}: {exc}") from exc
