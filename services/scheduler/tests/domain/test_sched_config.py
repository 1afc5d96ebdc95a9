"""The operator's queue/policy file: loading, validation, defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from xpupool.scheduler.domain import ConfigError, default_config, load_config, parse_config
from xpupool.scheduler.domain.config import ROOT

YAML = """
priority_classes: {low: 100, normal: 500, high: 900, critical: 1000}
default_priority: normal
tenants: {alice: vision}
preemption: {min_runtime_s: 120}
fair_share: {half_life_s: 1800}
starvation: {after_s: 300}
queues:
  - name: research
    weight: 2
    guaranteed: {units: 16, devices: {A100: 8}}
    limit: {units: 32}
    placement: xpupool
    children:
      - {name: vision, guaranteed: {units: 8}}
      - {name: nlp, guaranteed: {units: 8}, over_quota: false}
  - name: batch
    placement: binpack
    preemptible: true
    tenants: [bob]
"""

TOML = """
default_priority = "normal"
[[queues]]
name = "prod"
weight = 3.0
[queues.guaranteed]
units = 4
[[queues]]
name = "dev"
[queues.limit]
units = 2
"""


def test_load_yaml_tree(tmp_path: Path):
    """A YAML file yields the queue tree, tenant map and policy settings."""
    p = tmp_path / "sched.yaml"
    p.write_text(YAML)
    cfg = load_config(p)
    assert cfg.queues[ROOT].children == ("research", "batch")
    assert cfg.queues["vision"].parent == "research"
    assert cfg.path("vision") == ("vision", "research", ROOT)
    assert cfg.resolve_queue("alice", None) == "vision"
    assert cfg.resolve_queue("bob", None) == "batch"
    assert cfg.queues["research"].guaranteed_devices == {"A100": 8.0}
    assert cfg.queues["nlp"].over_quota is False
    assert cfg.preemption.min_runtime_s == 120 and cfg.fair_share.half_life_s == 1800


def test_load_toml(tmp_path: Path):
    """A TOML file with the same schema loads too."""
    p = tmp_path / "sched.toml"
    p.write_text(TOML)
    cfg = load_config(p)
    assert cfg.queues["prod"].weight == 3.0 and cfg.queues["dev"].limit_units == 2.0


@pytest.mark.parametrize(
    ("doc", "where"),
    [
        ({"queues": [{"name": "a", "weight": 0}]}, "queues[0].weight"),
        ({"queues": [{"name": "a", "weight": float("inf")}]}, "queues[0].weight"),
        ({"queues": [{"name": "a", "limit": {"units": float("nan")}}]}, "queues[0].limit.units"),
        ({"preemption": {"grace_s": float("inf")}}, "preemption.grace_s"),
        (
            {"queues": [{"name": "a", "guaranteed": {"units": 4}, "limit": {"units": 2}}]},
            "queues[0].limit.units",
        ),
        ({"queues": [{"name": "a"}, {"name": "a"}]}, "queues[1].name"),
        ({"queues": [{"name": "a", "placement": "magic"}]}, "queues[0].placement"),
        ({"queues": [{"name": "a", "wieght": 2}]}, "queues[0].wieght"),
        ({"default_priority": "urgent"}, "default_priority"),
        ({"tenants": {"x": "missing"}}, "tenants.x"),
        (
            {
                "queues": [
                    {
                        "name": "p",
                        "guaranteed": {"units": 1},
                        "children": [{"name": "c", "guaranteed": {"units": 2}}],
                    }
                ]
            },
            "queues[0].guaranteed.units",
        ),
        (
            {"queues": [{"name": "p", "children": [{"name": "c"}]}], "tenants": {"x": "p"}},
            "tenants.x",
        ),
    ],
)
def test_validation_errors_name_the_key(doc, where):
    """Each invalid document raises ConfigError naming the offending key."""
    with pytest.raises(ConfigError) as e:
        parse_config(doc, source="f.yaml")
    assert f"f.yaml: {where}:" in str(e.value)


def test_unparseable_file(tmp_path: Path):
    """A file that is not valid YAML raises ConfigError with the path."""
    p = tmp_path / "bad.yaml"
    p.write_text("queues: [\n")
    with pytest.raises(ConfigError, match="bad.yaml: cannot parse"):
        load_config(p)


def test_default_config_per_tenant_queues():
    """Without a file, every tenant gets an unlimited queue named after itself under root."""
    cfg = default_config()
    assert cfg.resolve_queue("alice", None) == "alice"
    assert cfg.resolve_queue("alice", "alice") == "alice"
    assert cfg.resolve_queue("alice", "bob") is None
    q = cfg.queue("alice")
    assert q is not None and q.limit_units is None and q.parent == ROOT
    assert cfg.priority_value("high") == 900 and cfg.priority_value("750") == 750


def test_queues_a_tenant_may_charge_are_the_ones_the_file_lists() -> None:
    """A tenant charges its default queue (mapped, listed or named after it) and queues that list
    it or ``*``; any other named queue is refused, so no tenant spends another's guarantee."""
    cfg = parse_config(
        {
            "tenants": {"alice": "vision"},
            "queues": [
                {"name": "vision", "tenants": ["carol"]},
                {"name": "shared", "tenants": ["*"]},
                {"name": "bob"},
                {"name": "private", "tenants": ["dave"]},
            ],
        }
    )
    assert cfg.may_charge("alice", None) and cfg.may_charge("alice", "vision")
    assert cfg.may_charge("carol", "vision") and cfg.may_charge("anyone", "shared")
    assert cfg.may_charge("bob", "bob")  # a configured queue named after the tenant is its own
    assert cfg.may_charge("erin", "erin")  # an auto tenant queue
    assert not cfg.may_charge("alice", "private")
    assert not cfg.may_charge("mallory", "vision")
    assert not cfg.may_charge("mallory", "bob")
    assert not cfg.may_charge("mallory", "dave")  # another tenant's auto queue


def test_tenant_limits_and_priority_names_are_validated() -> None:
    """Per-tenant admission limits parse with a default; priority classes must be the
    contract's names."""
    cfg = parse_config(
        {"tenant_limits": {"default": {"rate_per_s": 5}, "flood": {"burst": 2, "max_pending": 3}}}
    )
    assert cfg.limits_for("anyone").rate_per_s == 5
    assert (cfg.limits_for("flood").burst, cfg.limits_for("flood").max_pending) == (2, 3)
    with pytest.raises(ConfigError, match="priority_classes.urgent"):
        parse_config({"priority_classes": {"urgent": 950, "normal": 500}})
    with pytest.raises(ConfigError, match="tenant_limits.x.colour"):
        parse_config({"tenant_limits": {"x": {"colour": 1}}})


def test_a_tenant_on_several_queues_defaults_to_its_own_or_the_first():
    """Queue-level ``tenants`` lists say who may charge a queue; a tenant listed on several
    defaults to the queue named after it, else to the first listing it (not the last), and
    the top-level ``tenants`` mapping overrides both."""
    cfg = parse_config(
        {
            "queues": [
                {"name": "long", "tenants": ["research", "ops"]},
                {"name": "research", "tenants": ["research"], "max_runtime_s": 2.5},
                {"name": "short", "tenants": ["ops"]},
            ]
        }
    )
    assert cfg.resolve_queue("research", None) == "research"
    assert cfg.resolve_queue("ops", None) == "long"
    research = cfg.queue("research")
    assert research is not None and research.max_runtime_s == 2.5
    mapped = parse_config(
        {
            "tenants": {"ops": "short"},
            "queues": [{"name": "long", "tenants": ["ops"]}, {"name": "short"}],
        }
    )
    assert mapped.resolve_queue("ops", None) == "short"


def test_what_a_parent_queue_sets_for_its_leases_holds_for_its_subtree() -> None:
    """Jobs name leaf queues, and only the leaf's settings were read: a parent's
    ``preemptible: false`` protected none of its children's leases, and its placement policy,
    maximum run time and idle reclaim reached none of them. A child inherits them unless it sets
    its own; a parent's maximum run time bounds its children's."""
    cfg = parse_config(
        {
            "queues": [
                {
                    "name": "research",
                    "preemptible": False,
                    "placement": "binpack",
                    "max_runtime_s": 3600,
                    "idle_reclaim_s": 600,
                    "children": [
                        {"name": "vision"},
                        {
                            "name": "nlp",
                            "preemptible": True,
                            "placement": "spread",
                            "max_runtime_s": 86400,
                            "idle_reclaim_s": 60,
                        },
                        {"name": "short", "max_runtime_s": 60},
                    ],
                },
                {"name": "batch"},
            ]
        }
    )
    vision, nlp, short, batch = (cfg.queues[n] for n in ("vision", "nlp", "short", "batch"))
    assert (vision.preemptible, vision.placement, vision.max_runtime_s, vision.idle_reclaim_s) == (
        False,
        "binpack",
        3600,
        600,
    )
    assert (nlp.preemptible, nlp.placement, nlp.max_runtime_s, nlp.idle_reclaim_s) == (
        True,
        "spread",
        3600,
        60,
    )
    assert short.max_runtime_s == 60
    assert (batch.preemptible, batch.placement, batch.max_runtime_s) == (True, None, None)
