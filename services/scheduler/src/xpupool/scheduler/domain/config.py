"""Queue tree and policy configuration: the file the operator edits and the scheduler reloads.

The file is YAML (``.yaml``/``.yml``) or TOML (``.toml``) with this shape (every key optional)::

    priority_classes: {low: 100, normal: 500, high: 900, critical: 1000}
    default_priority: normal
    auto_tenant_queues: true        # a tenant without a mapping gets a queue named after it
    tenants: {alice: vision}        # tenant -> its default leaf queue (which it may charge)
    tenant_limits:                  # admission limits per tenant; `default` for the rest
      default: {rate_per_s: 1000, burst: 2000, max_pending: 20000}
      alice: {rate_per_s: 50, burst: 100, max_pending: 500}
    preemption: {enabled: true, min_runtime_s: 300, max_victims: 16, max_candidate_nodes: 64}
    fair_share: {half_life_s: 3600, history_weight: 0.5}
    aging: {rate_per_s: 0.5, max_boost: 400}
    starvation: {after_s: 600, max_holds: 1, backfill_max_duration_s: 0}
    placement: {default_policy: xpupool, hot_util_pct: 85, typical_share_pct: 25}
    queues:
      - name: research
        weight: 2
        guaranteed: {units: 16, devices: {A100-SXM4-80GB: 8}}
        limit: {units: 32}
        over_quota: true
        placement: xpupool
        preemptible: true
        children:
          - {name: vision, guaranteed: {units: 8}, tenants: [bob]}

Top-level queues hang under an implicit, unlimited ``root``. Queue names are unique across the
tree; jobs (and ``tenants``) name a leaf queue. **Who may charge a queue** is listed here and
nowhere else: a tenant may charge the leaf queues whose ``tenants`` list names it (``"*"``: every
tenant) and its default queue: the one the top-level ``tenants`` map gives it, else the queue
named after it (configured, or created with ``auto_tenant_queues``). A request naming any other
queue is rejected (``queue_not_allowed``). Units are normalized capacity units (A100 = 1.0);
``devices`` maps a device model to a device count (a share counts as the fraction of the device
it takes).
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

import yaml

from xpupool.contracts import Priority
from xpupool.placement.engine import PlacementConfig
from xpupool.placement.pool import WorkingPool

__all__ = [
    "BUILTIN_POLICIES",
    "DEFAULT_PRIORITY_CLASSES",
    "ROOT",
    "AgingConfig",
    "ConfigError",
    "FairShareConfig",
    "PlacementConfig",
    "PreemptionConfig",
    "QueueConfig",
    "SchedulerConfig",
    "StarvationConfig",
    "TenantLimits",
    "default_config",
    "load_config",
    "parse_config",
]

ROOT: Final = "root"
BUILTIN_POLICIES: Final = ("xpupool", "heuristic", "binpack", "spread")
DEFAULT_PRIORITY_CLASSES: Final[Mapping[str, int]] = {
    "low": 100,
    "normal": 500,
    "high": 900,
    "critical": 1000,
}


class ConfigError(ValueError):
    """The configuration file is malformed; the message names the file and the offending key."""


@dataclass(frozen=True, slots=True)
class QueueConfig:
    """One queue of the tree. ``None`` limits mean unlimited.

    ``over_quota`` allows borrowing idle capacity beyond the guarantee (reclaimable);
    ``preemptible`` lets the queue's leases be preempted at all; ``max_runtime_s`` bounds how
    long its leases live, renewals included (a request's own limit, if smaller, wins). Those
    two, ``placement`` and ``idle_reclaim_s`` are as the file set them here or on the nearest
    ancestor that did (a parent's ``max_runtime_s`` bounding its children's).
    """

    name: str
    parent: str | None = ROOT
    weight: float = 1.0
    guaranteed_units: float = 0.0
    limit_units: float | None = None
    guaranteed_devices: Mapping[str, float] = field(default_factory=dict)
    limit_devices: Mapping[str, float] = field(default_factory=dict)
    over_quota: bool = True
    placement: str | None = None
    preemptible: bool = True
    children: tuple[str, ...] = ()
    max_runtime_s: float | None = None
    #: Opt-in idle reclaim: a lease whose devices do no work this long is warned, then ended.
    idle_reclaim_s: float | None = None

    @property
    def is_leaf(self) -> bool:
        """Only leaf queues take jobs."""
        return not self.children


@dataclass(frozen=True, slots=True)
class TenantLimits:
    """A tenant's admission limits: a token bucket of ``rate_per_s`` requests per second with
    ``burst`` of headroom (0: unlimited), and the most requests it may have pending at once
    (``max_pending`` < 0: unlimited)."""

    rate_per_s: float = 1000.0
    burst: int = 2000
    max_pending: int = 20000


@dataclass(frozen=True, slots=True)
class PreemptionConfig:
    """When and how far the scheduler may preempt."""

    enabled: bool = True
    min_runtime_s: float = 300.0
    max_victims: int = 16
    max_candidate_nodes: int = 64
    #: A victim is warned (``LeaseEnding``, reason ``preempted``) and keeps its slices this long
    #: before they are reclaimed; releasing within it ends the lease ``released``.
    grace_s: float = 0.0


@dataclass(frozen=True, slots=True)
class FairShareConfig:
    """Decay of recent usage in the weighted dominant-resource share."""

    half_life_s: float = 3600.0
    history_weight: float = 0.5


@dataclass(frozen=True, slots=True)
class _Inherited:
    """What a queue file's queue passes down to its children unless they set their own."""

    placement: str | None = None
    preemptible: bool = True
    max_runtime_s: float | None = None
    idle_reclaim_s: float | None = None


@dataclass(frozen=True, slots=True)
class AgingConfig:
    """Waiting raises a request's ordering priority (never its preemption rights)."""

    rate_per_s: float = 0.5
    max_boost: float = 400.0


@dataclass(frozen=True, slots=True)
class StarvationConfig:
    """A request waiting longer than ``after_s`` holds nodes so small requests cannot take them.

    ``backfill_max_duration_s`` > 0 lets requests declaring an ``expected_duration_s`` at most that
    long still use held nodes.
    """

    after_s: float = 600.0
    max_holds: int = 1
    backfill_max_duration_s: float = 0.0


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """The whole policy configuration; build it with :func:`parse_config` or :func:`default_config`.

    Queues are keyed by name and include ``root``.
    """

    queues: Mapping[str, QueueConfig]
    priority_classes: Mapping[str, int] = field(
        default_factory=lambda: dict(DEFAULT_PRIORITY_CLASSES)
    )
    default_priority: str = "normal"
    tenants: Mapping[str, str] = field(default_factory=dict)
    auto_tenant_queues: bool = True
    # queue -> tenants that may charge it ("*": any); see may_charge.
    queue_tenants: Mapping[str, frozenset[str]] = field(default_factory=dict)
    tenant_limits: Mapping[str, TenantLimits] = field(default_factory=dict)
    default_tenant_limits: TenantLimits = TenantLimits()
    preemption: PreemptionConfig = PreemptionConfig()
    fair_share: FairShareConfig = FairShareConfig()
    aging: AgingConfig = AgingConfig()
    starvation: StarvationConfig = StarvationConfig()
    placement: PlacementConfig = PlacementConfig()
    # Memo of derived, immutable answers (auto queues, paths): the hot path asks them per request.
    _memo: dict[tuple[str, str], object] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )

    def queue(self, name: str) -> QueueConfig | None:
        """The queue called ``name``; an auto tenant queue is synthesized when enabled."""
        q = self.queues.get(name)
        if q is None and self.auto_tenant_queues and name != ROOT:
            key = ("queue", name)
            hit = self._memo.get(key)
            if not isinstance(hit, QueueConfig):
                hit = self._memo[key] = QueueConfig(name=name)
            return hit
        return q

    def path(self, name: str) -> tuple[str, ...]:
        """Queue names from ``name`` up to ``root`` (inclusive); unknown names hang off root."""
        key = ("path", name)
        hit = self._memo.get(key)
        if isinstance(hit, tuple):
            return hit
        out: list[str] = []
        cur: str | None = name
        while cur is not None and cur not in out:
            out.append(cur)
            q = self.queues.get(cur)
            cur = q.parent if q is not None else (ROOT if cur != ROOT else None)
        path = self._memo[key] = tuple(out)
        return path

    def resolve_queue(self, tenant: str, queue: str | None) -> str | None:
        """The leaf queue a job of ``tenant`` naming ``queue`` goes to, or ``None`` if invalid."""
        if queue is not None:
            q = self.queues.get(queue)
            if q is not None:
                return queue if q.is_leaf and queue != ROOT else None
            return queue if self.auto_tenant_queues and queue == tenant else None
        mapped = self.tenants.get(tenant)
        if mapped is not None:
            return mapped
        if tenant in self.queues:
            return tenant if self.queues[tenant].is_leaf else None
        return tenant if self.auto_tenant_queues else None

    def may_charge(self, tenant: str, queue: str | None) -> bool:
        """Whether ``tenant`` may put a job on ``queue`` (None: its default queue, always)."""
        if queue is None or queue == self.resolve_queue(tenant, None):
            return True  # its default queue: mapped to it, named after it, or auto-created
        allowed = self.queue_tenants.get(queue, frozenset())
        return tenant in allowed or "*" in allowed

    def limits_for(self, tenant: str) -> TenantLimits:
        """The admission limits of ``tenant``."""
        return self.tenant_limits.get(tenant, self.default_tenant_limits)

    def charge_queue(self, tenant: str, queue: str) -> str:
        """The queue an existing lease is charged to, even after a reload removed its queue."""
        if queue in self.queues:
            return queue
        if self.auto_tenant_queues:
            return queue or tenant
        return ROOT

    def priority_value(self, name: str) -> int | None:
        """The number of priority class ``name`` (an integer string is taken literally)."""
        v = self.priority_classes.get(name)
        if v is None and name.lstrip("-").isdigit():
            return int(name)
        return v


def default_config() -> SchedulerConfig:
    """The configuration without a file: one unlimited root, a queue per tenant under it."""
    return SchedulerConfig(queues={ROOT: QueueConfig(name=ROOT, parent=None)})


def load_config(
    path: str | Path, *, known_policies: tuple[str, ...] = BUILTIN_POLICIES
) -> SchedulerConfig:
    """Read and validate a YAML or TOML configuration file; raise :class:`ConfigError`."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc}") from exc
    try:
        if p.suffix == ".toml":
            data: Any = tomllib.loads(text)
        else:
            data = yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{p}: cannot parse: {exc}") from exc
    return parse_config({} if data is None else data, source=str(p), known_policies=known_policies)


# ----------------------------------------------------------------------------------------------
# Validation helpers: each takes the dotted location so errors point at the offending key.
# ----------------------------------------------------------------------------------------------


class _Ctx:
    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, where: str, msg: str) -> ConfigError:
        return ConfigError(f"{self.source}: {where}: {msg}")

    def mapping(
        self, v: object, where: str, allowed: frozenset[str] | None = None
    ) -> Mapping[str, Any]:
        if not isinstance(v, Mapping):
            raise self.fail(where, f"must be a mapping, got {type(v).__name__}")
        for k in v:
            if not isinstance(k, str):
                raise self.fail(where, f"keys must be strings, got {k!r}")
            if allowed is not None and k not in allowed:
                raise self.fail(
                    f"{where}.{k}" if where else k,
                    f"unknown key (allowed: {', '.join(sorted(allowed))})",
                )
        return v

    def number(self, v: object, where: str, *, minimum: float = 0.0, strict: bool = False) -> float:
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise self.fail(where, f"must be a number, got {v!r}")
        f = float(v)
        # YAML's .nan and .inf, and JSON's NaN: a NaN limit compares false with everything, so
        # it would let any use through, and unlimited is written by leaving a limit out.
        if not math.isfinite(f):
            raise self.fail(where, f"must be a finite number, got {v!r}")
        if f < minimum or (strict and f <= minimum):
            raise self.fail(where, f"must be {'>' if strict else '>='} {minimum:g}, got {v!r}")
        return f

    def integer(self, v: object, where: str, *, minimum: int | None = None) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(where, f"must be an integer, got {v!r}")
        if minimum is not None and v < minimum:
            raise self.fail(where, f"must be >= {minimum}, got {v!r}")
        return v

    def boolean(self, v: object, where: str) -> bool:
        if not isinstance(v, bool):
            raise self.fail(where, f"must be true or false, got {v!r}")
        return v

    def string(self, v: object, where: str) -> str:
        if not isinstance(v, str) or not v:
            raise self.fail(where, f"must be a non-empty string, got {v!r}")
        return v

    def devices(self, v: object, where: str) -> dict[str, float]:
        m = self.mapping(v, where)
        return {k: self.number(n, f"{where}.{k}") for k, n in m.items()}


_QUEUE_KEYS = frozenset(
    {
        "name",
        "weight",
        "guaranteed",
        "limit",
        "over_quota",
        "placement",
        "preemptible",
        "max_runtime_s",
        "idle_reclaim_s",
        "tenants",
        "children",
    }
)
_QUOTA_KEYS = frozenset({"units", "devices"})
_TOP_KEYS = frozenset(
    {
        "priority_classes",
        "default_priority",
        "auto_tenant_queues",
        "tenants",
        "tenant_limits",
        "preemption",
        "fair_share",
        "aging",
        "starvation",
        "placement",
        "queues",
    }
)


def parse_config(
    data: Mapping[str, Any],
    *,
    source: str = "<config>",
    known_policies: tuple[str, ...] = BUILTIN_POLICIES,
) -> SchedulerConfig:
    """Validate an already-parsed document (YAML/TOML/dict) into a :class:`SchedulerConfig`."""
    c = _Ctx(source)
    top = c.mapping(data, "", _TOP_KEYS)

    prio_raw = top.get("priority_classes", DEFAULT_PRIORITY_CLASSES)
    prio = {
        k: c.integer(v, f"priority_classes.{k}")
        for k, v in c.mapping(prio_raw, "priority_classes").items()
    }
    if not prio:
        raise c.fail("priority_classes", "must name at least one class")
    names = {p.value for p in Priority}
    for name in prio:
        if name not in names:
            raise c.fail(
                f"priority_classes.{name}",
                f"not a priority name of the contract ({', '.join(sorted(names))})",
            )
    default_priority = c.string(top.get("default_priority", "normal"), "default_priority")
    if default_priority not in prio:
        raise c.fail(
            "default_priority", f"{default_priority!r} is not a priority class ({', '.join(prio)})"
        )

    pre = c.mapping(
        top.get("preemption", {}), "preemption", frozenset(PreemptionConfig.__dataclass_fields__)
    )
    preemption = PreemptionConfig(
        enabled=c.boolean(pre.get("enabled", True), "preemption.enabled"),
        min_runtime_s=c.number(pre.get("min_runtime_s", 300.0), "preemption.min_runtime_s"),
        max_victims=c.integer(pre.get("max_victims", 16), "preemption.max_victims", minimum=1),
        max_candidate_nodes=c.integer(
            pre.get("max_candidate_nodes", 64), "preemption.max_candidate_nodes", minimum=1
        ),
        grace_s=c.number(pre.get("grace_s", 0.0), "preemption.grace_s"),
    )
    fs = c.mapping(
        top.get("fair_share", {}), "fair_share", frozenset(FairShareConfig.__dataclass_fields__)
    )
    fair_share = FairShareConfig(
        half_life_s=c.number(fs.get("half_life_s", 3600.0), "fair_share.half_life_s", strict=True),
        history_weight=c.number(fs.get("history_weight", 0.5), "fair_share.history_weight"),
    )
    if fair_share.history_weight > 1.0:
        raise c.fail("fair_share.history_weight", "must be between 0 and 1")
    ag = c.mapping(top.get("aging", {}), "aging", frozenset(AgingConfig.__dataclass_fields__))
    aging = AgingConfig(
        rate_per_s=c.number(ag.get("rate_per_s", 0.5), "aging.rate_per_s"),
        max_boost=c.number(ag.get("max_boost", 400.0), "aging.max_boost"),
    )
    st = c.mapping(
        top.get("starvation", {}), "starvation", frozenset(StarvationConfig.__dataclass_fields__)
    )
    starvation = StarvationConfig(
        after_s=c.number(st.get("after_s", 600.0), "starvation.after_s"),
        max_holds=c.integer(st.get("max_holds", 1), "starvation.max_holds", minimum=0),
        backfill_max_duration_s=c.number(
            st.get("backfill_max_duration_s", 0.0), "starvation.backfill_max_duration_s"
        ),
    )
    pl = c.mapping(
        top.get("placement", {}), "placement", frozenset(PlacementConfig.__dataclass_fields__)
    )
    placement = PlacementConfig(
        default_policy=c.string(pl.get("default_policy", "xpupool"), "placement.default_policy"),
        hot_util_pct=c.number(pl.get("hot_util_pct", 85.0), "placement.hot_util_pct"),
        typical_share_pct=c.number(
            pl.get("typical_share_pct", 25.0), "placement.typical_share_pct"
        ),
    )
    if placement.default_policy not in known_policies:
        raise c.fail(
            "placement.default_policy",
            f"unknown policy {placement.default_policy!r} (known: {', '.join(known_policies)})",
        )

    queues: dict[str, QueueConfig] = {}
    tenants: dict[str, str] = {}
    queue_tenants: dict[str, set[str]] = {}

    def parse_queue(raw: object, where: str, parent: str, above: _Inherited) -> str:
        q = c.mapping(raw, where, _QUEUE_KEYS)
        name = c.string(q.get("name"), f"{where}.name")
        if name == ROOT:
            raise c.fail(f"{where}.name", f"{ROOT!r} is reserved for the implicit top of the tree")
        if name in queues:
            raise c.fail(f"{where}.name", f"duplicate queue name {name!r}")
        queues[name] = QueueConfig(name=name)  # claims the name before children recurse
        g = c.mapping(q.get("guaranteed", {}), f"{where}.guaranteed", _QUOTA_KEYS)
        lim = c.mapping(q.get("limit", {}), f"{where}.limit", _QUOTA_KEYS)
        g_units = c.number(g.get("units", 0.0), f"{where}.guaranteed.units")
        l_units = (
            None if lim.get("units") is None else c.number(lim["units"], f"{where}.limit.units")
        )
        if l_units is not None and l_units < g_units:
            raise c.fail(
                f"{where}.limit.units", f"limit {l_units:g} is below the guarantee {g_units:g}"
            )
        g_dev = c.devices(g.get("devices", {}), f"{where}.guaranteed.devices")
        l_dev = c.devices(lim.get("devices", {}), f"{where}.limit.devices")
        for model, n in g_dev.items():
            if model in l_dev and l_dev[model] < n:
                raise c.fail(
                    f"{where}.limit.devices.{model}",
                    f"limit {l_dev[model]:g} is below the guarantee {n:g}",
                )
        policy = q.get("placement")
        if policy is not None:
            policy = c.string(policy, f"{where}.placement")
            if policy not in known_policies:
                raise c.fail(
                    f"{where}.placement",
                    f"unknown policy {policy!r} (known: {', '.join(known_policies)})",
                )
        # What a queue sets for its leases holds for its subtree too (jobs name leaf queues,
        # which alone were read: a parent's ``preemptible: false`` protected nothing). A child
        # may set its own; a parent's maximum run time bounds its children's.
        own_runtime = (
            None
            if q.get("max_runtime_s") is None
            else c.number(q["max_runtime_s"], f"{where}.max_runtime_s", strict=True)
        )
        here = _Inherited(
            placement=policy if policy is not None else above.placement,
            preemptible=c.boolean(q.get("preemptible", above.preemptible), f"{where}.preemptible"),
            max_runtime_s=min(
                (x for x in (own_runtime, above.max_runtime_s) if x is not None), default=None
            ),
            idle_reclaim_s=(
                above.idle_reclaim_s
                if q.get("idle_reclaim_s") is None
                else c.number(q["idle_reclaim_s"], f"{where}.idle_reclaim_s", strict=True)
            ),
        )
        for t in q.get("tenants", []) or []:
            tenant = c.string(t, f"{where}.tenants")
            queue_tenants.setdefault(name, set()).add(tenant)
            if tenant != "*":
                # A tenant listed on several queues defaults to the first (or, below, to the
                # one named after it); ``tenants:`` at the top maps it explicitly.
                tenants.setdefault(tenant, name)
        kids_raw = q.get("children", []) or []
        if not isinstance(kids_raw, list):
            raise c.fail(f"{where}.children", "must be a list of queues")
        kids = tuple(
            parse_queue(k, f"{where}.children[{i}]", name, here) for i, k in enumerate(kids_raw)
        )
        if g_units > 0:
            kid_sum = sum(queues[k].guaranteed_units for k in kids)
            if kid_sum > g_units + 1e-9:
                raise c.fail(
                    f"{where}.guaranteed.units",
                    f"children guarantee {kid_sum:g} units, more than the queue's {g_units:g}",
                )
        queues[name] = QueueConfig(
            name=name,
            parent=parent,
            weight=c.number(q.get("weight", 1.0), f"{where}.weight", strict=True),
            guaranteed_units=g_units,
            limit_units=l_units,
            guaranteed_devices=g_dev,
            limit_devices=l_dev,
            over_quota=c.boolean(q.get("over_quota", True), f"{where}.over_quota"),
            placement=here.placement,
            preemptible=here.preemptible,
            children=kids,
            max_runtime_s=here.max_runtime_s,
            idle_reclaim_s=here.idle_reclaim_s,
        )
        return name

    top_raw = top.get("queues", []) or []
    if not isinstance(top_raw, list):
        raise c.fail("queues", "must be a list of queues")
    top_names = tuple(
        parse_queue(q, f"queues[{i}]", ROOT, _Inherited()) for i, q in enumerate(top_raw)
    )
    queues[ROOT] = QueueConfig(name=ROOT, parent=None, children=top_names)

    for tenant in list(tenants):
        own = queues.get(tenant)
        if own is not None and own.is_leaf and tenant in queue_tenants.get(tenant, ()):
            tenants[tenant] = tenant
    for tenant, qname in c.mapping(top.get("tenants", {}), "tenants").items():
        tenants[tenant] = c.string(qname, f"tenants.{tenant}")
    for tenant, qname in tenants.items():
        target = queues.get(qname)
        if target is None:
            raise c.fail(f"tenants.{tenant}", f"unknown queue {qname!r}")
        if not target.is_leaf or qname == ROOT:
            raise c.fail(
                f"tenants.{tenant}", f"queue {qname!r} is not a leaf; jobs go to leaf queues"
            )

    for qname in queue_tenants:
        if not queues[qname].is_leaf:
            raise c.fail(f"queue {qname}.tenants", "only leaf queues take jobs")

    limits_raw = c.mapping(top.get("tenant_limits", {}), "tenant_limits")
    limits = {
        tenant: _tenant_limits(c, raw, f"tenant_limits.{tenant}")
        for tenant, raw in limits_raw.items()
    }
    default_limits = limits.pop("default", TenantLimits())

    return SchedulerConfig(
        queues=queues,
        priority_classes=prio,
        default_priority=default_priority,
        tenants=tenants,
        auto_tenant_queues=c.boolean(top.get("auto_tenant_queues", True), "auto_tenant_queues"),
        queue_tenants={q: frozenset(ts) for q, ts in queue_tenants.items()},
        tenant_limits=limits,
        default_tenant_limits=default_limits,
        preemption=preemption,
        fair_share=fair_share,
        aging=aging,
        starvation=starvation,
        placement=placement,
    )


_LIMIT_KEYS = frozenset({"rate_per_s", "burst", "max_pending"})


def _tenant_limits(c: _Ctx, raw: object, where: str) -> TenantLimits:
    m = c.mapping(raw, where, _LIMIT_KEYS)
    base = TenantLimits()
    return TenantLimits(
        rate_per_s=c.number(m.get("rate_per_s", base.rate_per_s), f"{where}.rate_per_s"),
        burst=c.integer(m.get("burst", base.burst), f"{where}.burst"),
        max_pending=c.integer(m.get("max_pending", base.max_pending), f"{where}.max_pending"),
    )


def with_queues(config: SchedulerConfig, *queues: QueueConfig) -> SchedulerConfig:
    """A copy of ``config`` with ``queues`` added under their parents (for tests and tools)."""
    qs = dict(config.queues)
    for q in queues:
        qs[q.name] = q
        parent = q.parent or ROOT
        pq = qs.get(parent, QueueConfig(name=parent, parent=None if parent == ROOT else ROOT))
        if q.name not in pq.children:
            qs[parent] = replace(pq, children=(*pq.children, q.name))
    return replace(config, queues=qs)


def config_of(pool: WorkingPool) -> SchedulerConfig:
    """The scheduler configuration a working pool was built with (its accounts)."""
    accounts = pool.config
    if not isinstance(accounts, SchedulerConfig):
        raise TypeError(f"this pool charges {type(accounts).__name__}, not a SchedulerConfig")
    return accounts
