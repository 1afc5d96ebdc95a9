"""Node pools: the file the operator edits and the autoscaler reloads.

YAML (``.yaml``/``.yml``) or TOML (``.toml``), one entry per pool::

    pools:
      - name: a100                  # letters, digits, - and _ (a subject token)
        node:                       # the shape of every node of the pool
          model: A100-SXM4-80GB     # a device catalog name or alias (canonicalised)
          count: 8                  # devices per node
          cpu_milli: 96000          # host CPU of a node (millicores)
          memory_mib: 1048576       # host memory of a node
          interconnect: nvswitch    # optional: the catalog's for the model
          labels: {zone: eu-1}      # optional: node labels
        cost_per_hour: 14.4         # optional: count x the catalog's price per device-hour
        min_size: 0
        max_size: 4
        provisioning_delay_s: 300   # how long a new node takes to be ready (forecast horizon)
        scale_down: {cooldown_s: 600, low_watermark: 0.7}
        drain: {policy: wait}       # or {policy: preempt, grace_s: 120}
        predictive: false           # or true, or {enabled: true, lookback_s: 604800, ...}
        provider:                   # who adds and removes the nodes; `type` picks one
          type: exec                # exec | kubernetes | simulated
          command: [/opt/bin/scale-pool, --cloud, eu-1]
          timeout_s: 120

Provider options: ``exec`` takes ``command`` (argv, required), ``timeout_s``, ``env`` (added to
the command's environment) and ``options`` (passed to the command verbatim);
``kubernetes`` takes ``machine_deployment`` (required), ``namespace``, and either ``host`` with
``token`` or ``token_file`` (and ``ca_file`` / ``verify_ssl``), or ``kubeconfig`` / ``context``,
else the in-cluster service account; ``simulated`` takes ``state_dir``, ``node_prefix`` and
``collector_env``. See :mod:`xpupool.autoscaler.providers`.

Validation is strict: an unknown key, a value of the wrong type or out of range, an unknown
device model, ``min_size`` above ``max_size``, a duplicate name: each is a
:class:`PoolConfigError` whose message names the file, the key (``pools[1].node.model``) and
the pool. A configuration is immutable; :class:`PoolSource` re-reads the file when it changes
and keeps the last good configuration when the new one is bad, reporting why.
"""

from __future__ import annotations

import difflib
import math
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Final, Literal, NoReturn

import msgspec
import yaml
from msgspec import Meta, Struct, field

from xpupool.contracts import DrainPolicy, describe_error
from xpupool.devices.catalog import Catalog, CatalogError, load_catalog

__all__ = [
    "DrainConfig",
    "ExecProviderConfig",
    "KubernetesProviderConfig",
    "NodeShape",
    "PoolConfig",
    "PoolConfigError",
    "PoolSource",
    "PoolsConfig",
    "PredictiveConfig",
    "ProviderConfig",
    "ReloadOutcome",
    "ScaleDownConfig",
    "SimulatedProviderConfig",
    "load_pools",
    "parse_pools",
]

POOL_NAME_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$"
PoolName = Annotated[str, Meta(pattern=POOL_NAME_PATTERN)]
NonNegative = Annotated[float, Meta(ge=0)]
Positive = Annotated[float, Meta(gt=0)]
Interconnect = Literal["nvlink", "nvswitch", "hccs", "mlu-link", "pcie"]
Text = Annotated[str, Meta(min_length=1)]


class PoolConfigError(ValueError):
    """The pool file is malformed; the message names the file, the key and the pool."""


class NodeShape(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What one node of the pool has. After loading, ``model`` is the catalog's canonical name
    and ``interconnect`` is set."""

    model: Text
    count: Annotated[int, Meta(ge=1, le=1024)]
    cpu_milli: Annotated[int, Meta(ge=0)] = 0
    memory_mib: Annotated[int, Meta(ge=0)] = 0
    interconnect: Interconnect | None = None
    labels: dict[str, str] = field(default_factory=dict)

    @property
    def profile(self) -> str:
        """The simulated backend's node profile (``8xA100-SXM4-80GB``)."""
        return f"{self.count}x{self.model}"


class ScaleDownConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """When idle nodes are drained (see :mod:`xpupool.autoscaler.scale_down`).

    A node is drained only once it has been idle ``cooldown_s`` **and** the pool's peak of busy
    nodes over that window stays at most ``low_watermark`` of the nodes that would remain."""

    cooldown_s: NonNegative = 600.0
    low_watermark: Annotated[float, Meta(gt=0, le=1)] = 0.7


class DrainConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How a draining node is emptied: ``wait`` for its leases to end, or ``preempt`` them with
    the lease-manager's grace period ``grace_s``."""

    policy: DrainPolicy = DrainPolicy.WAIT
    grace_s: NonNegative = 0.0


class PredictiveConfig(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Predictive scale-up (off by default): provision for the demand forecast at the
    provisioning horizon (see :mod:`xpupool.autoscaler.forecast`)."""

    enabled: bool = False
    lookback_s: Positive = 7 * 24 * 3600.0
    season_s: Positive = 24 * 3600.0
    headroom: Annotated[float, Meta(ge=1)] = 1.0


class ExecProviderConfig(
    Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, tag_field="type", tag="exec"
):
    """Run the operator's command for every change (JSON in, JSON out)."""

    command: Annotated[list[Text], Meta(min_length=1)]
    timeout_s: Positive = 120.0
    env: dict[str, str] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)


class KubernetesProviderConfig(
    Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    tag_field="type",
    tag="kubernetes",
):
    """Scale a Cluster API MachineDeployment's ``spec.replicas``."""

    machine_deployment: Text
    namespace: Text = "default"
    host: str = ""
    token: str = ""
    token_file: str = ""
    ca_file: str = ""
    verify_ssl: bool = True
    kubeconfig: str = ""
    context: str = ""
    timeout_s: Positive = 30.0


class SimulatedProviderConfig(
    Struct,
    frozen=True,
    kw_only=True,
    forbid_unknown_fields=True,
    tag_field="type",
    tag="simulated",
):
    """Start and stop telemetry-collector processes with the simulated backend."""

    state_dir: str = ""
    node_prefix: str = ""
    collector_env: dict[str, str] = field(default_factory=dict)


ProviderConfig = ExecProviderConfig | KubernetesProviderConfig | SimulatedProviderConfig


class _PoolEntry(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    name: PoolName
    node: NodeShape
    cost_per_hour: NonNegative | None = None
    min_size: Annotated[int, Meta(ge=0)] = 0
    max_size: Annotated[int, Meta(ge=1)]
    provisioning_delay_s: NonNegative = 300.0
    scale_down: ScaleDownConfig = field(default_factory=ScaleDownConfig)
    drain: DrainConfig = field(default_factory=DrainConfig)
    predictive: bool | PredictiveConfig = False
    provider: ProviderConfig


class _PoolFile(Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pools: list[_PoolEntry] = field(default_factory=list)


class PoolConfig(Struct, frozen=True, kw_only=True):
    """One validated pool. ``vendor`` and ``capacity_units`` (per node: devices x the model's
    normalised capacity) come from the catalog."""

    name: str
    node: NodeShape
    cost_per_hour: float
    min_size: int
    max_size: int
    provisioning_delay_s: float
    scale_down: ScaleDownConfig
    drain: DrainConfig
    predictive: PredictiveConfig
    provider: ProviderConfig
    vendor: str
    capacity_units: float

    @property
    def provider_type(self) -> str:
        """``exec``, ``kubernetes`` or ``simulated``."""
        return str(type(self.provider).__struct_config__.tag)


class PoolsConfig(Struct, frozen=True, kw_only=True):
    """Every pool of one file, in file order."""

    pools: tuple[PoolConfig, ...] = ()
    source: str = "<none>"

    def get(self, name: str) -> PoolConfig | None:
        """The pool called ``name``, if any."""
        return next((p for p in self.pools if p.name == name), None)

    @property
    def names(self) -> tuple[str, ...]:
        """Pool names in file order."""
        return tuple(p.name for p in self.pools)


def _read(path: Path) -> Any:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise PoolConfigError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        if path.suffix == ".toml":
            return tomllib.loads(text)
        return yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise PoolConfigError(f"{path}: cannot parse: {exc}") from exc


def load_pools(path: str | Path, *, catalog: Catalog | None = None) -> PoolsConfig:
    """Read and validate a YAML or TOML pool file; raise :class:`PoolConfigError`."""
    p = Path(path)
    data = _read(p)
    return parse_pools({} if data is None else data, source=str(p), catalog=catalog)


def _pool_label(data: Any, where: str) -> str:
    """`` (pool 'a100')`` for a path inside ``pools[i]`` whose entry has a name."""
    if not where.startswith("pools[") or not isinstance(data, Mapping):
        return ""
    try:
        index = int(where[len("pools[") : where.index("]")])
        name = data["pools"][index]["name"]
    except (ValueError, KeyError, IndexError, TypeError):
        return ""
    return f" (pool {name!r})" if isinstance(name, str) and name else ""


def _non_finite(data: Any, where: str = "") -> tuple[str, float] | None:
    """The first NaN or infinity in a parsed document (YAML's ``.nan``, ``.inf``; TOML's
    ``nan``, ``inf``), with its path: the types' bounds let an infinity through, and a NaN or
    an infinite grace, cost or cool-down has no meaning the autoscaler could act on."""
    if isinstance(data, float) and not math.isfinite(data):
        return where, data
    items: Any = ()
    if isinstance(data, Mapping):
        items = ((f"{where}.{k}" if where else str(k), v) for k, v in data.items())
    elif isinstance(data, list):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(data))
    for path, value in items:
        found = _non_finite(value, path)
        if found is not None:
            return found
    return None


def parse_pools(
    data: Any, *, source: str = "<pools>", catalog: Catalog | None = None
) -> PoolsConfig:
    """Validate an already-parsed document (YAML/TOML/dict) into a :class:`PoolsConfig`."""
    if not isinstance(data, Mapping):
        raise PoolConfigError(f"{source}: must be a mapping with a `pools` list")
    bad = _non_finite(data)
    if bad is not None:
        path, value = bad
        label = _pool_label(data, path)
        raise PoolConfigError(f"{source}: {path}{label}: must be a finite number, got {value!r}")
    try:
        raw = msgspec.convert(data, _PoolFile)
    except msgspec.ValidationError as exc:
        where, reason = describe_error(exc)
        where = where or "(top)"
        raise PoolConfigError(f"{source}: {where}{_pool_label(data, where)}: {reason}") from exc
    if catalog is None:
        try:
            catalog = load_catalog()
        except CatalogError as exc:
            raise PoolConfigError(f"{source}: the device catalog does not load: {exc}") from exc

    pools: list[PoolConfig] = []
    seen: set[str] = set()
    for i, entry in enumerate(raw.pools):
        where = f"pools[{i}]"

        def fail(
            key: str, message: str, *, _where: str = where, _name: str = entry.name
        ) -> NoReturn:
            raise PoolConfigError(f"{source}: {_where}.{key} (pool {_name!r}): {message}")

        if entry.name in seen:
            fail("name", f"duplicate pool name {entry.name!r}")
        seen.add(entry.name)
        model = catalog.lookup(entry.node.model)
        if model is None:
            known = [e.name for e in catalog]
            close = difflib.get_close_matches(entry.node.model, known, n=3, cutoff=0.5)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            fail(
                "node.model",
                f"unknown device model {entry.node.model!r} (not in the device catalog{hint})",
            )
        if entry.min_size > entry.max_size:
            fail("min_size", f"{entry.min_size} is above max_size {entry.max_size}")
        if entry.drain.policy is DrainPolicy.WAIT and entry.drain.grace_s:
            fail("drain.grace_s", "only applies to policy preempt (policy is wait)")
        cost = entry.cost_per_hour
        if cost is None:
            cost = round(model.cost_per_hour * entry.node.count, 6)
            if cost <= 0:
                fail("cost_per_hour", f"not given, and the catalog has no price for {model.name}")
        provider = entry.provider
        if isinstance(provider, KubernetesProviderConfig):
            if provider.token and provider.token_file:
                fail("provider.token", "give token or token_file, not both")
            if (provider.token or provider.token_file) and not provider.host:
                fail("provider.host", "required with token or token_file")
            if provider.host and provider.kubeconfig:
                fail("provider.kubeconfig", "give host (and a token) or kubeconfig, not both")
        node = msgspec.structs.replace(
            entry.node, model=model.name, interconnect=entry.node.interconnect or model.interconnect
        )
        predictive = entry.predictive
        if isinstance(predictive, bool):
            predictive = PredictiveConfig(enabled=predictive)
        pools.append(
            PoolConfig(
                name=entry.name,
                node=node,
                cost_per_hour=float(cost),
                min_size=entry.min_size,
                max_size=entry.max_size,
                provisioning_delay_s=entry.provisioning_delay_s,
                scale_down=entry.scale_down,
                drain=entry.drain,
                predictive=predictive,
                provider=provider,
                vendor=model.vendor.value,
                capacity_units=round(model.capacity_units * node.count, 6),
            )
        )
    return PoolsConfig(pools=tuple(pools), source=source)


class ReloadOutcome(Struct, frozen=True, kw_only=True):
    """What one :meth:`PoolSource.reload` did: the configuration to use now, whether it changed,
    and why the file was refused (``None`` when it was not)."""

    config: PoolsConfig
    changed: bool
    error: str | None = None


class PoolSource:
    """Holds the current pool configuration and re-reads the file when its mtime changes.

    A bad file at start-up raises :class:`PoolConfigError`; a bad file later is refused and the
    last good configuration stays in force (``last_error`` says why, until a good file loads).
    """

    def __init__(self, path: str | Path | None, *, catalog: Catalog | None = None) -> None:
        self.path = Path(path) if path else None
        self._catalog = catalog
        self._config = PoolsConfig()
        self._mtime_ns = -1
        self.last_error: str | None = None
        if self.path is not None:
            self._config = load_pools(self.path, catalog=catalog)
            self._mtime_ns = self.path.stat().st_mtime_ns

    def current(self) -> PoolsConfig:
        """The configuration in force (no file access)."""
        return self._config

    def reload(self) -> ReloadOutcome:
        """Re-read the file if it changed since the last attempt."""
        if self.path is None:
            return ReloadOutcome(config=self._config, changed=False)
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError as exc:
            self.last_error = f"{self.path}: cannot read: {exc.strerror or exc}"
            self._mtime_ns = -2
            return ReloadOutcome(config=self._config, changed=False, error=self.last_error)
        if mtime == self._mtime_ns:
            return ReloadOutcome(config=self._config, changed=False, error=self.last_error)
        self._mtime_ns = mtime
        try:
            config = load_pools(self.path, catalog=self._catalog)
        except PoolConfigError as exc:
            self.last_error = str(exc)
            return ReloadOutcome(config=self._config, changed=False, error=self.last_error)
        self.last_error = None
        changed = config != self._config
        self._config = config
        return ReloadOutcome(config=config, changed=changed)
